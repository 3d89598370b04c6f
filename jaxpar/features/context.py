"""Context parallelism over mesh.context: the sequence split through the whole block, attention
across the split (parallel.context_attention: ring or all-gather), in balanced chunks or not
(parallel.context_balance). Its part of the layout is its entries of the rules table."""

from __future__ import annotations

from jaxpar.config import Config
from jaxpar.features.feature import Checks, Switch, axis

SWITCHES = (
    Switch("mesh.context", axis("context"), reference=1, searched=True, with_local_sgd=False),
    Switch("parallel.context_attention", lambda value, cfg, sizes: value if sizes["context"] > 1 else None,
           searched=True),
    Switch("parallel.context_balance",
           lambda value, cfg, sizes: None if sizes["context"] == 1 or value else "unbalanced"),
)


def checks(cfg: Config, sizes: dict[str, int]) -> Checks:
    m, p, context = cfg.model, cfg.parallel, sizes["context"]
    chunks = 2 * context if p.context_balance else context
    if context > 1 and sizes["stage"] > 1 and (p.context_attention == "ring" or not p.context_balance
                                               or sizes["tensor"] > 1):  # in a stage's branch: XLA hangs or aborts
        yield ("mesh.context with pipeline stages runs only with parallel.context_attention=allgather, "
               "parallel.context_balance=true and mesh.tensor=1.")
    if context > 1 and m.moe.experts and p.context_balance:
        yield ("MoE routing groups take consecutive tokens, which balanced context parallelism reorders; "
               "set parallel.context_balance=false with model.moe.experts.")
    if context > 1 and m.lora.dropout and p.context_balance:
        yield ("model.lora.dropout does not run with balanced context parallelism yet (its masks follow the "
               "positions, which balance reorders); set parallel.context_balance=false.")
    if context > 1 and m.seq_len % chunks:
        yield (f"mesh.context={context} cuts model.seq_len={m.seq_len} into {chunks} chunks"
               f"{' (balanced: 2 x context)' if p.context_balance else ''}, which do not divide it.")
    if context > 1 and m.attention == "cudnn":
        yield (f"model.attention=cudnn cannot run across mesh.context={context}: cuDNN's kernel takes "
               f"whole sequences; use flash or dot, which jaxpar's context attention runs per block.")


def rules(table: dict, cfg: Config, sizes: dict[str, int]) -> dict:
    """With mesh.context > 1 the sequence is split over `context` everywhere, inside the blocks and
    between them."""
    if sizes["context"] == 1:
        return table
    return {**table, "seq": "context", "residual_seq": "context"}
