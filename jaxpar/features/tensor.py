"""Tensor parallelism over mesh.tensor (Megatron's splits of the MLP, the attention heads and the
vocabulary) and sequence parallelism (parallel.sequence: the residual stream split along the
sequence over the same ranks). Its part of the layout is its entries of the rules table."""

from __future__ import annotations

from jaxpar.config import Config
from jaxpar.features.feature import Checks, Switch, axis, unless

SWITCHES = (
    Switch("mesh.tensor", axis("tensor"), reference=1, searched=True),
    Switch("parallel.sequence", unless(False, "sequence"), reference=False, with_local_sgd=False),
)


def checks(cfg: Config, sizes: dict[str, int]) -> Checks:
    m, tensor = cfg.model, sizes["tensor"]
    for key in ("n_heads", "d_ff"):
        if getattr(m, key) % tensor:
            yield f"model.{key}={getattr(m, key)} is not divisible by mesh.tensor={tensor}."
    if m.padded_vocab % tensor:
        padded = ("" if m.vocab_multiple == 1
                  else f" (padded to {m.padded_vocab} by model.vocab_multiple={m.vocab_multiple})")
        yield (f"model.vocab_size={m.vocab_size}{padded} is not divisible by mesh.tensor={tensor}; pad it "
               f"with model.vocab_multiple={tensor} (the padded rows never win, and export drops them).")
    if cfg.parallel.sequence and tensor > 1 and m.kv_heads % tensor:
        yield (f"parallel.sequence=true needs the {m.kv_heads} key/value heads (model.n_kv_heads) to be "
               f"divisible by mesh.tensor={tensor}.")
    if cfg.parallel.sequence and m.seq_len % (tensor * sizes["context"]):
        across = f" x mesh.context={sizes['context']}" if sizes["context"] > 1 else ""
        yield (f"parallel.sequence=true splits model.seq_len={m.seq_len} over mesh.tensor={tensor}{across}, "
               f"which does not divide it.")


def rules(table: dict, cfg: Config, sizes: dict[str, int]) -> dict:
    """With fewer key/value heads than tensor ranks (or a count they do not divide) every rank keeps
    all of them, as Megatron and MaxText do: each rank computes the KV heads its query heads use.
    Sequence parallelism splits the residual stream between blocks over `tensor` (within each
    context slice under mesh.context)."""
    table = dict(table)
    if cfg.model.kv_heads % sizes["tensor"]:
        table["kv_heads"] = None
    if cfg.parallel.sequence:
        table["residual_seq"] = ("context", "tensor") if sizes["context"] > 1 else "tensor"
    return table
