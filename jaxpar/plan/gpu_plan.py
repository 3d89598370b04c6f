"""`jaxpar plan --target h100|h200|b200 [--hosts N]`: the training step compiled twice, here, from the same
abstract state: by XLA:CPU on emulated devices (the plan without --target) and by XLA:GPU for N hosts of the
target's GPUs (jaxpar.plan.gpu_target), without a GPU. It prints the GPU program's report, both compilers'
memory and collectives side by side, and how XLA:GPU compiled the matmuls (jaxpar.plan.gpu_gemms); its JSON
line holds the GPU plan's figures (with `gemms` and `custom_calls`), the CPU's under `cpu`. With --search
(`search_devices`), the layout search compiles every candidate for the target instead of XLA:CPU.

The two programs differ where the compilers do: XLA:GPU fuses (fewer, larger temporaries), combines
collectives and runs them asynchronously, writes a data-sharded reduction as a reduce-scatter, and runs
jax.lax.ragged_all_to_all itself where XLA:CPU runs jaxpar's emulation (jaxpar.parallel.ragged).
`model.attention=auto` resolves as on the CPU (flash or dot): jax is kept on the CPU, and cuDNN's kernel
cannot be traced without the cuDNN library (jax asks it for its version), so `cudnn` is refused.
"""

from __future__ import annotations

import json

from jaxpar.config import Config, ConfigError
from jaxpar.plan import gpu_gemms, gpu_target
from jaxpar.plan.memory import format_report
from jaxpar.plan.step_plan import plan_of, predicted
from jaxpar.runtime import distributed
from jaxpar.runtime.devices import requested_devices, setup_devices
from jaxpar.session import on_devices
from jaxpar.train.trainer import Trainer

COMPARED = ("argument_bytes", "output_bytes", "temp_bytes", "params_bytes", "opt_state_bytes", "grads_bytes",
            "flops", "collectives", "collective_wire_bytes", "collective_counts")
MEMORY_ROWS = (("parameters", "params_bytes"), ("optimizer state", "opt_state_bytes"),
               ("gradients (after reduction)", "grads_bytes"), ("temporaries / activations", "temp_bytes"),
               ("arguments (state + batch)", "argument_bytes"), ("outputs", "output_bytes"))


def counted_plan(session) -> tuple[dict, Trainer]:
    """`jaxpar plan`'s figures of a session's step (jaxpar.plan.step_plan) with each kind of collective's
    executions per step (`collective_counts`), and the trainer it compiled."""
    plan, trainer = plan_of(session)
    plan["collective_counts"] = {op: 0 for op in plan["collectives"]}
    for c in plan["collective_ops"]:
        plan["collective_counts"][c["op"]] += c["count"]
    return plan, trainer


def prepared(cfg: Config, target: str, hosts: int, hardware: str | None, search: bool = False) -> Config:
    """cfg checked for plan --target on `hosts` hosts of `target` (ConfigError before anything compiles; a
    search's mesh is its own), with run.devices set to their GPUs when there are several; jax is kept on the
    CPU from here on."""
    gpu_target.check_target(target)
    if distributed.from_environment() is not None:
        raise ConfigError("plan --target compiles in one process; run it outside jaxpar launch.")
    if hardware == "cpu":
        raise ConfigError("--hardware cpu predicts XLA:CPU's step; with --target, name a GPU's profile or none (the "
                          "target's own).")
    if cfg.model.attention == "cudnn":
        raise ConfigError("plan --target cannot trace model.attention=cudnn here: jax asks the cuDNN library, which "
                          "this machine lacks, for its version while tracing; plan model.attention=flash instead.")
    count = gpu_target.devices_for(cfg, hosts, mesh=not search)
    gpu_target.check_plugin()
    gpu_target.use_cpu_only()
    return cfg if count is None else cfg.replace(**{"run.devices": count})


def search_devices(cfg: Config, target: str, hosts: int, hardware: str | None) -> tuple[Config, list, float]:
    """(cfg, the target's GPUs, the memory budget: one GPU's memory) for plan --search --target."""
    cfg = prepared(cfg, target, hosts, hardware, search=True)
    count = requested_devices(cfg) or gpu_target.DEVICES_PER_HOST
    return cfg, gpu_target.gpu_devices(target, count, hosts), gpu_target.TARGETS[target].memory_bytes


def plan_on_target(cfg: Config, target: str, hosts: int = 1, hardware: str | None = None) -> int:
    """Compile cfg's step with XLA:CPU and with XLA:GPU for `hosts` hosts of `target`, print both; exit 0."""
    cfg = prepared(cfg, target, hosts, hardware)
    cpu_session = on_devices(cfg, setup_devices(cfg))  # shapes only: no data is read
    gpus = gpu_target.gpu_devices(target, len(cpu_session.devices), hosts)
    gpu_session = on_devices(cfg, gpus)
    (cpu, _), (gpu, trainer) = counted_plan(cpu_session), counted_plan(gpu_session)
    gpu["predicted"] = predicted(gpu, trainer, hardware or target, gpus)
    spec = gpu_target.TARGETS[target]
    print(f"XLA:GPU's program for {len(gpus)} x {spec.device_kind} ({hosts} host{'s' * (hosts > 1)}, "
          f"{gpu_session.mesh_name()}), compiled here without a GPU by the CUDA plugin; target {target}: "
          f"{spec.source}")
    print(format_report(gpu))
    print()
    print(side_by_side(cpu, gpu, spec.memory_bytes))
    print()
    print(gpu_gemms.table(gpu["gemms"], gpu["custom_calls"]))
    print(json.dumps({"compiler": "XLA:GPU", "target": target, "device_kind": spec.device_kind, "devices": len(gpus),
                      "hosts": hosts, "device_memory_bytes": spec.memory_bytes,
                      **gpu,
                      "cpu": {"compiler": "XLA:CPU", "devices": len(cpu_session.devices),
                              **{k: cpu[k] for k in COMPARED}}}))
    return 0


def side_by_side(cpu: dict, gpu: dict, memory_bytes: int) -> str:
    """Memory per device and collectives by kind (count and bytes per step), XLA:CPU's beside XLA:GPU's."""
    mib = 2 ** 20
    lines = [f"{'per device, MiB':<32}{'XLA:CPU':>14}{'XLA:GPU':>14}"]
    lines += [f"{name:<32}{cpu[key] / mib:>14.2f}{gpu[key] / mib:>14.2f}" for name, key in MEMORY_ROWS]
    total = {name: plan["argument_bytes"] + plan["temp_bytes"] for name, plan in (("cpu", cpu), ("gpu", gpu))}
    lines.append(f"{'total (arguments + temporaries)':<32}{total['cpu'] / mib:>14.2f}{total['gpu'] / mib:>14.2f}"
                 f"   ({total['gpu'] / memory_bytes:.2%} of the GPU's {memory_bytes / 1e9:g} GB)")
    lines.append("")
    lines.append(f"{'collective, per step':<22}{'CPU count':>10}{'CPU bytes':>16}{'GPU count':>10}{'GPU bytes':>16}")
    for op in gpu["collectives"]:
        if cpu["collective_counts"][op] or gpu["collective_counts"][op]:
            lines.append(f"{op:<22}{cpu['collective_counts'][op]:>10d}{cpu['collectives'][op]:>16,d}"
                         f"{gpu['collective_counts'][op]:>10d}{gpu['collectives'][op]:>16,d}")
    lines.append("(counts: executions per step, loops unrolled; the two compilers combine collectives differently)")
    return "\n".join(lines)
