"""Child processes of the harness: started with ``python -m benchmarks.worker SPEC``.

A child inherits the harness's CPU affinity. It talks over its stdin and stdout in lines:
it writes ``READY`` when set up (if the mode has a start signal), reads one JSON line with
its orders, and writes ``RESULT <json>`` when done. Its stderr goes to a temporary file
whose tail is quoted if it fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import IO, Any

__all__ = ["Child", "ChildFailed"]

ROOT = Path(__file__).resolve().parent.parent
_LINE_LIMIT = 1 << 28  # bytes of one line (a turn log of a long contention run is large)


class ChildFailed(RuntimeError):
    pass


class Child:
    """One ``benchmarks.worker`` process started by the harness."""

    def __init__(self, proc: asyncio.subprocess.Process, stderr: IO[bytes]) -> None:
        self._proc = proc
        self._stderr = stderr

    @classmethod
    async def start(cls, spec: dict[str, Any]) -> Child:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed by close()
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "benchmarks.worker",
            json.dumps(spec),
            cwd=ROOT,
            env=env,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=stderr,
            limit=_LINE_LIMIT,
        )
        return cls(proc, stderr)

    async def _line(self, limit: float) -> str:
        assert self._proc.stdout is not None
        try:
            async with asyncio.timeout(limit):
                raw = await self._proc.stdout.readline()
        except TimeoutError:
            raise ChildFailed(f"no answer within {limit:g} s{self._tail()}") from None
        if not raw:
            await self._proc.wait()
            raise ChildFailed(f"exited with code {self._proc.returncode}{self._tail()}")
        return raw.decode().rstrip("\n")

    async def expect_ready(self, limit: float) -> None:
        line = await self._line(limit)
        if line != "READY":
            raise ChildFailed(f"expected READY, got {line[:200]!r}{self._tail()}")

    async def send(self, orders: dict[str, Any]) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.write((json.dumps(orders) + "\n").encode())
        await self._proc.stdin.drain()

    async def result(self, limit: float) -> Any:
        line = await self._line(limit)
        if not line.startswith("RESULT "):
            raise ChildFailed(f"expected RESULT, got {line[:200]!r}{self._tail()}")
        return json.loads(line[len("RESULT ") :])

    async def close(self) -> None:
        """Wait briefly for the process to exit; kill it (this process only) if it does not."""
        try:
            async with asyncio.timeout(10):
                await self._proc.wait()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
            await self._proc.wait()
        self._stderr.close()

    def _tail(self, lines: int = 15) -> str:
        with contextlib.suppress(OSError, ValueError):
            self._stderr.seek(0)
            text = self._stderr.read().decode(errors="replace").strip()
            if text:
                return "\n--- child stderr ---\n" + "\n".join(text.splitlines()[-lines:])
        return ""
