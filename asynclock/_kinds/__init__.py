"""The kinds of lock, each its own way in: the mutex, the semaphore, fair and shared
locks (see docs/architecture.md)."""
