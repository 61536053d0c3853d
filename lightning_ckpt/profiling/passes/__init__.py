"""The profiling passes: a probed step (unplanned or under checkpointing), its counters and hooks, plain forwards, the room the budget leaves them and the refusal when none fits."""
