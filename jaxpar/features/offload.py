"""Host offload (train.offload): the optimizer state, or each layer's input activations, kept in the
host's pinned memory and brought to the device when a step needs them."""

from __future__ import annotations

from jaxpar.config import Config
from jaxpar.features.feature import Checks, Switch, unless

SWITCHES = (
    Switch("train.offload", unless("none", "offload={value}"), reference="none", with_local_sgd=False),
)


def checks(cfg: Config, sizes: dict[str, int]) -> Checks:
    t = cfg.train
    if t.offloads_activations and t.remat == "sqrt":
        yield ("train.offload=activations offloads each layer's input, but train.remat=sqrt keeps segment "
               "inputs instead; use train.remat none, full or dots with it.")
    if t.offloads_activations and sizes["stage"] > 1:
        yield ("train.offload=activations does not combine with mesh.stage > 1 yet (a pipeline keeps its "
               "microbatches' activations itself; see parallel.pipeline.recompute); use "
               "train.offload=optimizer there.")
