"""``python -m benchmarks``: run the benchmark harness (see ``benchmarks/README.md``)."""

from benchmarks.harness import main

raise SystemExit(main())
