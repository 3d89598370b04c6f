"""Dynamic loss scaling (the precision policy's `loss_scaling`: fp16), and skipping non-finite steps.

Master weights stay fp32 and the forward pass runs on a cast copy (jaxpar.config.precision), so
gradients arrive in fp32. Under loss scaling the loss is multiplied by a scale before
differentiation and the gradients divided by it after. A non-finite gradient halves the scale
and skips the update; `loss_scale_window` good steps in a row double it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxpar.config.precision import PrecisionPolicy


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LossScale:
    """Dynamic loss-scale state: the scale, good steps since the last change, steps skipped."""

    scale: jax.Array
    good_steps: jax.Array
    skipped_steps: jax.Array

    @staticmethod
    def initial(policy: PrecisionPolicy) -> LossScale:
        """The policy's initial scale (2^15 for fp16; a constant 1, never changed, otherwise)."""
        return LossScale(jnp.asarray(policy.initial_loss_scale, jnp.float32), jnp.zeros((), jnp.int32),
                         jnp.zeros((), jnp.int32))

    def update(self, finite: jax.Array, window: int) -> LossScale:
        """Halve and count a skip on overflow; double after `window` good steps in a row."""
        good = jnp.where(finite, self.good_steps + 1, 0)
        grow = good >= window
        scale = jnp.where(finite, jnp.where(grow, self.scale * 2, self.scale), jnp.maximum(self.scale / 2, 1.0))
        return LossScale(scale, jnp.where(grow, 0, good), self.skipped_steps + (~finite).astype(jnp.int32))

    def count_skip(self, finite: jax.Array) -> LossScale:
        """Count a skipped step without touching the (constant) scale: fp32/bf16 with on_nonfinite=skip."""
        return LossScale(self.scale, self.good_steps, self.skipped_steps + (~finite).astype(jnp.int32))

    def after_step(self, finite: jax.Array | None, policy: PrecisionPolicy) -> LossScale:
        """The state after a step whose gradients were `finite` (None: not checked, nothing changes):
        updated under the policy's loss scaling, else the skip counted."""
        if finite is None:
            return self
        return self.update(finite, policy.loss_scale_window) if policy.loss_scaling else self.count_skip(finite)


def all_finite(tree) -> jax.Array:
    """True when every element of every leaf is finite."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def unless_skipped(finite, new, old):
    """`new`, or `old` (bit-identical) where the step is skipped: `finite` False. finite None: the
    step is never skipped."""
    if finite is None:
        return new
    return jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
