"""Random layouts over the whole switch space: every draw verifies against one device, or is refused in
one sentence before anything compiles. The draws are seeded, so CI and every machine run the same ones;
which CPU runs them must not change the verdict (routing near-ties are replayed, not rounded away)."""

import numpy as np
import pytest
from helpers import SMALL_MODEL

from jaxpar.config.presets import load_config
from jaxpar.errors import ConfigError
from jaxpar.session import prepare
from jaxpar.train.verify import verify

DRAWS = 6
MESHES = [  # (data, tensor, expert, stage, context) over 8 devices
    (8, 1, 1, 1, 1), (4, 2, 1, 1, 1), (2, 2, 2, 1, 1), (4, 1, 2, 1, 1), (2, 1, 1, 1, 4), (1, 2, 1, 1, 4),
    (2, 1, 1, 4, 1), (2, 2, 1, 2, 1), (2, 1, 2, 2, 1), (1, 4, 2, 1, 1), (2, 1, 2, 1, 2),
]
CHOICES = {
    "parallel.zero": ["0", "1", "2", "3"],
    "parallel.pipeline.schedule": ["gpipe", "1f1b", "zb-h1", "2bw", "naive"],
    "parallel.context_attention": ["ring", "allgather"],
    "parallel.grad_reduce_dtype": ["fp32", "bf16"],
    "train.precision": ["fp32", "fp32", "bf16"],
    "train.grad_accum": ["1", "2"],
    "train.loss_chunks": ["1", "2"],
    "data.packing": ["none", "pack"],
    "model.attention": ["dot", "flash"],
    "model.n_kv_heads": ["0", "2"],
}
# adapters on every default target, the base frozen (drawn apart, so the other switches' draws stay as they were)
ADAPTERS = {"model.lora.rank": ["4", "8"], "model.lora.base_dtype": ["fp32", "nf4"], "model.lora.dropout": ["0", "0.1"]}
# the architectures of 2026 (drawn apart too): windowed layers with sinks, and dropless experts' dispatch
VARIANTS = {"model.window": ["0", "12"], "model.sinks": ["false", "true"]}
# the numerics of issue 50 (drawn apart too): fp8 GEMMs over the drawn precision, and Muon
NUMERICS = {"train.precision": ["keep", "keep", "fp8"], "train.optimizer": ["adamw", "adamw", "muon"]}
EXPERTS = {  # a mixture of experts in most draws
    "model.moe.router": ["topk", "switch", "expert_choice", "dropless"],
    "model.moe.shared": ["0", "1"],
    "model.moe.mlp": ["gelu", "swiglu"],
}


def draw(index: int) -> list[str]:
    """The overrides of draw `index`: a mesh, a value of every switch, and mostly an MoE model."""
    rng = np.random.default_rng(1000 + index)
    data, tensor, expert, stage, context = MESHES[rng.integers(len(MESHES))]
    overrides = [f"mesh.data={data}", f"mesh.tensor={tensor}", f"mesh.expert={expert}", f"mesh.stage={stage}",
                 f"mesh.context={context}", "parallel.context_balance=false", "model.n_layers=4", "model.n_heads=4",
                 "train.batch_size=16", "train.steps=2", *SMALL_MODEL]
    overrides += [f"{key}={values[rng.integers(len(values))]}" for key, values in CHOICES.items()]
    if "parallel.pipeline.schedule=naive" in overrides:  # one batch, no microbatches
        overrides.append("parallel.pipeline.microbatches=1")
    if expert > 1 or rng.random() < 0.7:
        overrides += ["model.moe.experts=4", "model.moe.every=1"]
        overrides += [f"{key}={values[rng.integers(len(values))]}" for key, values in EXPERTS.items()]
        if "model.moe.router=dropless" in overrides or "model.moe.router=topk" in overrides:
            overrides.append(f"model.moe.balance={['aux', 'bias'][rng.integers(2)]}")
    adapters = np.random.default_rng(2000 + index)
    if adapters.random() < 0.5:
        overrides += [f"{key}={values[adapters.integers(len(values))]}" for key, values in ADAPTERS.items()]
    variants = np.random.default_rng(3000 + index)
    overrides += [f"{key}={values[variants.integers(len(values))]}" for key, values in VARIANTS.items()]
    if "model.window=12" in overrides:
        overrides.append("model.attention_pattern=lg")
    if "model.moe.router=dropless" in overrides and expert > 1:
        overrides.append(f"parallel.expert_dispatch={['allgather', 'ragged'][variants.integers(2)]}")
    numerics = np.random.default_rng(4000 + index)
    for key, values in NUMERICS.items():
        value = values[numerics.integers(len(values))]
        overrides += [] if value == "keep" else [f"{key}={value}"]
    return overrides


@pytest.mark.slow
@pytest.mark.parametrize("index", range(DRAWS))
def test_a_random_layout_verifies_or_is_refused_in_one_sentence(index, tmp_path):
    check_draw(draw(index), tmp_path)


def check_draw(overrides: list[str], tmp_path) -> None:
    """One draw verifies against one device, or is refused in one sentence."""
    try:
        session = prepare(load_config(None, [f"run.dir={tmp_path / 'run'}", *overrides]))
    except ConfigError as refusal:
        sentence = str(refusal)
        assert "\n" not in sentence and sentence.rstrip().endswith("."), sentence
        return
    result = verify(session, log=lambda line: None)
    assert result["ok"], (overrides, result)
