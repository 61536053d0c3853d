"""State a forward writes or depends on: what it writes, what a recompute would repeat, and putting it back."""
