"""`jaxpar plan --target h100|h200|b200`: XLA:GPU's program of the training step, compiled on this CPU-only
machine, and the reader of its GEMMs and custom calls (jaxpar.plan.gpu_gemms).

The compiling tests need the CUDA plugin (the optional extra jaxpar[gpu-plan]), which the test venv must
not have (`bash run.sh train` would find it and stop emulating CPU devices): `bash run.sh test` installs it
into `.gpu-plan/` (pip --target, once) and sets JAXPAR_GPU_PLAN=required, and these tests run the CLI in
this interpreter with PYTHONPATH=.gpu-plan. Under run.sh a missing `.gpu-plan/` fails them, saying so;
run by pytest alone, without it they skip (docs/testing.md says how to make it). Their figures are
checked against formulas of the layout (matmuls per layer, activation bytes), not against XLA:CPU's
program. The rest runs everywhere: the readers of XLA:GPU's asynchronous collectives and of its GEMMs, on
HLO text cut from real deviceless compiles (metadata and tuning fields left out), and the errors.
"""

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
from jaxpar.plan.compiled_cache import entry_path
from jaxpar.plan.gpu_gemms import kernels, table
from jaxpar.plan.gpu_target import PLUGIN_MODULE

ROOT = Path(__file__).resolve().parents[1]
GPU_PLAN = ROOT / ".gpu-plan"  # the plugin, installed apart from .venv (run.sh test does it)
REQUIRED = os.environ.get("JAXPAR_GPU_PLAN") == "required"
HAS_PLUGIN_DIR = (GPU_PLAN / PLUGIN_MODULE.replace(".", "/")).is_dir()
MOE = ("model.moe.experts=8", "model.moe.router=dropless", "model.n_layers=2", "model.moe.every=2", *SMALL_MODEL,
       "mesh.data=2", "mesh.expert=4")

needs_plugin = pytest.mark.skipif(not (HAS_PLUGIN_DIR or REQUIRED), reason=(
    f"the CUDA plugin is not in {GPU_PLAN}: `bash run.sh test` installs it there, or pip install --no-deps "
    f"--target .gpu-plan jax-cuda12-plugin==0.12.0.1 jax-cuda12-pjrt==0.12.0.1"))


def with_plugin(args: list[str]) -> subprocess.CompletedProcess:
    """This interpreter, with the plugin on PYTHONPATH and jax on the CPU, running `args`."""
    if not HAS_PLUGIN_DIR:
        pytest.fail(f"JAXPAR_GPU_PLAN=required (bash run.sh test) but {GPU_PLAN} holds no CUDA plugin; run.sh installs "
                    f"it there (delete {GPU_PLAN} and its stamp to reinstall)")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join([str(GPU_PLAN), str(ROOT)])}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def plan_for_target(*settings: str, target: str = "h100") -> dict:
    """`jaxpar plan --target TARGET ...` with the plugin: its JSON line."""
    done = with_plugin(["-m", "jaxpar", "plan", "--target", target, *settings])
    assert done.returncode == 0, done.stderr[-3000:]
    print(done.stdout.rsplit("\n{", 1)[0])  # the report, for the test log (-s)
    return json.loads(done.stdout.strip().splitlines()[-1])


def gemm_runs(plan: dict) -> int:
    return sum(g["count"] for g in plan["gemms"])


def block_matmuls(cfg) -> int:
    """Matmuls of one block's forward (dense model, dot attention, gelu MLP): q/k/v in one, the scores, the
    weighted values, the output projection, the MLP's two."""
    assert cfg.model.mlp == "gelu" and cfg.model.moe.experts == 0
    return 6


