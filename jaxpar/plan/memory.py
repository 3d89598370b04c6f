"""What one device holds and moves per training step, read from the compiled program.

`memory_analysis()` gives argument/output/temporary bytes per device; the state's own
shardings split the arguments into parameters and optimizer state; the gradient layout
gives the gradient bytes a device holds after reduction; the HLO text gives the matmul
FLOPs (loop trip counts multiplied in, unlike `cost_analysis()`, which counts a loop body
once) and the collectives.
"""

from __future__ import annotations

import math

import jax

from jaxpar.errors import UserError
from jaxpar.model.adapters import trainable
from jaxpar.parallel.context import blocks_per_rank
from jaxpar.parallel.pipeline import TICK_SCOPE, branch_counts, compiled_branches
from jaxpar.plan.collectives import bytes_by_op, collectives
from jaxpar.plan.decode_cache import format_decode_cache
from jaxpar.plan.gpu_gemms import kernels
from jaxpar.plan.hlo import executed_cost, matmul_flops, parse, written_bytes
from jaxpar.plan.transfers import host_transfers
from jaxpar.train.offload import update_peak_bytes


def shard_bytes(abstract_tree, shardings) -> int:
    """Bytes of one device's shards of every leaf (first device of the mesh)."""
    total = 0
    for leaf, sharding in zip(jax.tree.leaves(abstract_tree), jax.tree.leaves(shardings)):
        total += math.prod(sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
    return total


def _memory_split(trainer, state, params: int, opt_state: int, temp: int, moved: dict) -> dict:
    """Device and host bytes per category. Offloaded activations are the layer inputs moved to the
    host in one step (all held until backward); the device's activations are XLA's temporaries,
    which on XLA:CPU (one memory) still count the offloaded ones. An offloaded optimizer state
    is on the device only during the update: opt_state_update_peak of it at once."""
    offloaded = trainer.cfg.train.offloads_optimizer
    peak = (update_peak_bytes(state.opt_state, trainer.state_shardings.opt_state, trainer.optimizer.by_layer)
            if offloaded else opt_state)
    return {"device_bytes": {"params": params, "opt_state": 0 if offloaded else opt_state, "activations": temp,
                             "opt_state_update_peak": peak},
            "host_bytes": {"params": 0, "opt_state": opt_state if offloaded else 0,
                           "activations": moved["activations"]["to_host"]}}


# A plan reads the program's HLO and buffer sizes, never runs it: on the CPU, machine code
# optimization (LLVM) can be skipped. It changes neither (checked on plain and pipeline layouts)
# and takes a third to a half off the compile time.
# On a GPU, what jaxpar.runtime.devices sets there (GPU_XLA_FLAGS): the latency-hiding scheduler.
PLAN_COMPILER_OPTIONS = {"cpu": {"xla_backend_optimization_level": 0},
                         "gpu": {"xla_gpu_enable_latency_hiding_scheduler": True}}


def measure_step(trainer) -> dict:
    """Per-device memory by category, FLOPs, collective bytes and host transfers of one compiled train step."""
    platform = trainer.mesh.devices.flat[0].platform
    compiled = trainer.compile_step(PLAN_COMPILER_OPTIONS.get(platform))
    stats = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}  # XLA:GPU compiled without a GPU: None
    state = trainer.abstract_state()
    shardings = trainer.state_shardings
    trained = trainable(state.params)  # a frozen weight (model.lora) has no gradient
    grad_shardings = trainer.layout.named(trainer.layout.grad_specs(trained))
    module = parse(compiled.as_text())
    moved = host_transfers(trainer, state, trainer.abstract_batch())
    params_bytes = shard_bytes(state.params, shardings.params)
    opt_bytes = shard_bytes(state.opt_state, shardings.opt_state)
    found = collectives(module, trainer.layout.sizes)
    flops = matmul_flops(module)
    per_stage, written = [flops], [written_bytes(module)]
    if trainer.pipeline.table is not None:
        table = trainer.pipeline.table
        taken, kinds = branch_counts(table).tolist(), compiled_branches(table)
        per_stage = executed_cost(module, TICK_SCOPE, kinds, taken, matmul_flops)
        written = executed_cost(module, TICK_SCOPE, kinds, taken, written_bytes)
    return {
        "argument_bytes": int(stats.argument_size_in_bytes),
        "output_bytes": int(stats.output_size_in_bytes),
        "alias_bytes": int(stats.alias_size_in_bytes),
        "temp_bytes": int(stats.temp_size_in_bytes),
        "params_bytes": params_bytes,
        "opt_state_bytes": opt_bytes,
        **_memory_split(trainer, state, params_bytes, opt_bytes, int(stats.temp_size_in_bytes), moved),
        "host_transfer_bytes": moved,
        "grads_bytes": shard_bytes(trained, grad_shardings),
        # matmul FLOPs per step with loop trip counts; XLA's figure counts each loop body once.
        # Every branch of a conditional counts each time it runs (an upper bound for pipelines);
        # executed_flops counts each pipeline branch as often as the schedule takes it, per stage
        # and as the mean over devices.
        "flops": flops,
        "executed_flops": sum(per_stage) / len(per_stage),
        "executed_flops_per_stage": per_stage,
        "xla_cost_flops": float(cost.get("flops", 0.0)),
        # bytes the non-matmul work writes per step (hlo.written_bytes), per stage like executed_flops
        "written_bytes_per_stage": written,
        "collectives": bytes_by_op(found),
        # what each device sends per step (ring algorithms): reduce-scatter + all-gather = all-reduce
        "collective_wire_bytes": bytes_by_op(found, wire=True),
        "collective_ops": [
            {"op": c.op, "mesh_axes": list(c.mesh_axes), "bytes": c.bytes, "wire_bytes": c.wire_bytes,
             "count": c.count, "shapes": list(c.shapes)} for c in found],
        **_context_split(trainer),
        **(kernels(module) if platform == "gpu" else {}),  # how XLA:GPU compiled the matmuls: gemms, custom_calls
    }


