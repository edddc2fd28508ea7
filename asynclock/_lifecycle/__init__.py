"""A lease's life once taken: the way in (lease(), acquire()), the Lease and its
states, and its release."""
