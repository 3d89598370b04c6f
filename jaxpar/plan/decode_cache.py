"""The decoding cache generation would hold, from the shapes of the model's empty caches
(`jax.eval_shape`: nothing is allocated): bytes per token and layer, and for train.batch_size rows of
model.seq_len positions in the compute dtype.

Ordinary attention caches a key and a value per key/value head, 2 x kv_heads x head_size numbers a
token and layer; latent attention (model.mla) its latent and shared rotated key, kv_rank + rope_dim,
whatever the heads. The figures are for the whole batch on all devices: generation splits the rows
over the data axes, and ordinary attention's key/value heads over tensor where it divides them (the
latent is replicated)."""

from __future__ import annotations

import jax
from flax import nnx


def decode_cache(trainer) -> dict:
    """{"decode_cache": {rows, positions, dtype, bytes_per_token_per_layer, total_bytes}}, or {} for a
    module of one's own without `empty_caches`."""
    model = nnx.merge(trainer.graphdef, trainer.abstract_params)
    if not hasattr(model, "empty_caches"):
        return {}
    cfg, dtype = trainer.cfg.model, trainer.precision.compute_dtype
    rows, positions = trainer.cfg.train.batch_size, cfg.seq_len
    caches = jax.eval_shape(lambda: model.empty_caches(cfg, rows, positions, dtype))
    # the slots (layers, rows, positions, ...); each row's start and the fill count are bookkeeping
    slots = [leaf for leaf in jax.tree.leaves(caches) if leaf.shape[1:3] == (rows, positions)]
    total = sum(leaf.size * leaf.dtype.itemsize for leaf in slots)
    return {"decode_cache": {"rows": rows, "positions": positions, "dtype": str(dtype), "total_bytes": total,
                             "bytes_per_token_per_layer": total // (rows * positions * cfg.n_layers)}}


def format_decode_cache(entry: dict) -> list[str]:
    """The plan report's lines for the decoding cache."""
    mib = 2 ** 20
    return [f"{'decode cache per token, layer':<32}{entry['bytes_per_token_per_layer']:>18,d}   ({entry['dtype']})",
            f"{'decode cache, all devices':<32}{entry['total_bytes']:>18,d}{entry['total_bytes'] / mib:>12.2f}"
            f"   ({entry['rows']} rows x {entry['positions']} positions)"]
