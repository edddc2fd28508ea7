"""What is built on the way in: once(), every(), the run command, statistics()."""
