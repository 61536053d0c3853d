"""Work: the ops a block runs, named as selective checkpointing names them, their FLOPs, bytes and collectives."""
