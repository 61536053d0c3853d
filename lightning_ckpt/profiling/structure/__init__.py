"""The step's structure: batches and their shapes, the chain of blocks and their calls, how a forward runs through them."""
