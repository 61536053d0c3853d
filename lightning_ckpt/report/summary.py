"""What a front end prints and logs about a plan: its table (or one line when nothing needs
checkpointing) and the `ckpt/` metrics."""

from __future__ import annotations

from lightning_ckpt.planning.plan import Plan
from lightning_ckpt.units import format_bytes


def plan_summary(plan: Plan) -> str:
    """The plan's table, or one line saying that nothing needs checkpointing."""
    if plan.segments:
        return str(plan)
    offloaded = f" ({format_bytes(plan.host_bytes)} more in host memory)" if plan.host_bytes else ""
    return (
        f"lightning-ckpt: nothing to checkpoint: batch {plan.batch_size} is predicted to peak at "
        f"{format_bytes(plan.predicted_peak_bytes)}{offloaded} without checkpointing, within the budget of "
        f"{format_bytes(plan.budget_bytes or 0)}. Training runs unchanged."
    )


def plan_metrics(plan: Plan) -> dict[str, float]:
    """What the callback logs about its plan, under the `ckpt/` prefix (host and NVMe bytes when offloaded)."""
    metrics = {
        "ckpt/predicted_peak_bytes": float(plan.predicted_peak_bytes),
        "ckpt/recompute_share": float(plan.recompute_share),
        "ckpt/checkpointed_blocks": float(len(plan.checkpointed)),
    }
    if plan.host_bytes:
        metrics["ckpt/host_bytes"] = float(plan.host_bytes)
    if plan.nvme_bytes:
        metrics["ckpt/nvme_bytes"] = float(plan.nvme_bytes)
    return metrics
