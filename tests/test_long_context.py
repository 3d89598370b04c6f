"""Llama-style blocks and long context: grouped-query attention, SwiGLU, flash attention and
Megatron sequence parallelism train to the single-device reference's numbers, sequence
parallelism swaps the tensor all-reduces for reduce-scatters and all-gathers, flash attention
keeps the scores out of memory, and the rules table adapts to the key/value heads.

Config errors for these keys are rows of tests/test_cli_errors.py's BAD_INPUTS table."""

import pytest

from jaxpar import features
from jaxpar.config.precision import POLICIES
from jaxpar.config.presets import load_config
from jaxpar.parallel.rules import RULES, logical_to_spec
from jaxpar.plan import collectives, measure_step
from jaxpar.train.trainer import Trainer
from jaxpar.verify.run import verify

# Small enough to compile fast, valid on every layout below: 4 heads of size 8 (tensor 2 or 4
# divides them), d_ff and vocab divisible by 4, 32 positions (divisible by tensor, several flash blocks).
TINY = ("model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.d_ff=64", "model.seq_len=32",
        "train.batch_size=8")
FLASH = ("model.attention=flash", "model.flash_block_q=8", "model.flash_block_kv=16")

# Sequence parallelism on data=4 x tensor=2 runs with GQA, SwiGLU, flash attention and ZeRO-3 (MQA's one
# key/value head cannot be split over tensor=2, so MQA runs without it). With pipeline stages it is verified
# in tests/test_pipeline.py (interleaved on data=2 x tensor=2 x stage=2 with ZeRO-3).
LAYOUTS = {
    "gqa kv=2, data=2 x tensor=4 (kv replicated)": ("model.n_kv_heads=2", "mesh.data=2", "mesh.tensor=4"),
    "flash 8/16, data=8": (*FLASH, "mesh.data=8"),
    "mqa kv=1, data=4 x tensor=2": ("model.n_kv_heads=1", "mesh.data=4", "mesh.tensor=2"),
    # swiglu is verified here (and against the independent reference in test_reference.py)
    "gqa kv=2 + swiglu + flash + sequence + zero=3, data=4 x tensor=2": (
        "model.n_kv_heads=2", "model.mlp=swiglu", *FLASH, "parallel.sequence=true", "parallel.zero=3", "mesh.data=4",
        "mesh.tensor=2"),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_device(layout, session_for):
    overrides = LAYOUTS[layout]
    result = verify(session_for(*TINY, "train.steps=2", *overrides), log=lambda line: None)
    loss_tol, param_tol = POLICIES["fp32"].tolerances
    assert result["ok"], result
    assert result["loss_max_rel_err"] <= loss_tol and result["param_max_rel_err"] <= param_tol, result
    # the layout really runs what it names (the reference is always dot attention without sequence)
    assert ("sequence" in result["layout"]) == ("parallel.sequence=true" in overrides), result["layout"]
    assert ("attention=flash" in result["layout"]) == ("model.attention=flash" in overrides), result["layout"]


# ---------------------------------------------------------------- sequence parallelism's collectives

def _compiled(session):
    compiled = Trainer(session).compile_step()
    return collectives(compiled.as_text(), session.mesh_sizes), compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_sequence_parallelism_replaces_tensor_all_reduces(session_for):
    """data=2 x tensor=4: without sequence parallelism the tensor collectives in the layer loop are
    all-reduces of the residual stream; with it they are all-gathers and reduce-scatters, no
    residual-sized all-reduce is left in the loop, each device sends no more bytes over tensor,
    and the step needs fewer temporary bytes."""
    layout = (*TINY, "mesh.data=2", "mesh.tensor=4")
    plain, plain_temp = _compiled(session_for(*layout, "parallel.sequence=false"))
    session = session_for(*layout, "parallel.sequence=true")
    split, split_temp = _compiled(session)
    m = session.cfg.model
    residual_bytes = m.seq_len * m.d_model * 4 * session.cfg.train.batch_size // session.mesh_sizes["data"]

    plain_tensor = [c for c in plain if c.mesh_axes == ("tensor",) and c.in_loop]
    assert plain_tensor and {c.op for c in plain_tensor} == {"all-reduce"}
    assert any(c.bytes == residual_bytes for c in plain_tensor)

    split_tensor = [c for c in split if c.mesh_axes == ("tensor",) and c.in_loop]
    assert {"reduce-scatter", "all-gather"} <= {c.op for c in split_tensor}
    # what is left as all-reduces are the replicated norm weights' gradients, far below a residual buffer
    big = [c for c in split_tensor if c.op == "all-reduce" and c.bytes >= residual_bytes // 4]
    assert not big, big
    # in place of the all-reduces, not on top of them: for the activations each device sends no
    # more over tensor (the norm weights' small gradient all-reduces are new: each rank now sees
    # part of the sequence)
    moved = [c for c in split_tensor if c.op != "all-reduce"]
    sent = [sum(c.wire_bytes * c.count for c in found) for found in (plain_tensor, moved)]
    assert sent[1] <= sent[0], sent
    assert split_temp < plain_temp, (split_temp, plain_temp)


# ---------------------------------------------------------------- flash attention's memory

def test_flash_attention_temporaries_are_a_fraction_of_dot_attention(session_for):
    """At 1024 positions the dot scores (4 heads x 1024 x 1024 fp32 per sequence) dominate the
    step's temporaries; flash attention with 128-blocks keeps them under a fifth."""
    long = ("model.d_model=32", "model.n_layers=1", "model.n_heads=4", "model.d_ff=64", "model.seq_len=1024",
            "train.batch_size=8", "mesh.data=8", "model.flash_block_q=128", "model.flash_block_kv=128")
    dot = measure_step(Trainer(session_for(*long, "model.attention=dot")))["temp_bytes"]
    flash = measure_step(Trainer(session_for(*long, "model.attention=flash")))["temp_bytes"]
    assert flash <= 0.2 * dot, (flash, dot)


# ---------------------------------------------------------------- the rules table

def layout_rules(kv_heads: int, tensor: int, sequence: bool) -> dict:
    """The features' rules table for a model of `kv_heads` key/value heads (24 query heads) on
    mesh.tensor=`tensor`."""
    cfg = load_config(None, ["model.n_heads=24", f"model.n_kv_heads={kv_heads}",
                             f"parallel.sequence={str(sequence).lower()}"])
    sizes = {"data": 1, "tensor": tensor, "expert": 1, "stage": 1, "context": 1}
    return features.layout_rules(RULES, cfg, sizes)


def test_layout_rules_replicate_kv_heads_and_split_the_residual_sequence():
    assert layout_rules(kv_heads=8, tensor=4, sequence=False) == RULES
    assert layout_rules(kv_heads=4, tensor=4, sequence=False)["kv_heads"] == "tensor"
    for kv_heads, tensor in ((2, 4), (1, 2), (3, 2), (6, 4)):  # fewer than, or not a multiple of, tensor
        rules = layout_rules(kv_heads, tensor, sequence=False)
        assert rules["kv_heads"] is None and rules["heads"] == "tensor", (kv_heads, tensor)
    assert layout_rules(kv_heads=4, tensor=2, sequence=False)["residual_seq"] is None
    with_sequence = layout_rules(kv_heads=4, tensor=2, sequence=True)
    assert with_sequence["residual_seq"] == "tensor"
    assert {k: v for k, v in with_sequence.items() if k != "residual_seq"} == {
        k: v for k, v in RULES.items() if k != "residual_seq"}
    residual = ("batch", "residual_seq", "embed")
    assert tuple(logical_to_spec(residual, with_sequence)) == (("data", "expert"), "tensor", None)
    assert tuple(logical_to_spec(residual, layout_rules(4, 2, False))) == (("data", "expert"), None, None)
    assert RULES["residual_seq"] is None and RULES["kv_heads"] == "tensor", "the table itself is not changed"
