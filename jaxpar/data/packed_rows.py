"""The one batch type of the step: rows of tokens and, per token, its document, its position within
the document and whether it may be a target of the loss.

Packed rows (`data.packing` = concat or pack) carry all four. Plain windows (`data.packing=none`)
are rows of one document each with every target counted: the tokens alone, the other fields None,
so that the step computes on them exactly what a plain token array asks for (no masks, a plain
mean). The step takes either a PackedRows or a (B, T) token array, which `PackedRows.of` reads as
windows.

The same dataclass carries NumPy arrays on the host and jax arrays in the step; each field has the
rows on its leading axis, so sharding the batch and cutting it into microbatches cut every field
alike.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxpar.model.segments import Segments


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedRows:
    """tokens_BT: T = seq_len + 1 tokens per row (inputs [:, :-1], targets [:, 1:]).
    segments_BT: each token's document id, non-decreasing along the row (padding has its own).
    positions_BT: each token's position within its document.
    mask_BT: 1 where the token may be predicted (0: padding, a fine-tuning prompt).
    weights_BL: set by the step (`weighted`): each target's weight in the batch's mean loss.
    source_B: with a mixture (data.mixture), the source each row was drawn from, of `sources`.
    order_BL: set by the step under balanced context parallelism (`in_order`): the inputs' positions in
    the order the context devices hold them; inputs, targets, documents and masks come in that order.
    reference_BL: set by a DPO step: each target's log-probability under the reference model, in the
    targets' order (as targets_BL gives them).
    pair_weights_B: set by a preference step: each row's weight in the batch's mean over pairs
    (jaxpar.train.preference.weighted_pairs).
    sampled_BL: set for a GRPO step: each target's log-probability under the weights that sampled it, in the
    targets' order.
    advantages_B: set for a GRPO step: each row's (completion's) group-normalised advantage."""

    tokens_BT: jax.Array
    segments_BT: jax.Array | None = None
    positions_BT: jax.Array | None = None
    mask_BT: jax.Array | None = None
    weights_BL: jax.Array | None = None
    source_B: jax.Array | None = None
    sources: int = dataclasses.field(default=0, metadata={"static": True})
    order_BL: jax.Array | None = None
    reference_BL: jax.Array | None = None
    pair_weights_B: jax.Array | None = None
    sampled_BL: jax.Array | None = None
    advantages_B: jax.Array | None = None

    @classmethod
    def of(cls, batch) -> PackedRows:
        """A batch as rows: packed rows as they are, a (B, T) token array as windows."""
        return batch if isinstance(batch, cls) else cls(batch)

    def with_documents(self) -> PackedRows:
        """The rows with their documents, positions and masks spelled out (windows: one document per
        row, every target counted), for a step that reorders positions (in_order)."""
        if self.segments_BT is not None:
            return self
        tokens_BT = self.tokens_BT
        return dataclasses.replace(self, segments_BT=jnp.zeros_like(tokens_BT), mask_BT=jnp.ones_like(tokens_BT),
                                   positions_BT=jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape))

    def in_order(self, order_L) -> PackedRows:
        """The rows with their inputs' positions taken in `order_L` (a permutation of 0 ... L-1)."""
        order_BL = jnp.broadcast_to(jnp.asarray(order_L, jnp.int32), self.targets_BL.shape)
        return dataclasses.replace(self, order_BL=order_BL)

    def _ordered(self, x_BL: jax.Array) -> jax.Array:
        return x_BL if self.order_BL is None else jnp.take_along_axis(x_BL, self.order_BL, axis=1)

    @property
    def inputs_BL(self) -> jax.Array:
        return self._ordered(self.tokens_BT[:, :-1])

    @property
    def targets_BL(self) -> jax.Array:
        return self._ordered(self.tokens_BT[:, 1:])

    def segments(self) -> Segments | None:
        """The inputs' documents and positions, for the model (None for windows)."""
        if self.segments_BT is None:
            return None
        return Segments(self._ordered(self.segments_BT[:, :-1]), self._ordered(self.positions_BT[:, :-1]))

    def documents(self) -> tuple:
        """The model's arguments after the inputs: (segments,) for packed rows, () for windows (a model
        of your own that never trains packed rows need not take them)."""
        segments = self.segments()
        return () if segments is None else (segments,)

    def input_positions(self) -> tuple:
        """The embedding's arguments after the inputs: each input's position in its document for packed
        rows, () for windows (positions from 0)."""
        segments = self.segments()
        return () if segments is None else (segments.positions_BL,)

    def target_documents_BL(self) -> jax.Array:
        """Each target token's document, in the targets' order."""
        return self._ordered(self.segments_BT[:, 1:])

    def target_mask_BL(self) -> jax.Array:
        """Which targets count: maskable tokens of the same document as their input (never the first
        token of the next document, predicted from the last one of the previous)."""
        same_BL = self.segments_BT[:, 1:] == self.segments_BT[:, :-1]
        return self._ordered(same_BL & (self.mask_BT[:, 1:] != 0))

    def weighted(self) -> PackedRows:
        """The batch with each counted target weighted by (targets / counted targets), so the plain mean
        of weight x loss over the batch's targets is the mean over counted targets. Computed on the
        whole batch, so microbatches and data-parallel shards, each taking a plain mean, agree.
        Windows count every target: they stay as they are, and take the plain mean."""
        if self.mask_BT is None:
            return self
        counted_BL = self.target_mask_BL().astype(jnp.float32)
        weights_BL = counted_BL / jnp.maximum(jnp.mean(counted_BL), 1.0 / counted_BL.size)
        return dataclasses.replace(self, weights_BL=weights_BL)

    def mean_loss(self, losses_BL: jax.Array) -> tuple[jax.Array, dict]:
        """(the mean of each target's loss, weighted once `weighted`; {'loss': it, and for a mixture each
        source's share: by_source})."""
        if self.weights_BL is None:
            loss = losses_BL.mean()
            return loss, {"loss": loss}
        loss = (losses_BL * self.weights_BL).mean()
        return loss, {"loss": loss, **self.by_source(losses_BL)}

    def by_source(self, losses_BL: jax.Array) -> dict:
        """Per source of a mixture (else {}), two batch means that average over microbatches and shards
        like the loss does: `source_loss`, its weighted targets' share of the loss, and
        `source_targets`, their share of the counted targets (the source's mean loss is the ratio)."""
        if self.source_B is None:
            return {}
        rows_BS = jax.nn.one_hot(self.source_B, self.sources, dtype=jnp.float32)
        return {"source_loss": jnp.einsum("BL,BS->S", losses_BL * self.weights_BL, rows_BS) / losses_BL.size,
                "source_targets": jnp.einsum("BL,BS->S", self.weights_BL, rows_BS) / losses_BL.size}