def gpipe_beside_naive(trainer, trainer_for) -> dict:
    """For a naive layout (one batch through the stages): GPipe's temporaries on the same mesh with
    M = mesh.stage microbatches, compiled from that variant of the config by trainer_for(cfg) (temp_bytes
    None, and why, where that variant is not valid); {} for any other layout."""
    table = trainer.pipeline.table
    if table is None or table.schedule != "naive":
        return {}
    M = table.stages
    try:
        gpipe = trainer_for(trainer.cfg.replace(**{"parallel.pipeline.schedule": "gpipe",
                                                   "parallel.pipeline.microbatches": M}))
    except UserError as e:
        return {"gpipe_beside": {"microbatches": M, "temp_bytes": None, "why": str(e)}}
    compiled = gpipe.compile_step(PLAN_COMPILER_OPTIONS.get(gpipe.mesh.devices.flat[0].platform))
    return {"gpipe_beside": {"microbatches": M, "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes)}}


def _context_split(trainer) -> dict:
    """With mesh.context > 1: the block pairs of attention each context rank computes per sequence, as
    the schedule runs them (jaxpar.parallel.context), and their max / mean: a windowed layer's when every
    layer is windowed, else a global layer's (the most any layer computes)."""
    layout, model = trainer.layout, trainer.cfg.model
    if layout.context == 1:
        return {}
    window = model.window if all(model.layer_is_local(j) for j in range(model.unit_blocks)) else 0
    blocks = blocks_per_rank(model.seq_len, layout.context, layout.balanced_context, model.flash_blocks(), window)
    return {"context": {"attention": layout.context_attention, "balanced": layout.balanced_context,
                        "blocks_per_rank": blocks, "max_over_mean": max(blocks) / (sum(blocks) / len(blocks))}}


def format_report(plan: dict) -> str:
    """A per-device table of memory by category and of collectives, for the terminal."""
    mib = 2 ** 20
    rows = [("parameters", plan["params_bytes"]), ("optimizer state", plan["opt_state_bytes"]),
            ("gradients (after reduction)", plan["grads_bytes"]), ("temporaries / activations", plan["temp_bytes"]),
            ("arguments (state + batch)", plan["argument_bytes"]), ("outputs", plan["output_bytes"]),
            ("total (arguments + temporaries)", plan["argument_bytes"] + plan["temp_bytes"])]
    beside = plan.get("gpipe_beside", {})
    if beside.get("temp_bytes") is not None:  # a naive layout, beside GPipe's temporaries on its mesh
        rows.insert(4, (f"  gpipe M={beside['microbatches']}: temporaries", beside["temp_bytes"]))
    lines = [f"{'per device':<32}{'bytes':>18}{'MiB':>12}"]
    lines += [f"{name:<32}{value:>18,d}{value / mib:>12.2f}" for name, value in rows]
    if "decode_cache" in plan:  # what generation would cache (jaxpar.plan.decode_cache)
        lines += format_decode_cache(plan["decode_cache"])
    if any(plan["host_bytes"].values()):
        lines.append(f"{'offload':<32}{'device bytes':>18}{'host bytes':>18}")
        for key, name in (("params", "parameters"), ("opt_state", "optimizer state"), ("activations", "activations")):
            lines.append(f"  {name:<30}{plan['device_bytes'][key]:>18,d}{plan['host_bytes'][key]:>18,d}")
        lines.append(f"  {'optimizer state in the update':<30}{plan['device_bytes']['opt_state_update_peak']:>18,d}"
                     f"   (on the device at once)")
        for kind, moved in plan["host_transfer_bytes"].items():
            lines.append(f"  {kind + ' moved per step':<30}{moved['to_device']:>18,d}{moved['to_host']:>18,d}"
                         f"   (to device, to host)")
        lines.append("  (on XLA:CPU, one memory, the temporaries still count offloaded activations)")
    lines.append(f"{'matmul FLOPs per step':<32}{plan['flops']:>18.4g}")
    if len(plan["executed_flops_per_stage"]) > 1:
        lines.append(f"{'  executed (mean of devices)':<32}{plan['executed_flops']:>18.4g}")
        for stage, flops in enumerate(plan["executed_flops_per_stage"]):
            lines.append(f"{f'  executed by stage {stage}':<32}{flops:>18.4g}")
    if "context" in plan:
        c = plan["context"]
        lines.append(f"{'context attention':<32}{c['attention']}, {'balanced' if c['balanced'] else 'unbalanced'}: "
                     f"block pairs per rank max / mean {c['max_over_mean']:.2f} "
                     f"({min(c['blocks_per_rank']):,d} to {max(c['blocks_per_rank']):,d})")
    lines.append("")
    lines.append(f"{'collective':<20}{'mesh axes':<14}{'count':>6}{'bytes/step':>20}{'sent bytes/step':>20}")
    for c in plan["collective_ops"]:
        axes = ",".join(c["mesh_axes"]) or "-"
        lines.append(f"{c['op']:<20}{axes:<14}{c['count']:>6d}{c['bytes'] * c['count']:>20,d}"
                     f"{c['wire_bytes'] * c['count']:>20,d}")
    if plan["collective_ops"]:
        sent = sum(plan["collective_wire_bytes"].values())
        lines.append(f"{'total':<40}{sum(plan['collectives'].values()):>20,d}{sent:>20,d}")
        lines.append("(bytes: each result's size; sent: what each device sends with ring algorithms)")
        if plan["collectives"].get("ragged-all-to-all"):
            lines.append("(ragged-all-to-all: the rows each device routes, as the op moves them; XLA:CPU emulates it "
                         "with mesh.expert x as many, padded)")
    else:
        lines.append("(none)")
    return "\n".join(lines)
