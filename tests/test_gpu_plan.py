"""`jaxpar plan --target h100`: XLA:GPU's program of the training step, compiled on this CPU-only machine.

The compiling tests need the CUDA plugin (the optional extra jaxpar[gpu-plan]), which the test venv does
not have: they run the CLI in an interpreter that has it, this one or the project's `.venv-gpu-plan`
(made as docs/cli.md's "plan --target" says), and skip where there is none. Their figures are checked
against formulas of the layout, not against XLA:CPU's program. The rest runs everywhere: the reader of
XLA:GPU's asynchronous collectives, and the errors.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import SMALL_MODEL

from jaxpar.cli import main
from jaxpar.config.presets import load_config
from jaxpar.plan.collectives import collectives
from jaxpar.plan.gpu_target import PLUGIN_MODULE

ROOT = Path(__file__).resolve().parents[1]
GPU_PLAN_VENV = ROOT / ".venv-gpu-plan" / "bin" / "python"
MOE = ("model.moe.experts=8", "model.moe.router=dropless", "model.n_layers=2", "model.moe.every=2", *SMALL_MODEL,
       "mesh.data=2", "mesh.expert=4")


def _has_plugin() -> bool:
    try:
        return importlib.util.find_spec(PLUGIN_MODULE) is not None
    except ModuleNotFoundError:
        return False


def _gpu_plan_python() -> str | None:
    """An interpreter with jaxpar and the CUDA plugin: this one, else the project's .venv-gpu-plan."""
    if _has_plugin():
        return sys.executable
    return str(GPU_PLAN_VENV) if GPU_PLAN_VENV.exists() else None


needs_plugin = pytest.mark.skipif(_gpu_plan_python() is None, reason=(
    f"the CUDA plugin (jaxpar[gpu-plan]) is not importable here and {GPU_PLAN_VENV} does not exist; "
    f"docs/cli.md (plan --target) says how to make it"))


def plan_for_target(*settings: str) -> dict:
    """`jaxpar plan --target h100 ...` in the plugin's interpreter: its JSON line."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([_gpu_plan_python(), "-m", "jaxpar", "plan", "--target", "h100", *settings], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    print(done.stdout.rsplit("\n{", 1)[0])  # the report, for the test log (-s)
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_plugin
@pytest.mark.slow
def test_the_default_model_compiles_for_8_h100s_and_its_tensor_all_reduces_are_megatrons():
    """data=4 x tensor=2: per layer, Megatron's forward all-reduces the attention and MLP outputs over tensor,
    and the backward the inputs' gradients of both: each one (batch / data, seq, d_model) fp32 numbers."""
    cfg = load_config(None, ["mesh.data=4", "mesh.tensor=2"])
    plan = plan_for_target("mesh.data=4", "mesh.tensor=2")
    assert (plan["compiler"], plan["device_kind"], plan["devices"]) == ("XLA:GPU", "NVIDIA H100 80GB HBM3", 8)
    assert plan["cpu"]["compiler"] == "XLA:CPU" and plan["temp_bytes"] > 0 and plan["cpu"]["temp_bytes"] > 0
    assert plan["params_bytes"] == plan["cpu"]["params_bytes"]  # the same shardings
    activation = cfg.train.batch_size // 4 * cfg.model.seq_len * cfg.model.d_model * 4
    tensor_activations = sum(c["count"] for c in plan["collective_ops"]
                             if c["op"] == "all-reduce" and c["mesh_axes"] == ["tensor"] and c["bytes"] == activation)
    assert tensor_activations >= 4 * cfg.model.n_layers
    assert plan["collective_counts"]["all-reduce"] > 0 and plan["collectives"]["reduce-scatter"] == 0  # ZeRO-0


