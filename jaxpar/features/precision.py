"""Precision (train.precision, parallel.grad_reduce_dtype): the rows and checks of the precision
policy, whose every dtype decision jaxpar.config.precision resolves once."""

from __future__ import annotations

from jaxpar.config import Config
from jaxpar.features.feature import Checks, Switch, unless

SWITCHES = (
    Switch("parallel.grad_reduce_dtype", unless("fp32", "grad_reduce={value}"), reference="fp32",
           with_local_sgd=False),
    Switch("train.precision", lambda value, cfg, sizes: value, reference="fp32"),
)


def checks(cfg: Config, sizes: dict[str, int]) -> Checks:
    if cfg.train.loss_scale_window <= 0:
        yield f"train.loss_scale_window must be positive, got {cfg.train.loss_scale_window}."
