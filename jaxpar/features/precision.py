"""Precision (train.precision, train.loss_scaling, parallel.grad_reduce_dtype): the rows and checks of the
precision policy, whose every dtype decision jaxpar.config.precision resolves once."""

from __future__ import annotations

from jaxpar.config import Config, precision
from jaxpar.features.feature import Checks, Switch, unless

SWITCHES = (
    Switch("parallel.grad_reduce_dtype", unless("fp32", "grad_reduce={value}"), reference="fp32",
           with_local_sgd=False),
    # the reference runs fp32, or where the GEMMs are not the compute dtype's (fp8) the same policy on one device
    Switch("train.precision", lambda value, cfg, sizes: value,
           reference=lambda value: precision.POLICIES[value].reference),
    Switch("train.loss_scaling", unless("auto", "loss_scaling={value}"), reference="auto"),
)


def checks(cfg: Config, sizes: dict[str, int]) -> Checks:
    t = cfg.train
    if t.loss_scale_window <= 0:
        yield f"train.loss_scale_window must be positive, got {t.loss_scale_window}."
    if t.loss_scaling == "dynamic":
        base = precision.POLICIES[t.precision]
        if base.scales_gradients_per_tensor:
            yield (f"train.loss_scaling=dynamic cannot go with train.precision={t.precision}: its GEMMs already "
                   f"scale every gradient into e5m2 by that tensor's own amax, so a loss scale has no underflow "
                   f"left to rescue; use train.loss_scaling=auto.")
        elif not base.reduced:
            yield (f"train.loss_scaling=dynamic needs train.precision=bf16 or fp16: {t.precision} gradients "
                   f"do not underflow; use train.loss_scaling=auto.")
