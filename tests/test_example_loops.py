"""The plain-loop and Fabric examples, small: they train under the plan with the losses of the same
loop without it."""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples import train_fabric, train_plain  # noqa: E402


def test_plain_example_matches_the_loop_without_checkpointing(capsys):
    checkpointed = train_plain.train(steps=2, memory_budget="40MiB", batch_size=8, n_blocks=4)
    plain = train_plain.train(steps=2, memory_budget=None, batch_size=8, n_blocks=4)
    assert checkpointed == plain and len(plain) == 2
    out = capsys.readouterr().out
    assert re.search(r"[1-4]/4 blocks checkpointed", out) and ": fits" in out  # the plan table: it recomputes, it fits


def test_fabric_example_trains_under_the_plan(capsys):
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    losses = train_fabric.train(fabric, steps=2, memory_budget="40MiB", batch_size=8, n_blocks=4)
    assert len(losses) == 2 and re.search(r"[1-4]/4 blocks checkpointed", capsys.readouterr().out)
