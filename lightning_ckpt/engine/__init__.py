"""The engine under every front end: profile, plan, apply, re-plan per batch shape, undo.

Plain torch (no Lightning): the callback, `auto_checkpoint` and Fabric loops drive it through
a small `StepDriver` each.
"""
