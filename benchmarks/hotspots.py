"""Where asynclock spends its CPU: py-spy over a steady-state window, summarised.

    python -m benchmarks.hotspots cycle [--seconds 20]
    python -m benchmarks.hotspots hold [--seconds 20] [--leases 10000]

Starts a pinned private server, runs the scenario with asynclock in a child process, and
once it is in its steady state (cycles warmed up; every lease held) attaches
``py-spy record`` to it for the window. Writes the speedscope profile and prints the
functions of asynclock's own code by inclusive and self share of the samples, and the
share of samples whose leaf frame is in each package. Needs ``pip install py-spy``
(py-spy needs ptrace rights: root, or CAP_SYS_PTRACE).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["main", "summarise"]

ROOT = Path(__file__).resolve().parent.parent


# -- the profiled process --------------------------------------------------------------


async def _target(scenario: str, url: str, leases: int, ttl: float) -> None:
    from redis.asyncio import Redis

    import asynclock

    client = Redis.from_url(url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_stdin() -> None:  # any line (or EOF) from the driver stops the target
        loop.remove_reader(sys.stdin.fileno())
        stop.set()

    loop.add_reader(sys.stdin.fileno(), on_stdin)
    if scenario == "cycle":

        async def cycles() -> None:
            for _ in range(50_000_000):
                async with asynclock.lease(client, "hotspots:cycle", ttl=10):
                    pass
                if stop.is_set():
                    return

        task = asyncio.ensure_future(cycles())
        await asyncio.sleep(1.0)  # warm up
        print("READY", flush=True)
        await task
    else:
        gate = asyncio.Semaphore(64)
        held = lost = 0
        all_held = asyncio.Event()

        async def hold(name: str) -> None:
            nonlocal held, lost
            await gate.acquire()
            exiting = False
            try:
                async with asynclock.lease(client, name, ttl=ttl):
                    gate.release()
                    held += 1
                    if held == leases:
                        all_held.set()
                    await stop.wait()
                    await gate.acquire()  # release 64 at a time, as they were taken
                    exiting = True
            except asynclock.LockLost:
                lost += 1
            finally:
                if exiting:
                    gate.release()

        tasks = [asyncio.ensure_future(hold(f"hotspots:{i}")) for i in range(leases)]
        await all_held.wait()
        await asyncio.sleep(ttl)  # let the renewals settle into their rhythm
        print("READY", flush=True)
        await asyncio.gather(*tasks)
        print(f"leases lost: {lost} of {leases}", file=sys.stderr)
    await client.aclose()


# -- the summary -----------------------------------------------------------------------


def _package(path: str) -> str:
    parts = Path(path).parts
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            rest = parts[parts.index(marker) + 1 :]
            return rest[0].removesuffix(".py") if rest else "?"
    if "asynclock" in parts:
        return "asynclock"
    if "benchmarks" in parts:
        return "benchmarks"
    if path.startswith("<") or not path:
        return "(native)"
    return "stdlib:" + Path(path).stem


def _idle(frame: dict[str, object]) -> bool:
    """The event loop waiting for I/O (py-spy does not always tell idle samples apart)."""
    name = str(frame.get("name", ""))
    return name.endswith("select") and str(frame.get("file", "")).endswith("selectors.py")


def summarise(speedscope: Path, top: int = 25) -> str:
    """Text tables of asynclock's functions (inclusive and self %) and leaf packages.

    Percentages are of the *busy* samples: those whose leaf frame is not the event loop
    waiting in ``select``.
    """
    data = json.loads(speedscope.read_text())
    frames = data["shared"]["frames"]

    def function(index: int) -> str:  # every line of one function merged
        frame = frames[index]
        return f"{frame['name']} ({Path(frame.get('file', '')).name})"

    def ours(index: int) -> bool:
        return _package(frames[index].get("file", "")) == "asynclock"

    total = idle = 0.0  # weights (py-spy: seconds)
    samples = 0
    inclusive: collections.Counter[str] = collections.Counter()  # once per sample
    own: collections.Counter[str] = collections.Counter()
    leaf: collections.Counter[int] = collections.Counter()
    leaf_package: collections.Counter[str] = collections.Counter()
    charged: collections.Counter[str] = collections.Counter()
    for profile in data["profiles"]:
        for stack, weight in zip(profile["samples"], profile["weights"], strict=True):
            if not stack:
                continue
            samples += 1
            if _idle(frames[stack[-1]]):
                idle += weight
                continue
            total += weight
            for name in {function(i) for i in stack if ours(i)}:
                inclusive[name] += weight
            if ours(stack[-1]):
                own[function(stack[-1])] += weight
            leaf[stack[-1]] += weight
            leaf_package[_package(frames[stack[-1]].get("file", ""))] += weight
            charged[_charge(frames, stack)] += weight
    if not total:
        return "no samples"

    def label(index: int) -> str:
        frame = frames[index]
        line = frame.get("line")
        return f"{function(index)[:-1]}:{line})" if line else function(index)

    busy = 100 * total / (total + idle)
    lines = [
        f"{samples} samples, {busy:.0f}% busy (the rest: the loop waiting in select)",
        "percentages below are of the busy samples",
        "",
        "asynclock functions, inclusive %:",
    ]
    for name, weight in inclusive.most_common(top):
        lines.append(f"  {100 * weight / total:5.1f}%  {name}")
    lines += ["", "asynclock functions, self % (leaf frame in asynclock):"]
    for name, weight in own.most_common(top):
        lines.append(f"  {100 * weight / total:5.1f}%  {name}")
    lines += [
        "",
        "busy samples charged to: redis-py (a redis frame on the stack: commands, socket I/O),",
        "else the innermost asynclock function (its own code and the asyncio calls it makes),",
        "else the event loop itself (task steps, callbacks, timers):",
    ]
    for name, weight in charged.most_common(top):
        lines.append(f"  {100 * weight / total:5.1f}%  {name}")
    lines += ["", "leaf frame by package, % of busy samples:"]
    for package, weight in leaf_package.most_common(15):
        lines.append(f"  {100 * weight / total:5.1f}%  {package}")
    lines += ["", "hottest leaf frames overall:"]
    for index, weight in leaf.most_common(15):
        lines.append(f"  {100 * weight / total:5.1f}%  {label(index)}")
    return "\n".join(lines)


def _charge(frames: list[dict[str, Any]], stack: list[int]) -> str:
    # Only the frames of the callback or task step the loop is running count (those below
    # its Handle._run); the frames above are the loop itself and what started it.
    steps = [
        n for n, i in enumerate(stack) if str(frames[i].get("name", "")).endswith("Handle._run")
    ]
    if not steps:
        return "event loop (no asynclock or redis frame)"
    stack = stack[steps[-1] + 1 :]
    packages = [_package(frames[i].get("file", "")) for i in stack]
    if "redis" in packages:
        return "redis-py (commands, socket I/O)"
    for index, package in zip(reversed(stack), reversed(packages), strict=True):
        if package == "asynclock":
            frame = frames[index]
            return f"asynclock: {frame['name']} ({Path(frame.get('file', '')).name})"
    if "benchmarks" in packages:
        return "the benchmark's own loop"
    return "event loop (no asynclock or redis frame)"


# -- the driver ------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hotspots")
    parser.add_argument("scenario", choices=("cycle", "hold"))
    parser.add_argument("--seconds", type=float, default=20.0, help="profiled window")
    parser.add_argument("--leases", type=int, default=10_000, help="hold: leases held")
    parser.add_argument("--ttl", type=float, default=3.0, help="hold: lease ttl (s)")
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--out", type=Path, help="speedscope file (default: /tmp/...)")
    parser.add_argument("--target-url", help=argparse.SUPPRESS)  # internal: the child
    args = parser.parse_args(argv)

    if args.target_url:
        asyncio.run(_target(args.scenario, args.target_url, args.leases, args.ttl))
        return 0

    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        raise SystemExit("py-spy not found: pip install py-spy")
    from .system import plan_pinning, start_server

    out = args.out or Path(f"/tmp/asynclock-{args.scenario}.speedscope.json")
    pinning = plan_pinning(True)
    server = start_server(None, pinning)
    print(f"server {server.engine} {server.version}; {pinning.note}", file=sys.stderr)
    child = None
    try:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        child = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks.hotspots",
                args.scenario,
                "--leases",
                str(args.leases),
                "--ttl",
                str(args.ttl),
                "--target-url",
                server.url,
            ],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None
        assert child.stdin is not None
        started = time.monotonic()
        line = child.stdout.readline().strip()
        if line != "READY":
            raise SystemExit(f"target did not get ready (said {line!r})")
        print(f"steady state after {time.monotonic() - started:.1f} s; profiling", file=sys.stderr)
        cpu_before = _cpu_seconds(child.pid)
        subprocess.run(
            [
                py_spy,
                "record",
                "--pid",
                str(child.pid),
                "--duration",
                str(int(args.seconds)),
                "--rate",
                str(args.rate),
                "--format",
                "speedscope",
                "--output",
                str(out),
                "--nonblocking",
            ],
            check=True,
            timeout=args.seconds + 60,
        )
        cpu = _cpu_seconds(child.pid) - cpu_before
        child.stdin.write("stop\n")
        child.stdin.flush()
        child.wait(timeout=120)
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
        server.stop()
    print(f"profile: {out}")
    print(f"target CPU over the window: {100 * cpu / args.seconds:.1f}% of one core")
    print(summarise(out))
    return 0


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks  # utime + stime


if __name__ == "__main__":
    raise SystemExit(main())
