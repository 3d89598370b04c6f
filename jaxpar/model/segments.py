"""Packed rows: which document each position belongs to and where it sits inside it.

A packed row holds several documents one after another. Attention must not look across a
document boundary and positions restart at 0 for each document, so the model takes, besides the
tokens, a `Segments`: the document id of every position (ids non-decreasing along the row) and its
position within its document. None means one document per row, positions 0 ... L-1.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxpar.model.scores import ScoreOptions


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Segments:
    """ids_BL: each position's document id, non-decreasing along a row; positions_BL: its position
    within that document (0 at the document's first token)."""

    ids_BL: jax.Array
    positions_BL: jax.Array

    def visible_BLP(self, window: int = 0) -> jax.Array:
        """(B, L, L) bools: query l sees key p when p <= l (and l - p < window, if set) and both are in
        the same document."""
        position_L = jnp.arange(self.ids_BL.shape[1])
        seen_LP = ScoreOptions(window=window).sees(position_L, position_L)
        return seen_LP[None] & (self.ids_BL[:, :, None] == self.ids_BL[:, None, :])