@needs_plugin
@pytest.mark.slow
def test_the_default_model_in_bf16_compiles_every_matmul_to_a_bf16_gemm_and_its_all_reduces_are_megatrons():
    """data=4 x tensor=2: each block matmul and the output layer is one GEMM forward and two backward (the
    gradients of both operands), all taking bf16; per layer, Megatron's forward all-reduces the attention and
    MLP outputs over tensor, the backward the inputs' gradients of both: each (batch / data, seq, d_model) bf16."""
    settings = ("mesh.data=4", "mesh.tensor=2", "train.precision=bf16")
    cfg = load_config(None, list(settings))
    plan = plan_for_target(*settings)
    assert (plan["compiler"], plan["device_kind"], plan["devices"], plan["hosts"]) == (
        "XLA:GPU", "NVIDIA H100 80GB HBM3", 8, 1)
    assert plan["cpu"]["compiler"] == "XLA:CPU" and plan["temp_bytes"] > 0 and plan["cpu"]["temp_bytes"] > 0
    assert plan["params_bytes"] == plan["cpu"]["params_bytes"]  # the same shardings
    assert gemm_runs(plan) == (block_matmuls(cfg) * cfg.model.n_layers + 1) * 3
    assert all(g["operands"] == ["bf16", "bf16"] and g["kind"] == "triton" for g in plan["gemms"]), plan["gemms"]
    assert sum(g["flops"] for g in plan["gemms"]) == plan["flops"]  # the GEMMs are all of the matmul FLOPs
    activation = cfg.train.batch_size // 4 * cfg.model.seq_len * cfg.model.d_model * 2
    tensor_activations = sum(c["count"] for c in plan["collective_ops"]
                             if c["op"] == "all-reduce" and c["mesh_axes"] == ["tensor"] and c["bytes"] == activation)
    assert tensor_activations >= 4 * cfg.model.n_layers
    assert plan["collective_counts"]["all-reduce"] > 0 and plan["collectives"]["reduce-scatter"] == 0  # ZeRO-0
    print(table(plan["gemms"], plan["custom_calls"]))


@needs_plugin
@pytest.mark.slow
def test_two_hosts_of_h100s_and_zero3_gradients_travel_as_reduce_scatters_on_gpu():
    """--hosts 2: 16 GPUs in two processes (XLA:CPU's plan beside it on 16 emulated devices), the data axis
    across the hosts. With ZeRO-3 XLA:GPU reduce-scatters every gradient (at least as many elements as a
    device's parameter shards; tied embeddings twice) and all-reduces only the step's scalars; XLA:CPU
    all-reduces the gradients whole and slices them."""
    settings = (*SMALL_MODEL, "model.n_layers=2", "mesh.data=-1", "parallel.zero=3", "train.precision=bf16")
    plan = plan_for_target("--hosts", "2", *settings)
    assert (plan["devices"], plan["hosts"], plan["cpu"]["devices"]) == (16, 2, 16)
    assert plan["predicted"]["communication"] > 0
    scattered = [c for c in plan["collective_ops"] if c["op"] == "reduce-scatter"]
    assert scattered and all(c["mesh_axes"] == ["data"] for c in scattered)
    elements = sum(c["count"] * n for c in scattered for n in map(shape_elements, c["shapes"]))
    assert elements >= plan["params_bytes"] // 4  # fp32 parameters: every gradient shard arrives by reduce-scatter
    assert all(c["bytes"] <= 64 for c in plan["collective_ops"] if c["op"] == "all-reduce")  # loss and counts
    assert plan["cpu"]["collectives"]["reduce-scatter"] == 0  # all-reduced whole (bf16 at least), then sliced
    assert plan["cpu"]["collectives"]["all-reduce"] >= plan["params_bytes"] // 4 * 16 * 2


def shape_elements(shape: str) -> int:
    dims = shape.split("[", 1)[1].rstrip("]")
    count = 1
    for d in filter(None, dims.split(",")):
        count *= int(d)
    return count


