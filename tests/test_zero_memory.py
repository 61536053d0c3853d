"""The ZeRO static memory model: hand-computed cases, DeepSpeed's measured bytes, properties."""

from __future__ import annotations

import pytest
from models import TinyChain

from lightning_ckpt.profiling.static_memory import StaticMemory
from lightning_ckpt.profiling.zero_memory import (
    PRECISIONS,
    STAGES,
    ZeroMemory,
    zero_memory,
    zero_static_memory,
)

# (elements, trainable): a 1000-element matrix, a 10-element bias, a frozen 500-element table
PARAMS = [(1000, True), (10, True), (500, False)]
BUCKET = 64


def _zm(stage, precision="32-true", world_size=2, **kw):
    kw.setdefault("reduce_bucket_size", BUCKET)
    return zero_memory(PARAMS, stage=stage, world_size=world_size, precision=precision, **kw)


@pytest.mark.parametrize(
    ("stage", "precision", "expected"),
    [
        # stage 0: whole parameters; fp32 steps them directly, bf16 keeps an fp32 master copy;
        # AdamW's two fp32 moments per trainable element and a 4-byte step per tensor
        (0, "32-true", dict(param_bytes=4 * 1510, master_bytes=0, optimizer_state_bytes=8 * 1010 + 8, grad_bytes=0)),
        (0, "bf16-mixed", dict(param_bytes=2 * 1510, master_bytes=4 * 1010, optimizer_state_bytes=8 * 1010 + 8)),
        # stages 1-2: whole parameters, this rank's half (505) of the trainable ones as fp32
        # master weights and moments; buckets only during the backward
        (1, "32-true", dict(param_bytes=4 * 1510, master_bytes=4 * 505, optimizer_state_bytes=8 * 505 + 4,
                            bucket_bytes=4 * BUCKET, bucket_persistent=False)),
        (2, "bf16-mixed", dict(param_bytes=2 * 1510, master_bytes=4 * 505, optimizer_state_bytes=8 * 505 + 4,
                               bucket_bytes=2 * BUCKET, grad_bytes=0)),
        # stage 3: each parameter split in two (500 + 5 + 250 elements) plus a whole copy of
        # the persistent 10-element bias; gradient partition buffer in the parameters' dtype
        (3, "32-true", dict(param_bytes=4 * (755 + 10), grad_bytes=4 * 505, master_bytes=4 * 505,
                            optimizer_state_bytes=8 * 505 + 4, bucket_bytes=4 * BUCKET, bucket_persistent=True,
                            gather_bytes=4 * 1500)),
        (3, "bf16-true", dict(param_bytes=2 * (755 + 10), grad_bytes=2 * 505, master_bytes=4 * 505, gather_bytes=2 * 1500)),
    ],
)
def test_hand_computed(stage, precision, expected):
    zm = _zm(stage, precision, persistence_threshold=10)
    for field, value in expected.items():
        assert getattr(zm, field) == value, field


# Bytes DeepSpeed 0.19.8 held per rank after 5 steps of `tests/test_strategy.py`'s model
# (TinyChain, 5 blocks, d=32) on 2 ranks: unique storages of the parameters (their ZeRO-3
# partitions included), gradients and every tensor reachable from its optimizer. Buckets
# of 2**20 elements with communication overlap, as there; `persist` is DeepSpeed's default
# threshold (1e5), otherwise 0; `frozen` freezes the embedding, block 0 and block 1's norm.
MEASURED = {
    (0, "32-true", False, False): 525480,
    (0, "bf16-mixed", False, False): 613038,
    (1, "32-true", False, False): 437808,
    (1, "bf16-mixed", False, False): 350248,
    (2, "32-true", False, False): 437808,
    (2, "bf16-mixed", False, False): 350248,
    (3, "32-true", False, False): 4632117,
    (3, "bf16-mixed", False, False): 2447405,
    (3, "bf16-true", False, False): 2447405,
    (3, "32-true", True, False): 4807237,
    (3, "bf16-mixed", False, True): 2376845,
}


