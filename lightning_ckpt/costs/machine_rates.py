"""How fast a device does each kind of forward work: the parameters of the `time` cost metric.

Plain data: `profiling.machine.rates.measure_rates` measures them, `planning.recompute_cost`
turns counted work into estimated time with them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class MachineRates:
    """How fast the profiled device does each kind of forward work (`rates.measure_rates`).

    flop_per_s: FLOPs per second of a square matmul in `flop_dtype`.
    mem_byte_per_s: bytes written per second by a fixed mix of memory-bound ops
        (add, mul, GELU, softmax, layer norm) in `mem_dtype`.
    rng_byte_per_s: bytes written per second by `bernoulli_` (dropout's mask) in `mem_dtype`.
    segment_s: fixed seconds one checkpointed segment adds to a step whatever it holds
        (entering and leaving the checkpoint, saving the RNG state, starting the
        recompute); 0 when not measured. It keeps a segment whose recompute is free
        (a block whose only op runs after its last saved tensor) from looking free.
    op_call_s: fixed seconds each recomputed op call adds beyond its work (dispatch, autograd
        recording, the checkpoint's bookkeeping of what it saves), whatever its size; 0 when
        not measured. Measured on tiny ops (`rates.measure_rates`), or fitted to what
        recomputing the profiled blocks really cost (`keep_calibration`). On a CPU it is
        tens of microseconds: for small blocks of many ops, most of the recompute.
    keep_draws_op_s: seconds each op call of a block adds (forward and recompute) when the
        block keeps random draws (op-level plans: the dispatch modes that store and replay them).
    keep_ops_op_s: the same when it keeps other op outputs too (torch's selective checkpoint
        modes as well). Both 0 when not measured.
    device, flop_dtype, mem_dtype: where and in what they were measured.
    gather_byte_per_s: bytes per second that `all_gather_into_tensor` delivers (its output)
        on the process group of sharded training (`profiling.work.gather`); None when the blocks
        are not sharded over more than one rank, and then a block's `gather_bytes` cost nothing.

    `fwd_ms` turns a block's counted work into estimated milliseconds, `gather_ms` the
    parameter bytes its recompute all-gathers again: together the `cost_metric="time"`
    of the planner.
    """

    flop_per_s: float
    mem_byte_per_s: float
    rng_byte_per_s: float
    segment_s: float = 0.0
    op_call_s: float = 0.0
    keep_draws_op_s: float = 0.0
    keep_ops_op_s: float = 0.0
    device: str = "cpu"
    flop_dtype: str = "torch.float32"
    mem_dtype: str = "torch.float32"
    gather_byte_per_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("flop_per_s", "mem_byte_per_s", "rng_byte_per_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 < value < float("inf")):
                raise ValueError(
                    f"MachineRates: {name}={value!r} must be a positive finite rate; measure it with "
                    "lightning_ckpt.profiling.machine.rates.measure_rates() or give a positive number."
                )
        for name in ("segment_s", "op_call_s", "keep_draws_op_s", "keep_ops_op_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value < float("inf")):
                raise ValueError(
                    f"MachineRates: {name}={value!r} must be a finite number of seconds >= 0 "
                    "(a fixed cost of checkpointing); use 0 to leave it out."
                )
        rate = self.gather_byte_per_s
        if rate is not None and not (isinstance(rate, (int, float)) and 0 < rate < float("inf")):
            raise ValueError(
                f"MachineRates: gather_byte_per_s={rate!r} must be a positive finite rate, or None when "
                "the blocks are not sharded; measure it with lightning_ckpt.profiling.work.gather.measure_gather_rate()."
            )

    def fwd_ms(self, flops: float, mem_bytes: float, rng_bytes: float, op_calls: int = 0) -> float:
        """Estimated milliseconds of work: each kind at its own rate, added, plus the fixed
        cost of `op_calls` recomputed op calls (`op_call_s`)."""
        return 1e3 * (
            flops / self.flop_per_s + mem_bytes / self.mem_byte_per_s + rng_bytes / self.rng_byte_per_s
            + op_calls * self.op_call_s
        )

    def gather_ms(self, gather_bytes: float) -> float:
        """Estimated milliseconds to all-gather `gather_bytes` again; 0 without a measured rate."""
        if not gather_bytes or self.gather_byte_per_s is None:
            return 0.0
        return 1e3 * gather_bytes / self.gather_byte_per_s

    def to_dict(self) -> dict:
        return {f: getattr(self, f) for f in _FIELDS}  # `asdict`: every field is a number, a string or None

    @classmethod
    def from_dict(cls, data: dict) -> "MachineRates":
        return cls(**data)

    def __str__(self) -> str:
        gather = "" if self.gather_byte_per_s is None else f", {self.gather_byte_per_s / 1e9:.2f} GB/s all-gather"
        return (
            f"{self.flop_per_s / 1e9:.1f} GFLOP/s ({self.flop_dtype.removeprefix('torch.')}), "
            f"{self.mem_byte_per_s / 1e9:.2f} GB/s memory-bound, {self.rng_byte_per_s / 1e9:.2f} GB/s random "
            f"({self.mem_dtype.removeprefix('torch.')}){gather}, {1e6 * self.segment_s:.0f} us per segment, "
            f"{1e6 * self.op_call_s:.1f} us per op call on {self.device}"
        )


_FIELDS = tuple(f.name for f in dataclasses.fields(MachineRates))
