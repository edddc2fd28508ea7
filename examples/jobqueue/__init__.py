"""A PostgreSQL job queue whose jobs' effects are committed exactly once, with asynclock
leases deciding who runs a job and ``asynclock.postgres.fence`` guarding each commit.
See ``queue.py`` (the queue and its workers) and ``chaos.py`` (the fault run)."""
