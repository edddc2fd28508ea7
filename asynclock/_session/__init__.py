"""Per client and event loop: the companion, the watchdog that renews, the waiting room
that wakes."""
