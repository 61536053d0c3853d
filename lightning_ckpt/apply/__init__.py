"""Apply a plan to the model: checkpointed segments with non-reentrant `torch.utils.checkpoint`
(`segments`), kept op outputs inside a checkpointed block (`selective`), plans inside compiled
code (`compiled`); what keeping op outputs saves, measured by applying (`keep_calibration`); and
errors raised in a recompute, explained (`recompute_errors`)."""
