"""Routing traced token by token, for `jaxpar verify`: a layout records each MoE decision, and the
single-device reference replays the layout's decisions instead of making its own.

A decision is a code per (token, expert) (jaxpar.model.routers.Decided): 0 for an expert the token
did not go to, j + 1 for its j-th choice (1 for Expert Choice, whose experts pick tokens),
negated where capacity dropped the assignment. The step places each token's codes at its
(layer, row) in a zero array of the whole batch (U stacked layers x R rows x L positions x E),
so they add up exactly over layers, microbatches, pipeline stages and devices (small integers in
fp32) and come out of any layout in the reference's coordinates.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

_EXACT = jax.lax.Precision.HIGHEST  # one-hot placements of small integers: exact in fp32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RoutingTrace:
    """places_BR: each local row's one-hot place among the R rows of the whole batch.
    replay_BULE: the decisions to take instead of the router's own (the reference; else None), per
    local row. layer_U: the one-hot of the layer being run (set by `at_layer`). units: U, the
    stacked layers of the whole model (static)."""

    places_BR: jax.Array
    replay_BULE: jax.Array | None = None
    layer_U: jax.Array | None = None
    units: int = dataclasses.field(default=1, metadata={"static": True})

    def at_layer(self, layer_id: jax.Array) -> RoutingTrace:
        """This trace inside MoE layer `layer_id` (its index among the MoE layers, in model order)."""
        return dataclasses.replace(self, layer_U=jax.nn.one_hot(layer_id, self.units, dtype=jnp.float32))

    def after(self, layers: int) -> RoutingTrace:
        """The trace of the MoE layer `layers` after this one (the next MoE blocks of a scanned unit)."""
        return self if layers == 0 else dataclasses.replace(self, layer_U=jnp.roll(self.layer_U, layers))

    def replayed(self, groups: int) -> jax.Array | None:
        """This layer's decisions to replay, (G, N, E) like the router's scores; None: route freely."""
        if self.replay_BULE is None:
            return None
        codes_BLE = jnp.einsum("U,BULE->BLE", self.layer_U, self.replay_BULE, precision=_EXACT)
        return codes_BLE.reshape(groups, -1, codes_BLE.shape[-1])

    def place(self, values_GN: jax.Array) -> jax.Array:
        """Per-token values (G, N, ...) at their (layer, row, position) in the whole batch: (U, R, L, ...)."""
        B = self.places_BR.shape[0]
        values_BL = values_GN.reshape(B, -1, *values_GN.shape[2:]).astype(jnp.float32)
        return jnp.einsum("U,BR,BL...->URL...", self.layer_U, self.places_BR, values_BL, precision=_EXACT)
