"""Runnable examples of asynclock (not part of the installed package)."""
