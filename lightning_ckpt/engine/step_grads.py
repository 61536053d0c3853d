"""The parameter gradients a step holds, as its front end's driver says, and the plans made for them.

Two step fields of every cost say it (`StepCost`): `grads_live_in_forward` (last step's gradients alive in
the forward: Lightning zeroes them after it, a plain loop may free them before) and `grads_accumulate` (every
gradient alive through the step, each new one added into it in place: gradient accumulation, or a loop that
zeroes with `set_to_none=False`). When the driver's answer changes during a run (Lightning's
`GradientAccumulationScheduler`, a plain loop seen to keep its gradients) the cached plans are dropped, said
once, and each shape is planned again from its profile when its batch comes (`follow`).
"""

from __future__ import annotations

from typing import Any

GradFields = tuple[bool, bool]  # (grads_live_in_forward, grads_accumulate)


def grad_fields(driver: Any) -> GradFields:
    """What the driver says of the step's gradients now (a driver that says nothing of the forward: alive there)."""
    return bool(getattr(driver, "grads_live_in_forward", True)), bool(driver.grads_accumulate)


def follow(engine: Any) -> None:
    """Drop the engine's plans when the driver's gradients changed since they were made (`engine._grads`)."""
    now, before = grad_fields(engine.driver), engine._grads
    engine._grads = now
    if before is None or before == now or not engine._shapes.plans:
        return
    n, engine.shape = len(engine._shapes.plans), None  # the applied plan stays until the new one replaces it
    engine._shapes.forget_plans()
    reason = getattr(engine.driver, "grads_reason", None)
    if reason:
        said = f"lightning-ckpt: {reason}: the {n} plan(s) made for the gradients seen before are dropped"
    else:
        on = now[1]
        said = (
            f"lightning-ckpt: gradient accumulation turned {'on' if on else 'off'} (accumulate_grad_batches "
            f"{'> 1' if on else '= 1'}): the {n} plan(s) made {'without' if on else 'with'} the gradients of "
            "earlier micro-batches alive in each step are dropped"
        )
    engine.driver.info(f"{said}; each batch shape is planned again.")