@needs_plugin
@pytest.mark.slow
def test_b200_compiles_with_its_own_memory_and_every_matmul_a_bf16_gemm():
    settings = (*SMALL_MODEL, "mesh.data=8", "train.precision=bf16")
    cfg = load_config(None, list(settings))
    plan = plan_for_target(*settings, target="b200")
    assert (plan["device_kind"], plan["device_memory_bytes"], plan["devices"]) == ("NVIDIA B200", 180 * 10 ** 9, 8)
    assert gemm_runs(plan) == (block_matmuls(cfg) * cfg.model.n_layers + 1) * 3
    assert all(g["operands"] == ["bf16", "bf16"] for g in plan["gemms"])
    assert 0 < plan["predicted"]["seconds"] < 1


@needs_plugin
@pytest.mark.slow
def test_search_with_a_target_compiles_every_layout_with_xla_gpu(tmp_path, monkeypatch):
    """The search's cache entries are keyed by the devices' kind: the best layout's is the H100's, and holds
    the bytes the table ranks by; the budget is the H100's 80 GB."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the subprocess's and entry_path's below
    done = with_plugin(["-m", "jaxpar", "plan", "--search", "--target", "h100", "configs/tiny_test.yaml",
                        "run.devices=4", "mesh.stage=1", "parallel.zero=0", "--top", "1", "--processes", "1",
                        "--no-progress"])
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert (result["hardware"], result["memory_budget_bytes"]) == ("h100", 80 * 10 ** 9)
    layout = load_config("configs/tiny_test.yaml", ["run.devices=4"]).replace(**result["best"])
    entry = json.loads(entry_path(layout, 4, ("gpu", "NVIDIA H100 80GB HBM3", 1)).read_text())
    assert entry["bytes_per_device"] == result["bytes_per_device"]
    assert not entry_path(layout, 4, ("cpu", "cpu", 1)).exists()  # nothing compiled on XLA:CPU


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


F8_DOTS = """
import json, jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np
from jaxpar.plan import gpu_target
from jaxpar.plan.gpu_gemms import kernels
gpu_target.use_cpu_only()
on_gpu = NamedSharding(Mesh(np.array(gpu_target.gpu_devices("h100", 1)), ("x",)), P())
dot = jax.jit(lambda a, b: jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32))
a, b = (jax.ShapeDtypeStruct(s, t, sharding=on_gpu) for s, t in (((64, 128), jnp.float8_e4m3fn),
                                                                  ((128, 256), jnp.float8_e5m2)))
for options in ({}, {"xla_gpu_enable_triton_gemm": False}):
    print(json.dumps(kernels(dot.lower(a, b).compile(options).as_text())))
