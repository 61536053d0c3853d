"""The ZeRO static memory model: hand-computed cases, DeepSpeed's measured bytes, properties."""

from __future__ import annotations

import pytest
from models import TinyChain

from lightning_ckpt.profiling.memory.static_memory import StaticMemory
from lightning_ckpt.profiling.memory.zero_memory import (
    PRECISIONS,
    STAGES,
    ZeroMemory,
    ZeroOffload,
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


# ---------------------------------------------------------------------------- ZeRO-Offload

CPU = ZeroOffload(optimizer_device="cpu")
CPU_BOTH = ZeroOffload(optimizer_device="cpu", param_device="cpu")


@pytest.mark.parametrize(
    ("stage", "offload", "kw", "expected"),
    [
        # stage 2 on two ranks: whole bf16 parameters, a one-parameter (1000-element) gradient buffer and
        # the two overlapping buckets stay; this rank's half (505) of the trainable elements goes to the host
        # as fp32 master, fp32 gradient and two moments, with a bf16 copy of it and a host gradient buffer
        (2, CPU, dict(overlap_comm=True), dict(
            param_bytes=2 * 1510, master_bytes=0, optimizer_state_bytes=0, offload_buffer_bytes=2 * 1000,
            bucket_bytes=2 * 2 * BUCKET, grads_on_device=False, step_transient_bytes=4 * 1000,
            host_master_bytes=4 * 505, host_grad_bytes=4 * 505, host_optimizer_state_bytes=8 * 505 + 4,
            host_buffer_bytes=2 * 505 + 2 * 1000)),
        # stage 1 reduces during the backward only with overlap_comm; without it gradients build up
        (1, CPU, dict(overlap_comm=False), dict(grads_on_device=True, bucket_bytes=2 * BUCKET)),
        (1, CPU, dict(overlap_comm=True), dict(grads_on_device=False)),
        # NVMe at stages 1-2 is host memory as for cpu (DeepSpeed swaps at stage 3 only)
        (2, ZeroOffload(optimizer_device="nvme"), {}, dict(host_master_bytes=4 * 505, nvme_bytes=0)),
        # accumulating micro-batches adds a bf16 copy of the partition's gradients in host memory
        (2, CPU, dict(accumulation_steps=4), dict(host_buffer_bytes=2 * 505 + 2 * 1000 + 2 * 505)),
        # stage 3, optimizer offloaded: partitions (500 + 5 + 250) and the bucket stay, gradients go
        (3, CPU, {}, dict(
            param_bytes=2 * 755, grad_bytes=0, master_bytes=0, optimizer_state_bytes=0, bucket_bytes=2 * BUCKET,
            grads_on_device=False, host_master_bytes=4 * 505, host_grad_bytes=4 * 505,
            host_optimizer_state_bytes=8 * 505 + 4, host_buffer_bytes=2 * 505, gather_bytes=2 * 1510)),
        # and the parameters: only the gathered ones on the device, the partitions in host memory
        (3, CPU_BOTH, {}, dict(param_bytes=0, host_param_bytes=2 * 755, gather_bytes=2 * 1510)),
        # stage 3, optimizer on NVMe: fp32 partition, gradient and moments swapped out through four host
        # buffers as large as the largest sub-group (here all 505 trainable partition elements)
        (3, ZeroOffload(optimizer_device="nvme"), {}, dict(
            host_master_bytes=0, host_optimizer_state_bytes=0, host_buffer_bytes=2 * 505 + 4 * 4 * 505,
            nvme_bytes=4 * 505 * 2 + 8 * 505 + 4)),
        # parameters on NVMe: 600 partition elements stay in host memory (max_in_cpu), the rest is swapped,
        # through two buffers of 100 elements
        (3, ZeroOffload(param_device="nvme", param_max_in_cpu_elements=600, param_buffer_count=2,
                        param_buffer_elements=100), {}, dict(
            param_bytes=0, host_param_bytes=2 * 600, host_buffer_bytes=2 * 2 * 100, nvme_bytes=2 * 155,
            master_bytes=4 * 505, grads_on_device=True)),
    ],
)
def test_offload_hand_computed(stage, offload, kw, expected):
    zm = _zm(stage, "bf16-mixed", persistence_threshold=0, offload=offload, **kw)
    for field, value in expected.items():
        assert getattr(zm, field) == value, field


def test_offloaded_state_is_in_host_parts_not_in_the_device_static_memory():
    zm = _zm(2, "bf16-mixed", offload=CPU, overlap_comm=True)
    sm = zm.to_static_memory()
    assert sm.resident_bytes == 2 * 1510 + 2 * 1000 + 2 * 2 * BUCKET  # parameters, gradient buffer, buckets
    assert not sm.grads_on_device and sm.optimizer_transient_bytes == 4 * 1000
    assert dict(sm.host_parts) == {
        "fp32 master weights": 4 * 505, "fp32 gradients": 4 * 505, "optimizer state": 8 * 505 + 4,
        "copy buffers": 2 * 505 + 2 * 1000,
    }
    assert sm.host_bytes == zm.host_bytes and zm.held_bytes == zm.device_held_bytes + zm.host_bytes
    not_offloaded = _zm(2, "bf16-mixed", overlap_comm=True).to_static_memory()
    assert not_offloaded.host_parts == () and not_offloaded.grads_on_device
    assert sm.resident_bytes + sm.host_bytes > not_offloaded.resident_bytes  # offloading adds copy buffers


def test_gathered_parameters_on_one_rank_and_with_a_module_bound():
    # one rank: the gathered parameter is the partition itself, on the device already
    assert _zm(3, world_size=1, persistence_threshold=0).gather_bytes == 0
    # unless the partitions are in host memory: then each gathered one is a device copy
    assert _zm(3, world_size=1, persistence_threshold=0, offload=CPU_BOTH).gather_bytes == 4 * 1510
    # no prefetching and nothing kept for reuse: one module's parameters at a time
    bound = dict(largest_module_elements=1010, prefetch_bucket_size=0, max_reuse_distance=0)
    assert _zm(3, persistence_threshold=0, **bound).gather_bytes == 4 * 1010
    assert _zm(3, persistence_threshold=0, **{**bound, "prefetch_bucket_size": 200}).gather_bytes == 4 * 1210
    assert _zm(3, persistence_threshold=0, **{**bound, "max_reuse_distance": 10**9}).gather_bytes == 4 * 1510


# DeepSpeed 0.19.8 on one CPU rank, bf16-mixed, DeepSpeedCPUAdam, `tests/test_zero_offload.py`'s model
# (TinyChain, 6 blocks, d=128; buckets of 2**18 elements, overlap_comm): the device tensors before a
# steady step (flat parameters or partitions, DeepSpeed's gradient buffer, ZeRO-3's bucket; the batch left
# out) and the host tensors (`test_zero_offload.host_tensors`), unique storages.
MEASURED_OFFLOAD = {
    (2, "cpu", "none"): (1_728_264, 14_505_800),
    (3, "cpu", "none"): (2_121_478, 14_374_710),
    (3, "cpu", "cpu"): (524_288, 15_971_900),
}


@pytest.mark.parametrize(("stage", "optimizer", "params"), sorted(MEASURED_OFFLOAD))
def test_offload_matches_deepspeeds_device_and_host_tensors(stage, optimizer, params):
    net = TinyChain(n_blocks=6, d=128, vocab=50, n_classes=3)
    zm = zero_memory(
        [(p.numel(), True) for p in net.parameters()], stage=stage, world_size=1, precision="bf16-mixed",
        persistence_threshold=0, reduce_bucket_size=2**18, overlap_comm=True,
        offload=ZeroOffload(optimizer_device=optimizer, param_device=params),
    )
    device, host = MEASURED_OFFLOAD[(stage, optimizer, params)]
    assert abs(zm.device_held_bytes - device) <= 0.001 * device, (zm.device_held_bytes, device)
    assert abs(zm.host_bytes - host) <= 0.001 * host, (zm.host_bytes, host)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(stage=0, offload=CPU), r"DeepSpeed offloads the optimizer at ZeRO stages 1-3 and the parameters at stage 3"),
        (dict(stage=2, offload=ZeroOffload(param_device="cpu")), r"stage=2 with offload_optimizer='none', offload_param='cpu'"),
    ],
)
def test_offload_where_deepspeed_has_none(kwargs, match):
    with pytest.raises(ValueError, match=match):
        zero_memory(PARAMS, world_size=2, precision="bf16-mixed", **kwargs)
    with pytest.raises(ValueError, match=r"ZeroOffload optimizer_device='gpu' is not a DeepSpeed offload device"):
        ZeroOffload(optimizer_device="gpu")
