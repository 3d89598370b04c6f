"""Random layouts over the whole switch space: every draw verifies against one device, or is refused in
one sentence before anything compiles. The draws are seeded, so CI and every machine run the same ones;
which CPU runs them must not change the verdict (routing near-ties are replayed, not rounded away). A refusal
verifies nothing, so the suite's draws are checked to verify at least MIN_VERIFIED layouts, half of them in
fp32, each with at least 3 updates; benchmarks/verify_sweep.py runs 100 draws and counts the refusals."""

import json

import numpy as np
import pytest
from helpers import SMALL_MODEL

from jaxpar.config.presets import load_config
from jaxpar.errors import ConfigError
from jaxpar.tokenize.document_readers import DocumentSpec
from jaxpar.tokenize.folder import tokenize
from jaxpar.train.run_session import prepare
from jaxpar.verify.run import verify

# The suite's draws: seeds whose layouts are four in fp32, one in bf16 and one in fp8, an MoE in three, LoRA in
# three, DPO and ORPO (test_the_suites_draws_verify_enough_layouts_half_in_fp32 keeps them verifying as the
# draw changes).
DRAWS = (0, 3, 6, 7, 10, 11)
MIN_VERIFIED = 4
STEPS = 3  # each draw's updates, every one followed by a compared loss but the last, which the weights show
MESHES = [  # (data, tensor, expert, stage, context) over 8 devices
    (8, 1, 1, 1, 1), (4, 2, 1, 1, 1), (2, 2, 2, 1, 1), (4, 1, 2, 1, 1), (2, 1, 1, 1, 4), (1, 2, 1, 1, 4),
    (2, 1, 1, 4, 1), (2, 2, 1, 2, 1), (2, 1, 2, 2, 1), (1, 4, 2, 1, 1), (2, 1, 2, 1, 2),
]
CHOICES = {
    "parallel.zero": ["0", "1", "2", "3"],
    "parallel.pipeline.schedule": ["gpipe", "1f1b", "zb-h1", "2bw", "naive"],
    "parallel.context_attention": ["ring", "allgather"],
    "parallel.grad_reduce_dtype": ["fp32", "bf16"],
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
# the numerics (drawn apart too): half the draws in fp32, and Muon
NUMERICS = {"train.precision": ["fp32", "fp32", "bf16", "fp8"], "train.optimizer": ["adamw", "adamw", "muon"]}
# the attention and heads of DeepSeek-V3 (drawn apart too): latent attention, multi-token prediction
HEADS = {"model.mla.kv_rank": ["0", "0", "16"], "model.mtp.depth": ["0", "0", "1"]}
MLA = ("model.mla.q_rank=12", "model.mla.rope_dim=4", "model.mla.nope_dim=8", "model.mla.v_dim=6")
# what training minimizes (drawn apart too): mostly next-token prediction; preference pairs from the folder
# `preference_folder` writes, GRPO on prompts with a length reward
OBJECTIVES = ["sft", "sft", "sft", "sft", "dpo", "simpo", "orpo", "grpo"]
PREFERENCE_VOCAB = 300
EXPERTS = {  # a mixture of experts in most draws
    "model.moe.router": ["topk", "switch", "expert_choice", "dropless"],
    "model.moe.shared": ["0", "1"],
    "model.moe.mlp": ["gelu", "swiglu"],
}


def draw(index: int) -> list[str]:
    """The overrides of draw `index`: a mesh, a value of every switch, and mostly an MoE model; then the
    documented limits applied (`_within_limits`), so that most draws verify and the rest test a refusal."""
    rng = np.random.default_rng(1000 + index)
    data, tensor, expert, stage, context = MESHES[rng.integers(len(MESHES))]
    drawn = {"mesh.data": data, "mesh.tensor": tensor, "mesh.expert": expert, "mesh.stage": stage,
             "mesh.context": context, "parallel.context_balance": "false", "model.n_layers": 4, "model.n_heads": 4,
             "train.batch_size": 16, "train.steps": STEPS}
    drawn.update({key: values[rng.integers(len(values))] for key, values in CHOICES.items()})
    if drawn["parallel.pipeline.schedule"] == "naive":  # one batch, no microbatches
        drawn["parallel.pipeline.microbatches"] = 1
    if expert > 1 or rng.random() < 0.7:
        drawn.update({"model.moe.experts": 4, "model.moe.every": 1})
        drawn.update({key: values[rng.integers(len(values))] for key, values in EXPERTS.items()})
        if drawn["model.moe.router"] in ("dropless", "topk"):
            drawn["model.moe.balance"] = ["aux", "bias"][rng.integers(2)]
    adapters = np.random.default_rng(2000 + index)
    if adapters.random() < 0.5:
        drawn.update({key: values[adapters.integers(len(values))] for key, values in ADAPTERS.items()})
    variants = np.random.default_rng(3000 + index)
    drawn.update({key: values[variants.integers(len(values))] for key, values in VARIANTS.items()})
    if drawn["model.window"] == "12":
        drawn["model.attention_pattern"] = "lg"
    if drawn.get("model.moe.router") == "dropless" and expert > 1:
        drawn["parallel.expert_dispatch"] = ["allgather", "ragged"][variants.integers(2)]
    numerics = np.random.default_rng(4000 + index)
    drawn.update({key: values[numerics.integers(len(values))] for key, values in NUMERICS.items()})
    heads = np.random.default_rng(5000 + index)
    drawn.update({key: values[heads.integers(len(values))] for key, values in HEADS.items()})
    drawn["train.objective"] = OBJECTIVES[np.random.default_rng(6000 + index).integers(len(OBJECTIVES))]
    _within_limits(drawn)
    if drawn["model.mla.kv_rank"] != "0":
        drawn.update(dict(item.split("=") for item in MLA))
    if drawn["train.objective"] in ("dpo", "simpo", "orpo"):
        drawn.update({"data.source": "{preference}", "data.packing": "pack", "model.vocab_size": PREFERENCE_VOCAB})
    elif drawn["train.objective"] == "grpo":
        drawn.update({"data.source": "{prompts}", "rl.max_new_tokens": 8, "rl.reward": "length",
                      "rl.target_length": 5})
    return [*SMALL_MODEL, *(f"{key}={value}" for key, value in drawn.items())]


def _within_limits(drawn: dict) -> None:
    """Give way where two drawn switches are documented not to combine (each refusal is a sentence of
    jaxpar.features), the later-drawn switch yielding, so most draws verify."""
    pipelined, split_sequence = drawn["mesh.stage"] > 1, drawn["mesh.context"] > 1
    if pipelined:
        drawn["train.grad_accum"] = "1"  # stages take microbatches instead
    if drawn["train.objective"] == "dpo":  # the reference is the base without adapters
        drawn.update({"model.lora.rank": "4", "model.lora.base_dtype": "fp32", "model.lora.dropout": "0"})
    if "model.lora.rank" in drawn and "model.moe.experts" in drawn:
        drawn["model.lora.dropout"] = "0"  # experts' adapters are merged
    if "model.lora.rank" in drawn:
        drawn["train.optimizer"] = "adamw"  # Muon orthogonalises whole matrices
        drawn["model.mla.kv_rank"] = "0"  # no adapters on latent attention yet
        if drawn.get("model.moe.balance") == "bias":
            drawn["model.moe.balance"] = "aux"  # the router is frozen: no bias to move
        if drawn["parallel.pipeline.schedule"] == "zb-h1":
            drawn["parallel.pipeline.schedule"] = "1f1b"  # adapters' split backward is not built
    if drawn["model.mla.kv_rank"] != "0":
        drawn.update({"model.n_kv_heads": "0", "model.window": "0", "model.sinks": "false"})
        drawn.pop("model.attention_pattern", None)
    objective = drawn["train.objective"]
    if objective == "grpo" and (pipelined or split_sequence):
        drawn["train.objective"] = objective = "sft"  # generation runs without stages or context
    if objective == "grpo":
        drawn["data.packing"] = "none"  # rows are built from prompts and completions
    if drawn["model.mtp.depth"] != "0" and (objective != "sft" or split_sequence):
        drawn["model.mtp.depth"] = "0"  # it trains on whole rows of next tokens
    if drawn["model.mtp.depth"] != "0":
        drawn["data.packing"] = "none"


def data_folders(root) -> dict[str, str]:
    """{'preference': a tokenized folder of 24 preference pairs, 'prompts': a JSONL of 24 GRPO prompts} under
    `root`, for the draws' data.source."""
    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdefghij"), int(rng.integers(3, 8)))) for _ in range(72)]
    pairs = root / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"key {words[i]} ->", "chosen": f" {words[24 + i]}.",
                                         "rejected": f" {words[48 + i]}!"}) + "\n" for i in range(24)))
    tokenize([str(pairs)], str(root / "preference"), vocab_size=PREFERENCE_VOCAB, progress=False,
             spec=DocumentSpec(preference=True, prompt="prompt", chosen="chosen", rejected="rejected"))
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"item {i} costs ", "answer": str(i)}) + "\n" for i in range(24)))
    return {"preference": str(root / "preference"), "prompts": str(prompts)}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return data_folders(tmp_path_factory.mktemp("sweep-data"))


def settle(overrides: list[str], folders: dict[str, str]) -> list[str]:
    """A draw's overrides with its data folders filled in."""
    return [item.format(**folders) for item in overrides]


def refusal(overrides: list[str], run_dir) -> str | None:
    """The sentence that refuses a draw before anything compiles, or None where it is accepted."""
    try:
        prepare(load_config(None, [f"run.dir={run_dir}", *overrides]))
    except ConfigError as refused:
        return str(refused)
    return None


def test_the_suites_draws_verify_enough_layouts_half_in_fp32(folders, tmp_path):
    accepted = [draw(i) for i in DRAWS if refusal(settle(draw(i), folders), tmp_path / "run") is None]
    in_fp32 = [d for d in accepted if "train.precision=fp32" in d]
    assert len(accepted) >= MIN_VERIFIED and 2 * len(in_fp32) >= len(accepted), accepted


@pytest.mark.slow
@pytest.mark.parametrize("index", DRAWS)
def test_a_random_layout_verifies_or_is_refused_in_one_sentence(index, folders, tmp_path):
    check_draw(settle(draw(index), folders), tmp_path)


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
