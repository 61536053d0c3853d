"""`Plan`: which blocks are checkpointed, how they are grouped, and what that costs.

A plan is plain data: the segments, the predicted peak against the budget (per device; what an
offloading strategy keeps in host memory and on NVMe beside it), the recompute it buys that with, and a per-block table for people (`str(plan)`, block
names after their common dotted prefix, which is printed once) and for loggers and
checkpoints (`to_dict()` / `from_dict()`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lightning_ckpt.units import format_bytes


def format_flops(n: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f}"


def nesting_trees(segments, inner) -> list[str]:
    """One line per top-level segment with inner segments: its recompute, left to right, e.g.
    `seg 3 [10-17]: [10-12: 10 [11-12]] 13 [14-17]` (brackets: inner segments, nested)."""
    from lightning_ckpt.planning.nested_model import inner_elements

    def show(a: int, b: int) -> str:
        elements = inner_elements(a, b, inner)
        if not any(child for *_, child in elements):
            return f"[{a}-{b}]"
        return f"[{a}-{b}: " + " ".join(show(c, d) if child else str(c) for c, d, child in elements) + "]"

    lines = []
    for j, (a, b) in enumerate(segments):
        if any(a <= c and d <= b for c, d in inner):
            lines.append(f"seg {j} " + show(a, b))
    return lines


def name_prefix(names) -> str:
    """The dotted components all `names` share, with the final dot (`"model.layers."`), leaving every name
    at least its last component; "" when they share none."""
    parts = [n.split(".") for n in names]
    if not parts:
        return ""
    common = []
    for column in zip(*(p[:-1] for p in parts)):
        if len(set(column)) != 1:
            break
        common.append(column[0])
    return "".join(c + "." for c in common)


@dataclass(frozen=True)
class BlockRow:
    """One row of the plan table."""

    index: int
    name: str
    checkpointed: bool
    segment: int  # -1 when kept
    saved_bytes: int
    input_bytes: int
    fwd_flops: int
    fwd_ms: float
    fwd_mem_bytes: int = 0  # written by ops without FLOPs (work, not memory held)
    fwd_rng_bytes: int = 0  # written by random-number ops
    fwd_comm_bytes: int = 0  # moved by the collectives of its forward (tensor parallelism), as all-gather output
    gather_bytes: int = 0  # parameters its recompute all-gathers again (ZeRO-3)
    fwd_est_ms: float | None = None  # estimated from the work above at the machine rates, when measured
    kept_bytes: int = 0  # op outputs kept from forward to backward (op-level plans)
    kept_flops: int = 0  # the FLOPs of the kept calls, not recomputed
    kept_est_ms: float = 0.0  # their estimated time, not recomputed
    keeps: str = ""  # what is kept and recomputed, for people (`op_options.describe_keeps`)
    level: int = 0  # segments around the block: 0 kept, 1 checkpointed, 2 also in an inner segment, ...
    recomputes: int = 0  # times its forward runs again in the backward (more than 1 in nested plans)
    kept_because: str = ""  # why planning may not checkpoint it (Python state its forward writes)


# every BlockRow field is a number, a string or None: a row's dict needs no deep copy
_ROW_FIELDS = tuple(f.name for f in dataclasses.fields(BlockRow))


def _row_dict(row: BlockRow) -> dict:
    """`dataclasses.asdict(row)`, without its deep copies: the row's own dict of fields, copied."""
    values = row.__dict__
    return dict(values) if len(values) == len(_ROW_FIELDS) else {f: getattr(row, f) for f in _ROW_FIELDS}


