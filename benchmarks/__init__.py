"""Benchmarks of asynclock against the locks a user would otherwise pick.

Run ``python -m benchmarks`` (or ``python benchmarks/run.py``) from the repository root;
``--quick`` for a short run. See ``benchmarks/README.md``.
"""
