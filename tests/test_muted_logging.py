"""`self.log` is a no-op inside `muted_logging` and the module's own methods come back after."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest

from lightning_ckpt.frontends.lightning.muted_logging import muted_logging


class Logs(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.seen = []

    def log(self, name, value, **kwargs):
        self.seen.append(name)

    def log_dict(self, metrics, **kwargs):
        self.seen.extend(metrics)


def test_log_is_muted_inside_and_restored_after_even_on_error():
    module = Logs()
    with pytest.raises(RuntimeError, match="inside"), muted_logging(module):
        module.log("a", 1.0)
        module.log_dict({"b": 2.0})
        raise RuntimeError("inside")
    assert module.seen == []
    module.log("c", 3.0)
    module.log_dict({"d": 4.0})
    assert module.seen == ["c", "d"]
    assert "log" not in vars(module) and "log_dict" not in vars(module)


def test_a_log_set_on_the_instance_is_put_back():
    module = Logs()
    own = []
    module.log = lambda name, value, **kw: own.append(name)  # as Lightning does on callbacks
    with muted_logging(module):
        module.log("hidden", 0.0)
    module.log("shown", 0.0)
    assert own == ["shown"]