@needs_plugin
@pytest.mark.slow
def test_on_gpu_the_moe_dispatch_is_one_ragged_all_to_all_per_direction_of_the_routed_rows():
    """data=2 x expert=4, dropless: per MoE layer, the dispatch and the return are one ragged all-to-all each,
    and backward runs their transposes, 4 in all, each of this device's A = tokens x top_k rows; jax's
    transpose rule exchanges its offsets, mesh.expert int32, by two all-to-alls each. With
    expert_dispatch=allgather every expert device gathers all mesh.expert x tokens rows instead, forward (x)
    and backward (the return's reduce-scatter's transpose)."""
    cfg = load_config(None, list(MOE))
    tokens = cfg.train.batch_size // 8 * cfg.model.seq_len  # per device: the batch is split over data x expert
    rows, row_bytes = tokens * cfg.model.moe.top_k, cfg.model.d_model * 4
    moe_layers, shards = cfg.model.n_layers // cfg.model.moe.every, 4
    ragged = plan_for_target(*MOE, "parallel.expert_dispatch=ragged")
    gathered = plan_for_target(*MOE, "parallel.expert_dispatch=allgather")
    ops = [c for c in ragged["collective_ops"] if c["op"] == "ragged-all-to-all"]
    assert sum(c["count"] for c in ops) == 4 * moe_layers
    assert all(c["bytes"] == rows * row_bytes and c["mesh_axes"] == ["expert"] for c in ops), ops
    offsets = [c for c in ragged["collective_ops"] if c["op"] == "all-to-all"]
    assert sum(c["count"] for c in offsets) == 4 * moe_layers and all(c["bytes"] == shards * 4 for c in offsets)
    assert ragged["cpu"]["collectives"]["ragged-all-to-all"] == ragged["collectives"]["ragged-all-to-all"]
    x_rows = f"f32[{shards * tokens},{cfg.model.d_model}]"
    gathers = [c for c in gathered["collective_ops"] if c["op"] == "all-gather" and x_rows in c["shapes"]]
    assert sum(c["count"] for c in gathers) == 2 * moe_layers, gathered["collective_ops"]
    assert gathered["collectives"]["ragged-all-to-all"] == 0
    print(f"per MoE layer and direction: ragged all-to-all {rows * row_bytes:,d} bytes ({rows} routed rows), "
          f"all-gather {shards * tokens * row_bytes:,d} bytes ({shards} x {tokens} rows); per step ragged "
          f"{ragged['collectives']['ragged-all-to-all']:,d}, all-gather {gathered['collectives']['all-gather']:,d}")
    assert rows * row_bytes < shards * tokens * row_bytes


ASYNC_HLO = """\
HloModule m, entry_computation_layout={()->f32[8]{0}}

ENTRY %main () -> f32[8] {
  %p = f32[8,128]{1,0} parameter(0)
  %all-reduce-start = ((f32[8,128]{1,0}), f32[8,128]{1,0}) all-reduce-start(%p), channel_id=1, \
replica_groups=[4,2]<=[8], use_global_device_ids=true, to_apply=%add
  %all-reduce-done = f32[8,128]{1,0} all-reduce-done(%all-reduce-start)
  %reduce-scatter-start = ((f32[8,2]{1,0}, f32[8,128]{1,0}), (f32[2,2]{1,0}, f32[2,128]{1,0})) \
reduce-scatter-start(%q, %p), channel_id=2, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, to_apply=%add
  %ragged-all-to-all-start = ((f32[16,64]{1,0}, f32[64,64]{1,0:S(7)}, s64[4]{0}, s64[4]{0}, s64[4]{0}, \
/*index=5*/s64[4]{0}), f32[64,64]{1,0:S(7)}) ragged-all-to-all-start(%rows, %buffer, %a, %b, %c, %d), \
channel_id=3, replica_groups={{0,1,2,3},{4,5,6,7}}
  %rows = f32[16,64]{1,0} parameter(1)
  ROOT %collective-permute-start = (f32[8]{0}, f32[8]{0}, u32[], u32[]) collective-permute-start(%x), \
channel_id=4, source_target_pairs={{0,1},{1,0}}
}
"""


def test_an_asynchronous_collective_counts_its_result_not_its_operands():
    """XLA:GPU's `-start` ops have the shape (operands, result): each counts its result's bytes once."""
    found = {c.op: c for c in collectives(ASYNC_HLO, {"data": 2, "expert": 4})}
    assert found["all-reduce"].bytes == 8 * 128 * 4 and found["all-reduce"].shapes == ("f32[8,128]",)
    assert found["reduce-scatter"].bytes == (2 * 2 + 2 * 128) * 4
    assert found["ragged-all-to-all"].bytes == 16 * 64 * 4  # the routed rows: the operand, not the 64-row buffer
    assert found["collective-permute"].bytes == 8 * 4
    assert len(found) == 4


def test_target_without_the_cuda_plugin_exits_2_naming_the_pip_command(capsys):
    if _has_plugin():
        pytest.skip("the CUDA plugin is installed in this interpreter")
    assert main(["plan", "--target", "h100"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jaxpar: error: plan --target compiles with XLA:GPU") and "pip install" in err, err
    assert err.count("\n") == 0


@pytest.mark.parametrize(("flags", "sentence"), [
    (["--search", "--target", "h100"], "plan --search --target is not there yet"),
    (["--target", "h100", "--hardware", "cpu"], "--hardware cpu predicts XLA:CPU's step"),
])
def test_what_target_does_not_take_exits_2_with_one_sentence(flags, sentence, capsys):
    assert main(["plan", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"jaxpar: error: {sentence}") and err.count("\n") == 0, err
