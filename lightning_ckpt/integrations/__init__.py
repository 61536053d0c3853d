"""Lightning glue: the `ActivationCheckpointing` callback, the `DeepSpeedStrategy`, the plan preview
run, and the small modules the callback calls (loader batch size, profiling step, rank-0 planning,
resume, logging).
"""