def _chain_params(frozen: bool) -> list[tuple[int, bool]]:
    net = TinyChain(n_blocks=5, d=32, vocab=50, n_classes=3)
    if frozen:
        for module in (net.embed, net.blocks[0], net.blocks[1].norm):
            module.requires_grad_(False)
    return [(p.numel(), p.requires_grad) for p in net.parameters()]


@pytest.mark.parametrize(("stage", "precision", "persist", "frozen"), sorted(MEASURED))
def test_matches_deepspeed_measurement_within_5_percent(stage, precision, persist, frozen):
    zm = zero_memory(
        _chain_params(frozen), stage=stage, world_size=2, precision=precision,
        persistence_threshold=100_000 if persist else 0, reduce_bucket_size=2**20, overlap_comm=True,
    )
    measured = MEASURED[(stage, precision, persist, frozen)]
    assert abs(zm.held_bytes - measured) <= 0.05 * measured, (zm.held_bytes, measured)


def test_bf16_true_and_mixed_are_the_same_under_deepspeed():
    for stage in STAGES:
        a, b = _zm(stage, "bf16-mixed"), _zm(stage, "bf16-true")
        assert (a.held_bytes, a.to_static_memory()) == (b.held_bytes, b.to_static_memory())


@pytest.mark.parametrize("precision", PRECISIONS)
def test_higher_stages_and_more_ranks_hold_less(precision):
    big = [(4_000_000, True), (1_000_000, True), (100, True)]
    held = {}
    for n in (1, 2, 4, 8):
        for s in STAGES:
            held[n, s] = zero_memory(big, stage=s, world_size=n, precision=precision, persistence_threshold=0,
                                     contiguous_gradients=False).held_bytes
    for n in (2, 4, 8):
        assert held[n, 1] <= held[n, 0] or precision == "32-true"  # fp32 stage 1 adds a partitioned copy
        # at two ranks stage 3's half of the parameters plus its kept gradient partition
        # equal stage 2's whole parameters; beyond, stage 3 holds less
        assert held[n, 3] <= held[n, 2] <= held[n, 1]
        assert n == 2 or held[n, 3] < held[n, 2]
        for s in (1, 2, 3):
            assert held[n, s] < held[n // 2, s]
    # one rank: nothing to partition, stage 3 holds the whole model plus whole gradients
    assert held[1, 3] > held[1, 2]


def test_static_memory_mapping():
    zm = _zm(2, "bf16-mixed")
    sm = zm.to_static_memory()
    assert isinstance(sm, StaticMemory)
    # per-backward buckets count as resident for the planner, not as held between steps
    assert sm.resident_bytes == zm.held_bytes + zm.bucket_bytes
    zm3 = _zm(3, "bf16-mixed")
    assert zm3.to_static_memory().resident_bytes == zm3.held_bytes + zm3.gather_bytes
    assert zero_static_memory(PARAMS, stage=3, world_size=2, precision="bf16-mixed", reduce_bucket_size=BUCKET) == zm3.to_static_memory()
    assert isinstance(zm3, ZeroMemory)


def test_persistence_and_live_parameter_limits():
    whole = _zm(3, persistence_threshold=10_000)
    split = _zm(3, persistence_threshold=0)
    assert whole.param_bytes - split.param_bytes == 4 * 1510
    assert whole.gather_bytes == 0 and split.gather_bytes == 4 * 1510
    assert _zm(3, persistence_threshold=0, max_live_parameters=100).gather_bytes == 400


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(stage=4), r"stage=4 is not a ZeRO stage"),
        (dict(stage=2, world_size=0), r"world_size=0 must be a positive integer"),
        (dict(stage=2, precision="16-mixed"), r"precision='16-mixed' is not modelled"),
    ],
)
def test_bad_input(kwargs, match):
    kwargs.setdefault("world_size", 2)
    kwargs.setdefault("precision", "32-true")
    with pytest.raises(ValueError, match=match):
        zero_memory(PARAMS, **kwargs)
    with pytest.raises(ValueError, match="non-negative"):
        zero_memory([(-1, True)], stage=1, world_size=2, precision="32-true")