"""


@needs_plugin
def test_an_f8_dot_compiles_to_an_f8_triton_gemm_or_cublaslt_f8_call():
    """e4m3fn x e5m2 with an f32 result, compiled now for an H100: Triton takes the f8 operands as they are;
    with Triton's GEMMs off, cuBLASLt's f8 call does (which needs the target's CUDA runtime version)."""
    done = with_plugin(["-c", F8_DOTS])
    assert done.returncode == 0, done.stderr[-3000:]
    triton, library = (json.loads(line) for line in done.stdout.strip().splitlines()[-2:])
    assert [(g["kind"], g["operands"], g["result"]) for g in triton["gemms"]] == [
        ("triton", ["f8e4m3fn", "f8e5m2"], "f32")]
    assert [(g["kind"], g["operands"], g["result"], g["count"]) for g in library["gemms"]] == [
        ("cublaslt", ["f8e4m3fn", "f8e5m2"], "f32", 1)]
    assert library["custom_calls"] == {"__cublas$lt$matmul$f8": 1}
    assert library["gemms"][0]["flops"] == triton["gemms"][0]["flops"] == 2 * 64 * 128 * 256


# XLA:GPU's program of a bf16 (64, 128) x (128, 256) matmul in a 3-step scan, compiled for one H100: a
# split-K Triton GEMM (4 x 32 of the 128 contracted, summed after) inside the loop body.
SCAN_GEMM = """\
HloModule jit_f, is_scheduled=true

%fused_computation.gemm_fusion_dot_computation (param_0: bf16[64,4,32], param_1: bf16[4,32,256]) -> f32[4,64,256] {
  %param_0 = bf16[64,4,32]{2,1,0} parameter(0)
  %param_1 = bf16[4,32,256]{2,1,0} parameter(1)
  ROOT %dot.1 = f32[4,64,256]{2,1,0} dot(%param_0, %param_1), lhs_batch_dims={1}, lhs_contracting_dims={2}, \
rhs_batch_dims={0}, rhs_contracting_dims={1}, backend_config={"sizes":["16"]}
}

%region_0.2 (arg_tuple.1: (s32[], bf16[64,128], bf16[3,128,256])) -> (s32[], bf16[64,128], bf16[3,128,256]) {
  %arg_tuple.1 = (s32[], bf16[64,128]{1,0}, bf16[3,128,256]{2,1,0}) parameter(0)
  %get-tuple-element.7 = bf16[64,128]{1,0} get-tuple-element(%arg_tuple.1), index=1
  %bitcast.1.0 = bf16[64,4,32]{2,1,0} bitcast(%get-tuple-element.7)
  %bitcast.2.0 = bf16[4,32,256]{2,1,0} bitcast(%fusion-done)
  %gemm_fusion_dot = f32[4,64,256]{2,1,0} fusion(%bitcast.1.0, %bitcast.2.0), kind=kCustom, \
calls=%fused_computation.gemm_fusion_dot_computation, backend_config={"operation_queue_id":"0",\
"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion","block_level_fusion_config":{"num_warps":"2"}}}
  ROOT %tuple.3 = (s32[], bf16[64,128]{1,0}, bf16[3,128,256]{2,1,0}) tuple(%get-tuple-element.7)
}

ENTRY %main.4 (x.1: bf16[64,128], ws.1: bf16[3,128,256]) -> bf16[64,128] {
  %tuple = (s32[], bf16[64,128]{1,0}, bf16[3,128,256]{2,1,0}) tuple(%copy.9, %copy.8, %ws.1)
  %while.5 = (s32[], bf16[64,128]{1,0}, bf16[3,128,256]{2,1,0}) while(%tuple), condition=%region_1.3, \
body=%region_0.2, backend_config={"known_trip_count":{"n":"3"},"known_init_step":{"init":"0","step":"1"}}
  ROOT %while.7.0 = bf16[64,128]{1,0} get-tuple-element(%while.5), index=1
}
"""

# f8e4m3fn x f8e4m3fn -> f32 with Triton's GEMMs off: cuBLASLt's f8 call, its scales (1.0) after the operands,
# its result the first element of (result, workspace); a bf16 one beside it, by cuBLAS's plain call.
CUBLAS_GEMMS = """\
HloModule jit_f, is_scheduled=true

ENTRY %main.1 (a.1: f8e4m3fn[64,128], b.1: f8e4m3fn[128,256]) -> f32[64,256] {
  %constant_1 = f32[] constant(1)
  %b.1 = f8e4m3fn[128,256]{1,0} parameter(1), sharding={mesh['x'=1], [{}, {}]}
  %a.1 = f8e4m3fn[64,128]{1,0} parameter(0), sharding={mesh['x'=1], [{}, {}]}
  %bitcast.5.0 = f8e4m3fn[128,256]{0,1} bitcast(%wrapped_transpose)
  %cublas-gemm.1 = (f32[64,256]{1,0}, s8[4194304]{0}) custom-call(%a.1, %bitcast.5.0, %constant_1, %constant_1), \
custom_call_target="__cublas$lt$matmul$f8", backend_config={"operation_queue_id":"0","gemm_backend_config":\
{"selected_algorithm":"0","alpha_real":1,"beta":0,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],\
"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]},"scale_mode":1}}
  %c.1 = bf16[64,128]{1,0} parameter(2)
  %d.1 = bf16[128,256]{1,0} parameter(3)
  %custom-call.1 = (bf16[64,256]{1,0}, s8[4194304]{0}) custom-call(%c.1, %d.1), custom_call_target="__cublas$gemm", \
backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],\
"rhs_contracting_dimensions":["0"]}}}
  %sort.1 = f32[64]{0} custom-call(%a.1), custom_call_target="__cub$DeviceRadixSort"
  ROOT %get-tuple-element.1 = f32[64,256]{1,0} get-tuple-element(%cublas-gemm.1), index=0
}
"""

# An f8 operand converted to bf16 (say a weight stored in fp8) and multiplied by a bf16 one: XLA:GPU fuses
# the conversion into the Triton GEMM, which reads f8 and multiplies bf16.
UPCAST_GEMM = """\
%fused_computation.gemm_fusion_dot_computation (param_0.1: bf16[4,32,256], param_1.1: f8e4m3fn[64,4,32]) -> \
f32[4,64,256] {
  %param_1.1 = f8e4m3fn[64,4,32]{2,1,0} parameter(1)
  %convert_element_type.2 = bf16[64,4,32]{2,1,0} convert(%param_1.1)
  %param_0.1 = bf16[4,32,256]{2,1,0} parameter(0)
  ROOT %dot.1 = f32[4,64,256]{2,1,0} dot(%convert_element_type.2, %param_0.1), lhs_batch_dims={1}, \
lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}, backend_config={"sizes":["16"]}
}

ENTRY %main.1 (a.1: f8e4m3fn[64,128], b.1: bf16[128,256]) -> bf16[64,256] {
  %b.1 = bf16[128,256]{1,0} parameter(1)
  %bitcast.2 = bf16[4,32,256]{2,1,0} bitcast(%b.1)
  %a.1 = f8e4m3fn[64,128]{1,0} parameter(0)
  %bitcast.1.0 = f8e4m3fn[64,4,32]{2,1,0} bitcast(%a.1)
  ROOT %gemm_fusion_dot = f32[4,64,256]{2,1,0} fusion(%bitcast.2, %bitcast.1.0), kind=kCustom, \
calls=%fused_computation.gemm_fusion_dot_computation, backend_config={"operation_queue_id":"0",\
"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
}
"""


def test_a_triton_gemm_in_a_loop_counts_every_trip_and_its_split_k_flops_once():
    found = kernels(SCAN_GEMM)
    assert found == {"custom_calls": {}, "gemms": [
        {"kind": "triton", "operands": ["bf16", "bf16"], "reads": ["bf16", "bf16"], "result": "f32",
         "shape": "[64,4,32] x [4,32,256] -> [4,64,256]", "flops": 3 * 2 * 64 * 128 * 256, "count": 3}]}


def test_cublas_calls_read_f8_operands_and_scales_are_not_operands():
    found = kernels(CUBLAS_GEMMS)
    assert found["custom_calls"] == {"__cub$DeviceRadixSort": 1, "__cublas$gemm": 1, "__cublas$lt$matmul$f8": 1}
    by_kind = {g["kind"]: g for g in found["gemms"]}
    assert set(by_kind) == {"cublas", "cublaslt"}  # the sort is a custom call, not a GEMM
    assert by_kind["cublaslt"] == {"kind": "cublaslt", "operands": ["f8e4m3fn", "f8e4m3fn"],
                                   "reads": ["f8e4m3fn", "f8e4m3fn"], "result": "f32",
                                   "shape": "[64,128] x [128,256] -> [64,256]", "flops": 2 * 64 * 128 * 256,
                                   "count": 1}
    assert (by_kind["cublas"]["operands"], by_kind["cublas"]["result"]) == (["bf16", "bf16"], "bf16")
    assert by_kind["cublas"]["flops"] == 2 * 64 * 128 * 256


def test_a_conversion_fused_into_a_gemm_reads_f8_and_multiplies_bf16():
    (gemm,) = kernels(UPCAST_GEMM)["gemms"]
    assert (gemm["operands"], gemm["reads"], gemm["result"]) == (["bf16", "bf16"], ["f8e4m3fn", "bf16"], "f32")
    lines = table([gemm], {}).splitlines()
    assert lines[1].split()[:8] == ["triton", "bf16", "x", "bf16", "f8e4m3fn", "x", "bf16", "f32"]
    assert lines[2] == "custom calls per step: none"


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
    assert main(["plan", "--target", "h100"]) == 2  # the test venv has no plugin (module docstring)
    err = capsys.readouterr().err.strip()
    assert err.startswith("jaxpar: error: plan --target compiles with XLA:GPU") and "pip install" in err, err
    assert err.count("\n") == 0


@pytest.mark.parametrize(("flags", "sentence"), [
    (["--target", "h100", "--hardware", "cpu"], "--hardware cpu predicts XLA:CPU's step"),
    (["--hosts", "2"], "--hosts counts the hosts of GPUs that plan --target compiles for; add --target."),
    (["--target", "h100", "--hosts", "0"], "--hosts must be 1 to 32"),
    (["--target", "b200", "--hosts", "2", "mesh.data=4", "mesh.tensor=2"],
     "plan --target compiles for 16 GPUs (2 hosts x 8), but the mesh axes (mesh.data=4, mesh.tensor=2) multiply "
     "to 8; make them multiply to 16 (or set one to -1), or change --hosts."),
    (["--target", "h100", "mesh.data=4", "mesh.tensor=4"],
     "plan --target compiles for 8 GPUs (1 host x 8), but the mesh axes (mesh.data=4, mesh.tensor=4) multiply to "
     "16; add --hosts 2."),
    (["--target", "h100", "--hosts", "2", "run.devices=8"],
     "plan --target compiles for 16 GPUs (2 hosts x 8), but run.devices=8; leave run.devices=auto."),
    (["--target", "h100", "model.attention=cudnn", "train.precision=bf16"],
     "plan --target cannot trace model.attention=cudnn here"),
    (["--search", "--target", "h100", "--hosts", "2", "run.devices=8"], "plan --target compiles for 16 GPUs"),
    (["--target", "a100"], "plan --target 'a100' is not a GPU jaxpar compiles for; choose one of h100, h200, b200."),
    (["--search", "--target", "a100"], "plan --target 'a100' is not a GPU jaxpar compiles for"),
])
def test_what_target_does_not_take_exits_2_with_one_sentence(flags, sentence, capsys):
    assert main(["plan", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"jaxpar: error: {sentence}") and err.count("\n") == 0, err


@needs_plugin
@pytest.mark.slow
def test_fp8_compiles_every_dense_block_matmul_to_a_gemm_of_f8_operands_forward_and_backward():
    """train.precision=fp8 on the default layout: the four weight matmuls of each block (q/k/v, the output
    projection, the MLP's two) are f8 GEMMs forward (e4m3 x e4m3) and both backward (the e5m2 gradient
    against an e4m3 operand); attention's two matmuls and the output layer stay bf16."""
    settings = ("mesh.data=4", "mesh.tensor=2", "train.precision=fp8")
    cfg = load_config(None, list(settings))
    plan = plan_for_target(*settings)
    f8 = {"f8e4m3fn", "f8e5m2"}
    by_operands = {}
    for g in plan["gemms"]:
        by_operands[tuple(g["operands"])] = by_operands.get(tuple(g["operands"]), 0) + g["count"]
    weight_matmuls = 4 * cfg.model.n_layers
    assert by_operands.get(("f8e4m3fn", "f8e4m3fn"), 0) == weight_matmuls, by_operands
    assert sum(n for ops, n in by_operands.items() if set(ops) == f8) == 2 * weight_matmuls, by_operands
    assert sum(n for ops, n in by_operands.items() if set(ops) <= f8) == 3 * weight_matmuls, by_operands
    assert gemm_runs(plan) == (block_matmuls(cfg) * cfg.model.n_layers + 1) * 3
    assert sum(n for ops, n in by_operands.items() if ops == ("bf16", "bf16")) == (
        (block_matmuls(cfg) - 4) * cfg.model.n_layers + 1) * 3, by_operands
    print(table(plan["gemms"], plan["custom_calls"]))
