"""The probe sizes a step can be profiled at: a BatchNorm over pooled (batch, channels) features refuses a
slice of one sample in training, so the probes move to (2, 4) when the batch has that many samples, and
say so; a batch too small for that is refused with the sizes to set."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_ckpt import auto_checkpoint
from lightning_ckpt.engine.step_profile import profile_model

SHIFTED = r"profiled at probe_batch_sizes=\(2, 4\) instead of \(1, 2\) and check_batch_size=8; set probe_batch_sizes"


class PooledBatchNorm(nn.Module):
    """Conv blocks, global pooling to (batch, channels), then a head with BatchNorm1d on those features."""

    def __init__(self, c: int = 4, n_classes: int = 3) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.ReLU()) for _ in range(3)])
        self.head = nn.Sequential(nn.Linear(c, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, n_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x).mean((2, 3)))


def _setup(n: int):
    torch.manual_seed(0)
    model = PooledBatchNorm()
    batch = (torch.randn(n, 4, 8, 8), torch.randint(0, 3, (n,)))
    return model, batch, lambda b: F.cross_entropy(model(b[0]), b[1])


def test_auto_checkpoint_profiles_at_two_and_four_and_says_so():
    model, batch, step = _setup(8)
    with pytest.warns(UserWarning, match=SHIFTED):
        handle = auto_checkpoint(model, "64MiB", example_batch=batch, step_fn=step, blocks="blocks", verbose=False)
    profile = handle.engine.profile
    assert [p.batch_size for p in profile.probes] == [2, 4]
    assert profile.check is not None and profile.check.batch_size == 8
    assert handle.plan is not None and handle.batch_size == 8
    handle.remove()


def test_profile_model_profiles_at_two_and_four_and_leaves_the_batchnorm_as_found():
    model, batch, step = _setup(8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.warns(UserWarning, match=SHIFTED):
        profile = profile_model(model, list(model.blocks), step, batch, (1, 2), check_batch_size=4, timing=False)
    assert [p.batch_size for p in profile.probes] == [2, 4] and profile.check.batch_size == 8
    after = model.state_dict()  # the failed one-sample probe updated no running statistics
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_check_beyond_the_batch_is_dropped_when_shifted():
    model, batch, step = _setup(5)
    with pytest.warns(UserWarning, match=r"instead of \(1, 2\) and check_batch_size=None"):
        profile = profile_model(model, list(model.blocks), step, batch, (1, 2), check_batch_size=4, timing=False)
    assert [p.batch_size for p in profile.probes] == [2, 4] and profile.check is None


@pytest.mark.parametrize(
    ("n", "fix"),
    [(3, r"Set probe_batch_sizes=\(2, 3\)\.$"), (2, r"Set a batch of at least 3 samples and probe_batch_sizes=\(2, 3\)")],
)
def test_a_batch_too_small_for_two_sample_probes_says_what_to_set(n, fix):
    model, batch, step = _setup(n)
    with pytest.raises(
        ValueError,
        match=rf"^the probe of 1 sample failed in a BatchNorm \(Expected more than 1 value per channel when training.*"
        rf"needs at least 2 samples, and the batch has {n}, too few for probes \(2, 4\)\. {fix}",
    ):
        auto_checkpoint(model, "64MiB", example_batch=batch, step_fn=step, blocks="blocks", verbose=False)


def test_probes_given_as_two_and_four_run_as_given_without_a_warning(recwarn):
    model, batch, step = _setup(8)
    profile = profile_model(model, list(model.blocks), step, batch, (2, 4), check_batch_size=8, timing=False)
    assert [p.batch_size for p in profile.probes] == [2, 4] and profile.check.batch_size == 8
    assert not [w for w in recwarn if "BatchNorm" in str(w.message)]


def test_other_errors_of_a_one_sample_probe_are_not_taken_for_batchnorm():
    model, batch, _ = _setup(8)

    def step(b):
        if b[0].shape[0] == 1:
            raise ValueError("this step needs pairs of samples")
        return F.cross_entropy(model(b[0]), b[1])

    with pytest.raises(ValueError, match=r"^this step needs pairs of samples$"):
        profile_model(model, list(model.blocks), step, batch, (1, 2), check_batch_size=4, timing=False)
