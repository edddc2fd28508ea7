"""``python benchmarks/run.py [--quick] ...``: the same as ``python -m benchmarks``."""

import sys
from pathlib import Path

if not __package__:
    # Run as a script: import the package from the repository root, and keep this folder
    # off sys.path so that none of its modules shadows a top-level one.
    _root = str(Path(__file__).resolve().parent.parent)
    sys.path[:] = [_root, *(p for p in sys.path[1:] if p != _root)]

from benchmarks.harness import main

if __name__ == "__main__":
    raise SystemExit(main())
