"""Multi-token prediction (model.mtp; jaxpar.model.mtp): a depth the rows and the pipeline can hold,
and what it does not combine with yet."""

from __future__ import annotations

from jaxpar.config import Config
from jaxpar.config.objectives import objective_of
from jaxpar.features.feature import Checks, Switch

SWITCHES: tuple[Switch, ...] = ()  # it changes what the model learns, not how a layout splits it


def checks(cfg: Config, sizes: dict[str, int]) -> Checks:
    m, mtp = cfg.model, cfg.model.mtp
    if mtp.depth < 0 or mtp.weight < 0:
        yield f"model.mtp.depth and model.mtp.weight must be 0 or positive, got {mtp.depth} and {mtp.weight}."
    if mtp.depth <= 0:
        return
    if mtp.depth >= m.seq_len:
        yield (f"model.mtp.depth={mtp.depth} predicts tokens past the model.seq_len={m.seq_len} positions of a row; "
               f"it must be less than model.seq_len.")
    clash = {"data.packing": cfg.data.packing != "none", "train.objective": not objective_of(cfg).plain,
             "mesh.context": sizes["context"] > 1}
    for key, clashes in clash.items():
        if clashes:
            yield (f"model.mtp trains on whole rows of next tokens (train.objective=sft, data.packing=none, "
                   f"mesh.context=1) for now, but {key} is set otherwise.")
    stages = sizes["stage"]
    per_stage = m.n_layers // max(stages, 1)
    if stages > 1 and mtp.depth > per_stage:
        yield (f"model.mtp.depth={mtp.depth} adds more blocks to the last pipeline stage than the {per_stage} "
               f"layers each stage holds; use at most {per_stage} or fewer stages.")
