"""``python -m benchmarks`` writes a fresh folder per run; only ``--update`` (a full run of
every scenario and peer) replaces the committed ``benchmarks/results.*`` (issue 17)."""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from asynclock.testing import available_engines
from benchmarks.harness import main
from benchmarks.server import KINDS, count_instructions, in_round, render

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = [ROOT / "benchmarks" / f"results.{ext}" for ext in ("json", "md", "png")]


def _digests() -> dict[Path, str]:
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in COMMITTED if p.exists()}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--quick", "--update"], "--quick"),
        (["--update", "--scenarios", "cycle-1"], "--scenarios"),
        (["--update", "--peers", "asynclock,raw"], "--peers"),
        (["--update", "--runs", "1"], "--runs"),
        (["--quick", "--out", str(ROOT / "benchmarks")], "--update"),
    ],
    ids=["quick", "scenarios", "peers", "runs", "out-committed"],
)
def test_committed_results_are_refused_before_anything_runs(args: list[str], message: str) -> None:
    before = _digests()
    with pytest.raises(SystemExit, match=message):
        main(args)
    assert _digests() == before


def test_update_and_out_exclude_each_other(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--update", "--out", "somewhere"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_report_only_writes_next_to_its_json(tmp_path: Path) -> None:
    before = _digests()
    source = tmp_path / "results.json"
    shutil.copy(ROOT / "benchmarks" / "results.json", source)
    assert main(["--report-only", str(source)]) == 0
    assert (tmp_path / "results.md").read_text().strip()
    assert _digests() == before


@pytest.mark.skipif(not available_engines(), reason="no redis-server or valkey-server binary")
def test_a_quick_run_writes_a_fresh_folder(tmp_path: Path) -> None:
    """A real (tiny) quick run, its runs/ folder moved under tmp_path: it writes there and
    leaves the committed results as they were."""
    before = _digests()
    runs = tmp_path / "runs"
    code = (
        "import sys; from pathlib import Path; import benchmarks.harness as h; "
        "h.RUNS = Path(sys.argv[1]); sys.exit(h.main(sys.argv[2:]))"
    )
    args = ["--quick", "--scenarios", "cycle-1", "--peers", "asynclock,raw", "--runs", "1"]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, "-c", code, str(runs), *args, "--no-pin"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (folder,) = runs.iterdir()
    assert folder.name.endswith("-quick")
    assert (folder / "results.json").exists()
    assert (folder / "results.md").exists()
    assert f"results in {folder}/" in done.stdout
    assert _digests() == before


@pytest.mark.skipif(
    not (shutil.which("valgrind") and shutil.which("redis-server")),
    reason="no valgrind or no redis-server on PATH",
)
def test_instructions_are_counted_per_cycle_under_callgrind() -> None:
    """``python -m benchmarks.server --instructions``: the server's instructions per cycle
    of a kind, all and inside the commands sent (those fewer), the mutex above the
    recipe (two scripts and seven commands against one script and three)."""
    recipe, mutex = KINDS[0], next(k for k in KINDS if k.label == "asynclock mutex")
    counts = asyncio.run(count_instructions(40, (recipe, mutex)))
    (all_recipe, in_recipe), (all_mutex, in_mutex) = counts[recipe.label], counts[mutex.label]
    assert 0 < in_recipe < all_recipe
    assert 0 < in_mutex < all_mutex
    assert in_mutex > 2 * in_recipe


def test_server_ratios_are_medians_of_in_round_ratios() -> None:
    """The server section's ratios compare the kinds within each round of their turns
    (here 3.0x in every round, whatever the machine's speed in that round), not the
    medians of each kind's blocks (given here as 6.0 against 1.0); results without
    rounds (older runs) keep the medians' ratio."""
    rounds = {"recipe": [1.0, 4.0, 1.0, 4.0, 2.0], "mutex": [3.0, 12.0, 3.0, 12.0, 6.0]}
    assert in_round(rounds, "mutex", "recipe") == 3.0
    medians = {"recipe": 1.0, "mutex": 6.0}
    assert "| mutex | 6.0 | 3.00x |" in "\n".join(render(medians, rounds=rounds))
    assert "| mutex | 6.0 | 6.00x |" in "\n".join(render(medians))
    assert math.isnan(in_round({}, "mutex", "recipe"))
