"""The kinds of lock: one acquisition loop (``_engine``) with the semaphore, fair and shared
kinds as its policies, and the mutex with a loop of its own (see docs/architecture.md)."""
