"""The optimizer: AdamW, Adafactor or Muon (jaxpar.train.muon) with linear warmup, cosine decay and
global-norm clipping."""

from __future__ import annotations

from typing import NamedTuple

import jax
import optax

from jaxpar.config import TrainConfig
from jaxpar.model.axes import holds_array, is_variable, logical_names
from jaxpar.train.muon import check_muon_weights, muon_update
from jaxpar.train.offload import layerwise


class Optimizer(NamedTuple):
    """The optax transformation and the learning-rate schedule it follows (reported as 'lr').
    tx is clip_by_global_norm(clip_norm) then `update`; train.offload=optimizer runs the two
    itself (jaxpar.train.offload), layer by layer when `by_layer`."""

    tx: optax.GradientTransformation
    schedule: optax.Schedule
    update: optax.GradientTransformation
    clip_norm: float
    by_layer: bool

    @classmethod
    def build(cls, t: TrainConfig, abstract_params) -> Optimizer:
        """For the parameters `abstract_params` (shapes only): train.muon_weights is checked against them."""
        if t.optimizer == "muon":
            check_muon_weights(t, abstract_params)
        update = optimizer_update(t)
        return cls(make_optimizer(t, update), lr_schedule(t), update, t.clip_norm,
                   t.offloads_optimizer and layerwise(update, abstract_params))


def lr_schedule(t: TrainConfig) -> optax.Schedule:
    """Linear warmup to train.lr, then cosine decay to a tenth of it at train.lr_schedule_steps
    (train.steps when 0), so a run cut into several jobs keeps one trajectory. Step s < train.warmup takes
    lr (s + 1) / warmup: the first step already learns (a warmup from 0 makes it a step that changes no
    weight, which verify could not judge), and step warmup - 1 is the peak."""
    horizon = t.lr_schedule_steps or t.steps
    warmup = min(t.warmup, horizon)
    peak_step = max(warmup - 1, 0)
    return optax.warmup_cosine_decay_schedule(
        init_value=t.lr / max(warmup, 1), peak_value=t.lr, warmup_steps=peak_step,
        decay_steps=max(horizon, peak_step + 1), end_value=t.lr * 0.1)


def _decay_mask(params):
    # Decay matrices only; norm scales (1 dim per layer) are left alone.
    def is_matrix(x):  # (a frozen weight's or one Muon takes: a placeholder)
        return holds_array(x) and sum(n != "layers" for n in logical_names(x, x.get_value().ndim)) >= 2

    return jax.tree.map(lambda v: v.replace(is_matrix(v)), params, is_leaf=is_variable)


def make_optimizer(t: TrainConfig, update: optax.GradientTransformation | None = None) -> optax.GradientTransformation:
    """Clip by global norm, then `update` (default: `optimizer_update`): the chain's state is
    (clipping's empty state, the update's state)."""
    return optax.chain(optax.clip_by_global_norm(t.clip_norm), update or optimizer_update(t))


def optimizer_update(t: TrainConfig) -> optax.GradientTransformation:
    """AdamW (b2=0.95), Adafactor (factored second moments), or Muon on the hidden matrices with
    this AdamW on the other weights (jaxpar.train.muon), on the schedule, after clipping.

    Adafactor keeps row and column statistics instead of a full second moment and no first
    moment; its step is not scaled by the parameter norm, so train.lr means the same as for AdamW.
    It factors any weight whose two largest dimensions are at least 32, so head-split
    attention weights (D, 3, H, K) are factored too (optax's default threshold, 128, skips them).
    """
    if t.optimizer == "adafactor":
        return optax.adafactor(lr_schedule(t), min_dim_size_to_factor=32, multiply_by_parameter_scale=False,
                               clipping_threshold=None,
                               weight_decay_rate=t.weight_decay or None, weight_decay_mask=_decay_mask)
    adamw = optax.adamw(lr_schedule(t), b1=0.9, b2=0.95, eps=1e-8, weight_decay=t.weight_decay, mask=_decay_mask)
    return muon_update(t, lr_schedule(t), adamw) if t.optimizer == "muon" else adamw
