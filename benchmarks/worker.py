"""Entry point of the harness's child processes: ``python -m benchmarks.worker SPEC_JSON``."""

from __future__ import annotations

import json
import signal
import sys

from benchmarks.scenarios.contend import child_contend
from benchmarks.scenarios.hold import child_hold


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m benchmarks.worker SPEC_JSON", file=sys.stderr)
        return 2
    # Ctrl-C in the terminal reaches the whole process group: the harness decides when to
    # stop, and every child run is bounded in time anyway.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    spec = json.loads(argv[0])
    modes = {"contend": child_contend, "hold": child_hold}
    modes[spec["mode"]](spec)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
