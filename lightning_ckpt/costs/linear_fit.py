"""A profile: step costs measured at small batch sizes, extrapolated linearly.

Bytes and FLOPs of a step grow linearly with the batch size, so two probes give a
line per quantity (`bytes = a + b * batch`) and a third probe checks it. `at(n)`
returns the `StepCost` predicted for batch size `n`, with the profile's machine
rates (`meta["rates"]`) passed through. Plain data, no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from lightning_ckpt.costs.block_costs import BlockCost, OpCost, StepCost, backward_phase_peaks

_BLOCK_LINEAR = (
    "saved_bytes",
    "input_bytes",
    "input_saved_bytes",
    "shared_with_previous_bytes",
    "input_saved_by_previous_bytes",
    "output_bytes",
    "output_saved_bytes",
    "fwd_transient_bytes",
    "stop_output_bytes",
    "bwd_transient_bytes",
    "fwd_flops",
    "tail_flops",
    "fwd_mem_bytes",
    "tail_mem_bytes",
    "fwd_rng_bytes",
    "tail_rng_bytes",
    "fwd_comm_bytes",
    "tail_comm_bytes",
    "fwd_ms",
    "carried_fwd_bytes",
    "carried_bwd_bytes",
    "gap_fwd_bytes",
    "input_unsaved_bytes",
)
# each tail is part of its forward: (tail, whole)
_TAILS = (
    ("tail_flops", "fwd_flops"), ("tail_mem_bytes", "fwd_mem_bytes"), ("tail_rng_bytes", "fwd_rng_bytes"),
    ("tail_comm_bytes", "fwd_comm_bytes"),
)
_STEP_LINEAR = ("pre_saved_bytes", "batch_bytes", "post_saved_bytes", "carried_end_bytes")
_WORK = (  # bytes written or moved, not held
    "fwd_mem_bytes", "tail_mem_bytes", "fwd_rng_bytes", "tail_rng_bytes", "fwd_comm_bytes", "tail_comm_bytes",
)
# what a miss at the check slice is measured on: every size the memory model holds
_CHECKED = tuple(f for f in _BLOCK_LINEAR if f.endswith("_bytes") and f not in _WORK) + (
    "ckpt_fwd_peak_bytes", "kept_grads_bwd_transient_bytes",
)
_CHECKED_STEP = (*_STEP_LINEAR, "post_forward_bytes")
# measured time differences (`lightning_ckpt.apply.keep_calibration`), on a line like `fwd_ms` when both probes have them
_SIGNED_TIMES = ("keep_saved_ms", "keep_draws_saved_ms")


def held_writes(blocks) -> tuple[str, ...]:
    """The Python state writes (`BlockCost.unreplayable`) of one block measured several times, each once: those
    of the first measurement in their order, then any the others add."""
    out: list[str] = []
    for b in blocks:
        out.extend(w for w in b.unreplayable if w not in out)
    return tuple(out)


def _line(x1: float, y1: float, x2: float, y2: float, x: float) -> float:
    return y1 + (y2 - y1) * (x - x1) / (x2 - x1)


_OP_LINEAR = ("keep_bytes", "flops", "mem_bytes", "rng_bytes")
AT_KEPT = 32  # `Profile.at` answers kept per profile, the oldest dropped first


def _fit_ops(ops1: tuple[OpCost, ...], ops2: tuple[OpCost, ...], x1: int, x2: int, x: int) -> tuple[OpCost, ...]:
    """The block's op calls at batch `x`, each of its sizes on its own line, matched by key.

    A batch of one can take other paths for views (an extra `view` or `t`, so their call
    indices differ), which no plan keeps: calls found in one probe only are left out when
    neither could be kept. When the calls that could be kept differ (the block's ops depend
    on the batch size), there are no op-level options for the block: an empty tuple."""
    first = {o.key: o for o in ops1}
    second = {o.key: o for o in ops2}

    def keepable(o: OpCost) -> bool:
        return o.keepable and o.saved

    only = [o for o in ops1 if o.key not in second] + [o for o in ops2 if o.key not in first]
    if any(keepable(o) for o in only):
        return ()
    fitted = []
    for o2 in ops2:
        o1 = first.get(o2.key)
        if o1 is None:
            continue
        kw = {f: int(round(max(0.0, _line(x1, getattr(o1, f), x2, getattr(o2, f), x)))) for f in _OP_LINEAR}
        fitted.append(
            dataclasses.replace(
                o1, saved=o1.saved and o2.saved, keepable=o1.keepable and o2.keepable,
                in_tail=o1.in_tail and o2.in_tail, **kw,
            )
        )
    return tuple(fitted)


def _fit_backward(b1: BlockCost, b2: BlockCost, x1: int, x2: int, x: int, line: int) -> dict:
    """A block's backward scratch at batch `x`: each stretch of its backward (`BlockCost.bwd_phase_bytes`) on
    its own line, when both probes cut it alike (the same gradients made and in flight, stretch by stretch);
    else the line through their peaks (`line`), with the kept-gradient peak on a line of its own (None when a
    probe has none). The fitted cost keeps no stretches."""
    p1, p2 = b1.bwd_phase_bytes, b2.bwd_phase_bytes
    if p1 and len(p1) == len(p2) and all(a[1:] == b[1:] for a, b in zip(p1, p2)):
        fitted = [(_line(x1, a[0], x2, b[0], x), a[1], a[2]) for a, b in zip(p1, p2)]
        unset, kept = backward_phase_peaks(fitted)
        return {"bwd_transient_bytes": unset, "kept_grads_bwd_transient_bytes": kept, "bwd_phase_bytes": ()}
    k1, k2 = b1.kept_grads_bwd_transient_bytes, b2.kept_grads_bwd_transient_bytes
    kept = None if k1 is None or k2 is None else min(line, int(round(max(0.0, _line(x1, k1, x2, k2, x)))))
    return {"kept_grads_bwd_transient_bytes": kept, "bwd_phase_bytes": ()}


@dataclass(frozen=True)
class Profile:
    """Two probes that define the lines, and an optional third that checks them."""

    probes: tuple[StepCost, StepCost]
    check: StepCost | None = None
    # `at`'s answers, by batch size and step fields: a fit over shapes asks each profile the same again
    _at: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        a, b = self.probes
        if a.batch_size == b.batch_size and not self.one_size:
            raise ValueError(
                f"a profile needs probes at two different batch sizes, got {a.batch_size} twice; "
                "use e.g. probe_batch_sizes=(1, 2)."
            )
        if a.n_blocks != b.n_blocks:
            raise ValueError(f"probes disagree on the number of blocks ({a.n_blocks} vs {b.n_blocks}).")

    @property
    def one_size(self) -> bool:
        """A profile at one batch size only (a batch of one sample, profiled along its tokens): both
        probes are the same measurement, and `at` answers at that batch size alone."""
        a, b = self.probes
        return a.batch_size == b.batch_size and a == b

    @property
    def n_blocks(self) -> int:
        return self.probes[0].n_blocks

    @property
    def block_names(self) -> tuple[str, ...]:
        return tuple(b.name for b in self.probes[0].blocks)

    def at(self, batch_size: int, **step_fields) -> StepCost:
        """The step cost predicted at `batch_size` (static fields passed through); the same (immutable)
        object when asked again."""
        try:
            key = (batch_size, tuple(sorted(step_fields.items())))
            hash(key)
        except TypeError:  # a field that is not hashable: computed each time
            return self._at_uncached(batch_size, **step_fields)
        cache = self.__dict__.get("_at")
        if cache is None:  # an instance unpickled from before the cache existed
            object.__setattr__(self, "_at", cache := {})
        found = cache.get(key)
        if found is None:
            if len(cache) >= AT_KEPT:  # bounded: a search over batch sizes asks many once each
                del cache[next(iter(cache))]
            found = cache[key] = self._at_uncached(batch_size, **step_fields)
        return found

    def _at_uncached(self, batch_size: int, **step_fields) -> StepCost:
        p1, p2 = self.probes
        if self.one_size:
            if batch_size != p1.batch_size:
                raise ValueError(
                    f"this profile was made at batch size {p1.batch_size} only (a batch of one sample is profiled "
                    f"along its tokens, not on slices of samples), so it cannot cost batch size {batch_size}; "
                    "profile a batch of at least two samples to plan other batch sizes."
                )
            return dataclasses.replace(p1, **step_fields) if step_fields else p1
        x1, x2 = p1.batch_size, p2.batch_size
        blocks = []
        checks = self.check.blocks if self.check is not None else [None] * len(p1.blocks)
        for b1, b2, b3 in zip(p1.blocks, p2.blocks, checks):
            kw = {f.name: getattr(b1, f.name) for f in dataclasses.fields(b1)}  # shallow: ops are replaced below
            for f in _BLOCK_LINEAR:
                v = max(0.0, _line(x1, getattr(b1, f), x2, getattr(b2, f), batch_size))
                kw[f] = v if f == "fwd_ms" else int(round(v))
            kw["input_saved_bytes"] = min(kw["input_saved_bytes"], kw["input_bytes"])
            kw["output_saved_bytes"] = min(kw["output_saved_bytes"], kw["output_bytes"])
            kw["stop_output_bytes"] = min(kw["stop_output_bytes"], kw["output_bytes"] - kw["output_saved_bytes"])
            kw["input_unsaved_bytes"] = min(kw["input_unsaved_bytes"], kw["input_bytes"])
            kw["input_saved_by_previous_bytes"] = min(kw["input_saved_by_previous_bytes"], kw["input_bytes"])
            if b1.ckpt_fwd_peak_bytes is not None and b2.ckpt_fwd_peak_bytes is not None:
                kw["ckpt_fwd_peak_bytes"] = int(
                    round(max(0.0, _line(x1, b1.ckpt_fwd_peak_bytes, x2, b2.ckpt_fwd_peak_bytes, batch_size)))
                )
            else:
                kw["ckpt_fwd_peak_bytes"] = None
            kw.update(_fit_backward(b1, b2, x1, x2, batch_size, kw["bwd_transient_bytes"]))
            for tail, whole in _TAILS:
                kw[tail] = min(kw[tail], kw[whole])
            kw["chains_from_previous"] = b1.chains_from_previous and b2.chains_from_previous
            # a write seen in any pass is the block's (either probe, the check): kept, never checkpointed
            kw["unreplayable"] = held_writes(b for b in (b1, b2, b3) if b is not None)
            kw["written_state_bytes"] = max(b1.written_state_bytes, b2.written_state_bytes)
            for f in _SIGNED_TIMES:  # a saving may be negative (keeping lost time): not clamped at 0
                v1, v2 = getattr(b1, f), getattr(b2, f)
                kw[f] = None if v1 is None or v2 is None else _line(x1, v1, x2, v2, batch_size)
            kw["ops"] = _fit_ops(b1.ops, b2.ops, x1, x2, batch_size)
            if not kw["ops"] and b3 is not None and batch_size > x2:
                # a batch of one can run other ops (a reshape that copies from batch two on):
                # the larger probe and the check then define the calls at larger batches
                kw["ops"] = _fit_ops(b2.ops, b3.ops, x2, self.check.batch_size, batch_size)
            blocks.append(BlockCost(**kw))
        fields = {
            f: int(round(max(0.0, _line(x1, getattr(p1, f), x2, getattr(p2, f), batch_size)))) for f in _STEP_LINEAR
        }
        if p1.post_forward_bytes is not None and p2.post_forward_bytes is not None:
            fields["post_forward_bytes"] = int(
                round(max(0.0, _line(x1, p1.post_forward_bytes, x2, p2.post_forward_bytes, batch_size)))
            )
        meta = {"step_fwd_flops": max(0.0, _line(x1, p1.meta.get("step_fwd_flops", 0), x2, p2.meta.get("step_fwd_flops", 0), batch_size))}
        for key in ("rates", "work"):  # measured once per profile, the same at every batch size
            if key in p2.meta:
                meta[key] = p2.meta[key]
        base = {
            "static_bytes": p1.static_bytes,
            "outside_grad_bytes": p1.outside_grad_bytes,
            "grads_live_in_forward": p1.grads_live_in_forward,
            "optimizer_transient_bytes": p1.optimizer_transient_bytes,
        }
        base.update(step_fields)
        return StepCost(blocks=tuple(blocks), batch_size=int(batch_size), meta=meta, **fields, **base)

    def check_error(self) -> float:
        """`relative_miss` of the lines at the check probe (0.0 without one)."""
        if self.check is None:
            return 0.0
        return relative_miss(self.at(self.check.batch_size), self.check)

    @property
    def fit_note(self) -> str | None:
        """What `refit_without_smallest` did, in words, or None when the lines go through the
        probes as taken."""
        refit = self.probes[0].meta.get("refit")
        if not refit:
            return None
        a, b = (p.batch_size for p in self.probes)
        out = refit["left_out"]
        sizes = f"batch {out[0]}" if len(out) == 1 else "batches " + ", ".join(map(str, out[:-1])) + f" and {out[-1]}"
        checked = (
            f"; at batch {self.check.batch_size} the new lines miss by {100 * self.check_error():.1f}%"
            if self.check is not None else "; no larger slice was left to check them"
        )
        return (
            f"bytes measured at {sizes} are off the line through the larger slices (the line "
            f"through batches {refit['line'][0]} and {refit['line'][1]} missed batch {refit['checked']} by "
            f"{100 * refit['miss']:.1f}%), so the profile is fitted on batches {a} and {b}{checked}"
        )

    def to_dict(self) -> dict:
        return {
            "probes": [p.to_dict() for p in self.probes],
            "check": None if self.check is None else self.check.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: dict) -> "Profile":
        probes = tuple(StepCost.from_dict(p) for p in data["probes"])
        check = None if data.get("check") is None else StepCost.from_dict(data["check"])
        return cls(probes=probes, check=check)  # type: ignore[arg-type]


MISS_FLOOR = 0.01  # share of the step's activation bytes below which a field's miss is measured against it


def relative_miss(predicted: StepCost, measured: StepCost) -> float:
    """Largest relative error of any size the memory model holds (`_CHECKED`: per block saved,
    boundary, output, scratch, in-flight, carried and gap bytes; around the chain the bytes before
    and after it, the batch, the carried bytes at its end). Each error is relative to the measured
    value, or to `MISS_FLOOR` of the step's activation bytes when that is larger: a field of a few
    bytes, far below anything that moves the peak, does not decide."""
    scale = MISS_FLOOR * (
        sum(b.saved_bytes for b in measured.blocks)
        + sum(getattr(measured, f) for f in _STEP_LINEAR)
    )
    pairs = [(getattr(p, f), getattr(m, f)) for p, m in zip(predicted.blocks, measured.blocks) for f in _CHECKED]
    pairs += [(getattr(predicted, f), getattr(measured, f)) for f in _CHECKED_STEP]
    worst = 0.0
    for p, m in pairs:
        if p is None or m is None:
            continue
        if max(m, scale) > 0:
            worst = max(worst, abs(p - m) / max(m, scale))
    return worst


REFIT_TOLERANCE = 0.01  # relative miss at the check slice above which the smallest slice is left out


def refit_without_smallest(profile: Profile) -> Profile:
    """The profile's lines through its two larger slices when the line through the two smaller ones
    misses the check slice by more than `REFIT_TOLERANCE`: the smallest slice can run other code than
    the batch does (an attention mask dropped when its one sample has no padding, a reshape that
    copies only from two samples on, attention dropout's scratch at one sample), and the larger slices
    are more like the batch. The refit probes say so in `meta["refit"]` (`Profile.fit_note`)."""
    if profile.check is None:
        return profile
    miss = relative_miss(profile.at(profile.check.batch_size), profile.check)
    small, large = profile.probes
    if miss <= REFIT_TOLERANCE or profile.check.batch_size <= large.batch_size:
        return profile
    before = small.meta.get("refit", {}).get("left_out", [])  # left out by an earlier refit
    note = {"left_out": [*before, small.batch_size], "line": [small.batch_size, large.batch_size],
            "checked": profile.check.batch_size, "miss": miss}
    probes = tuple(dataclasses.replace(p, meta={**p.meta, "refit": note}) for p in (large, profile.check))
    return Profile(probes=probes, check=None)  # type: ignore[arg-type]