@dataclass(frozen=True)
class Plan:
    policy: str
    batch_size: int
    segments: tuple[tuple[int, int], ...]
    predicted_peak_bytes: int
    peak_phase: str
    budget_bytes: int | None
    static_bytes: int
    recompute_flops: int
    recompute_ms: float
    step_flops: int  # forward + backward of the whole step, estimated as 3x the forward
    rows: tuple[BlockRow, ...]
    cost_metric: str = "flops"  # what the planner minimised: flops, ms or time
    recompute_est_ms: float | None = None  # estimated recompute time (the `time` metric), when rates were measured
    rates: dict | None = None  # `MachineRates.to_dict()` behind the estimates
    granularity: str = "block"  # "op": blocks checkpointed alone may keep op outputs
    keeps: tuple[tuple[int, tuple[tuple[str, int], ...]], ...] = ()  # (block, kept op calls), ascending
    gap: float = 0.0  # `optimal` stopped at its time limit: at most this far above the optimum (share of the cost)
    # segments recomputed inside another segment's recompute (multi-level plans): each lies strictly
    # inside one of `segments` or of another inner segment; together with `segments` a nested family
    inner_segments: tuple[tuple[int, int], ...] = ()
    host_bytes: int = 0  # kept in host memory per rank by an offloading strategy (not in the device peak)
    nvme_bytes: int = 0  # swapped out to NVMe per rank

    @property
    def keep_ops(self) -> dict[int, tuple[tuple[str, int], ...]]:
        """{block: the op calls it keeps} for blocks checkpointed selectively."""
        return dict(self.keeps)

    @property
    def checkpointed(self) -> tuple[int, ...]:
        return tuple(i for a, b in self.segments for i in range(a, b + 1))

    @property
    def n_blocks(self) -> int:
        return len(self.rows)

    @property
    def fits(self) -> bool:
        return self.budget_bytes is None or self.predicted_peak_bytes <= self.budget_bytes

    @property
    def recompute_share(self) -> float:
        """Recomputed FLOPs as a fraction of the step's FLOPs without checkpointing."""
        return self.recompute_flops / self.step_flops if self.step_flops else 0.0

    def __str__(self) -> str:
        estimated = self.recompute_est_ms is not None
        prefix = name_prefix([r.name for r in self.rows])  # printed once; names are never cut
        width = max([len("name"), *(len(r.name) - len(prefix) for r in self.rows)])
        head = f"{'block':>5}  {'name':<{width}} {'decision':<12} {'seg':>4} {'saved':>10} {'boundary':>10} {'recompute':>14}"
        if estimated:
            head += f" {'est. ms':>8}"
        selective = f", {len(self.keeps)} of them keep op outputs" if self.keeps else ""
        if self.inner_segments:
            selective += f", {len(self.inner_segments)} inner segment(s) over {max(r.level for r in self.rows)} levels"
        lines = [
            f"lightning-ckpt plan: policy={self.policy}, batch_size={self.batch_size}, "
            f"{len(self.checkpointed)}/{self.n_blocks} blocks checkpointed in {len(self.segments)} segment(s)"
            f"{selective}, cost_metric={self.cost_metric}",
            *([f"block names below are under {prefix}"] if prefix else []),
            head,
            "-" * len(head),
        ]
        for r in self.rows:
            decision = ("selective" if r.keeps else "checkpoint") if r.checkpointed else "keep"
            if r.level > 1:
                decision = f"nested L{r.level}"
            seg = str(r.segment) if r.segment >= 0 else "-"
            times = max(1, r.recomputes)
            recompute = format_flops(times * r.fwd_flops - r.kept_flops) if r.checkpointed else "0"
            if times > 1:
                recompute = f"{recompute} x{times}"
            line = (
                f"{r.index:>5}  {r.name[len(prefix):]:<{width}} {decision:<12} {seg:>4} {format_bytes(r.saved_bytes):>10} "
                f"{format_bytes(r.input_bytes):>10} {recompute:>14}"
            )
            if estimated:
                line += f" {times * (r.fwd_est_ms or 0.0) - r.kept_est_ms if r.checkpointed else 0.0:>8.2f}"
            if r.keeps:
                line += f"  {r.keeps} (+{format_bytes(r.kept_bytes)})"
            if r.kept_because and not r.checkpointed:
                line += f"  kept: {r.kept_because}"
            lines.append(line)
        lines.append("-" * len(head))
        if self.inner_segments:
            lines.append(
                "nested: each [first-last] is rebuilt inside the recompute of the segment around it, saving only its input; "
                "blocks outside brackets save in that recompute"
            )
            lines.extend(f"  {tree}" for tree in nesting_trees(self.segments, self.inner_segments))
        budget = format_bytes(self.budget_bytes) if self.budget_bytes is not None else "none"
        verdict = "fits" if self.fits else "DOES NOT FIT"
        lines.append(
            f"predicted peak {format_bytes(self.predicted_peak_bytes)} (at {self.peak_phase}) vs budget {budget}: {verdict}; "
            f"static {format_bytes(self.static_bytes)}"
            + (f"; offloaded: {format_bytes(self.host_bytes)} in host memory" if self.host_bytes else "")
            + (f", {format_bytes(self.nvme_bytes)} on NVMe" if self.nvme_bytes else "")
        )
        timed = f" ({self.recompute_ms:.1f} ms measured forward time)" if self.recompute_ms > 0 else ""
        lines.append(f"recompute {format_flops(self.recompute_flops)}FLOP = {100 * self.recompute_share:.1f}% of the step{timed}")
        if estimated:
            rates, work = "", "FLOPs, memory-bound bytes and random bytes"
            if self.rates is not None:
                from lightning_ckpt.costs.machine_rates import MachineRates

                measured = MachineRates.from_dict(self.rates)
                rates = f" at {measured}"
                if measured.gather_byte_per_s is not None:
                    again = [what for what, n in (
                        ("parameters all-gathered again", sum(r.gather_bytes for r in self.rows)),
                        ("tensor-parallel collectives run again", sum(r.fwd_comm_bytes for r in self.rows)),
                    ) if n]
                    if again:
                        work = f"FLOPs, memory-bound bytes, random bytes and {' and '.join(again)}"
            lines.append(f"estimated recompute {self.recompute_est_ms:.1f} ms: {work}{rates}")
        if self.gap > 0:
            lines.append(f"planner stopped at its time limit: within {100 * self.gap:.2g} % of the optimum (proven bound)")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "policy": self.policy,
            "batch_size": self.batch_size,
            "segments": [list(s) for s in self.segments],
            "checkpointed": list(self.checkpointed),
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "peak_phase": self.peak_phase,
            "budget_bytes": self.budget_bytes,
            "static_bytes": self.static_bytes,
            "recompute_flops": self.recompute_flops,
            "recompute_ms": self.recompute_ms,
            "recompute_share": self.recompute_share,
            "step_flops": self.step_flops,
            "cost_metric": self.cost_metric,
            "recompute_est_ms": self.recompute_est_ms,
            "rates": self.rates,
            "fits": self.fits,
            "rows": [_row_dict(r) for r in self.rows],
            "granularity": self.granularity,
            "keeps": [[p, [list(k) for k in keys]] for p, keys in self.keeps],
            "gap": self.gap,
            "inner_segments": [list(s) for s in self.inner_segments],
            "host_bytes": self.host_bytes,
            "nvme_bytes": self.nvme_bytes,
        }

    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        keys = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in data.items() if k in keys}
        kw["segments"] = tuple((int(a), int(b)) for a, b in data["segments"])
        kw["rows"] = tuple(BlockRow(**r) for r in data["rows"])
        kw["inner_segments"] = tuple((int(a), int(b)) for a, b in data.get("inner_segments", ()))
        kw["keeps"] = tuple((int(p), tuple((str(o), int(i)) for o, i in keys)) for p, keys in data.get("keeps", ()))
        return cls(**kw)
