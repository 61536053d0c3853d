"""The Lightning front end: the `ActivationCheckpointing` callback, the `DeepSpeedStrategy`, the plan
preview run, and the small modules the callback calls (loader batch size, the profiling step, resume,
logging, the measured peak). The only place that imports Lightning."""
