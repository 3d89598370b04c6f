"""What a Flax NNX module implements to be trained by jaxpar (`Trainer(session, model=...)`).

Any module whose parameters carry logical axis names (`nnx.Param(value, out_sharding=names)`)
and whose `__call__(tokens_BL)` returns logits (B, L, V) trains with data and tensor parallelism,
ZeRO 0-3, the precision policies, gradient accumulation, optimizer offload, compressed
reductions and local SGD: jaxpar lays out its state by the rules table (extended with the
module's own names) and differentiates the cross-entropy of its logits. ZeRO-2/3 then gather
and reduce the whole model's weights at once.

A module that also implements `BlockModel` (jaxpar's Transformer does, and nothing more) gets
what needs the layers one by one: ZeRO-2/3 layer by layer inside the layer scan, remat
policies, offloaded activations and pipeline stages. Its layers are stacked on a leading axis
named "layers" (`nnx.vmap(..., transform_metadata={nnx.PARTITION_NAME: "layers"})`) below the
path STACKED_AT, and `run_blocks` hands them to the `scan` jaxpar gives it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import jax


@runtime_checkable
class BlockModel(Protocol):
    """A language model in three parts around a stack of layers.

    STACKED_AT: the path of the stacked layers in the module's state, e.g. ("blocks",).
    embed(tokens_BL) -> x_BLD; logits(x_BLD) -> logits_BLV (fp32); stacked_layers() -> L.
    run_blocks(x_BLD, scan=None, layer_ids=None, noise_B=None, segments=None) -> (x_BLD, stats): split the stacked
    layers off (`nnx.split`) and return scan(one_layer, x_BLD, stacked_state, layer_ids), where
    one_layer(x_BLD, layer_state, layer_id) -> (x_BLD, stats) merges one layer and runs it; with
    scan None, a plain `lax.scan`. layer_ids default to 0 ... L-1; stats is {} unless the layers
    report per-layer statistics (jaxpar's mixture of experts); noise_B, a PRNG key per row, is for
    noisy routing and may be ignored. For packed rows (`data.packing`), embed(tokens_BL, positions_BL)
    takes each token's position within its document and run_blocks `segments`
    (jaxpar.model.segments.Segments), which attention must respect; a model trained only on whole
    rows need not accept either.
    """

    STACKED_AT: tuple[str, ...]

    def embed(self, tokens_BL: jax.Array) -> jax.Array: ...

    def run_blocks(self, x_BLD: jax.Array, scan: Callable | None = None, layer_ids: jax.Array | None = None,
                   noise_B: jax.Array | None = None, segments=None): ...

    def logits(self, x_BLD: jax.Array) -> jax.Array: ...

    def stacked_layers(self) -> int: ...


def is_block_model(model) -> bool:
    return isinstance(model, BlockModel)
