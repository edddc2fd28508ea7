"""The kinds of lock: one acquisition loop (``_engine``) with the mutex, semaphore, fair and
shared kinds as its policies (see docs/architecture.md)."""
