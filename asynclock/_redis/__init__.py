"""Talking to Redis: the Lua scripts, the hot-path lane, redis-py/Python differences,
connections left by closed loops."""
