"""XLA:CPU's plan beside XLA:GPU's (compiled here for H100s, without a GPU) for a few layouts: temporaries,
argument bytes, collectives by kind and bytes, and the GEMMs and custom calls of the GPU program.

Usage (the CUDA plugin on PYTHONPATH: `bash run.sh test` installs it into .gpu-plan/):
    PYTHONPATH=.gpu-plan .venv/bin/python benchmarks/gpu_plans.py [--only NAME ...] [--target h100]

Each layout is compiled in a fresh process (XLA's emulated CPU device count is fixed when jax starts), as
`jaxpar plan --target` compiles it (jaxpar.plan.gpu_plan), Llama 3 8B on 8 hosts (64 GPUs; XLA:CPU's plan
on 64 emulated devices) too. Prints a markdown table stamped with the commit, date and machine, a line
per layout on whether the data-sharded gradients (ZeRO-2/3) travel as reduce-scatters, then one JSON line.
Nothing runs; stderr gives each compile's seconds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, git_commit, markdown  # noqa: E402 (imports nothing outside the standard library)

SMALL = ["model.d_model=64", "model.d_ff=256", "model.seq_len=32"]  # tests/helpers.py's SMALL_MODEL
LLAMA_8B = ["configs/llama3_8b.yaml", "parallel.zero=3", "train.precision=bf16", "train.remat=full",
            "model.attention=flash"]
# name: (settings, hosts)
LAYOUTS = {
    "default, data=4 x tensor=2": (["configs/default.yaml"], 1),
    "small, ZeRO-2, data=8, bf16": ([*SMALL, "mesh.data=8", "parallel.zero=2", "train.precision=bf16"], 1),
    "small, ZeRO-3, data=8, bf16": ([*SMALL, "mesh.data=8", "parallel.zero=3", "train.precision=bf16"], 1),
    "1F1B, data=2 x stage=4": (["mesh.data=2", "mesh.stage=4", "parallel.pipeline.schedule=1f1b",
                                "parallel.pipeline.microbatches=8"], 1),
    "MoE dropless, data=2 x expert=4": (["model.moe.experts=8", "model.moe.router=dropless", "model.n_layers=2",
                                         "model.moe.every=2", *SMALL, "mesh.data=2", "mesh.expert=4",
                                         "parallel.expert_dispatch=ragged"], 1),
    "Llama 3 8B, ZeRO-3, full remat, bf16, flash, 8 hosts": (LLAMA_8B, 8),
}
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute", "ragged-all-to-all")


def measure(name: str, target: str) -> dict:
    """One layout's CPU and GPU plans, in this process."""
    from common import load_settings

    from jaxpar.plan import gpu_target
    from jaxpar.plan.gpu_plan import counted_plan, prepared
    from jaxpar.runtime.devices import requested_devices, setup_devices
    from jaxpar.session import on_devices

    settings, hosts = LAYOUTS[name]
    cfg = prepared(load_settings(settings), target, hosts, None)
    out = {"name": name, "hosts": hosts}
    cpu_devices = setup_devices(cfg)  # before jax starts: the emulated device count
    start = time.perf_counter()
    cpu, _ = counted_plan(on_devices(cfg, cpu_devices))
    out["cpu"], out["cpu_seconds"] = summary(cpu), time.perf_counter() - start
    gpus = gpu_target.gpu_devices(target, requested_devices(cfg) or gpu_target.DEVICES_PER_HOST, hosts)
    start = time.perf_counter()
    session = on_devices(cfg, gpus)
    gpu, _ = counted_plan(session)
    out["gpu"], out["gpu_seconds"] = summary(gpu), time.perf_counter() - start
    out["gpu"].update(gemms=gpu["gemms"], custom_calls=gpu["custom_calls"], devices=len(gpus),
                      layout=session.mesh_name())
    return out


def summary(plan: dict) -> dict:
    return {"temp_bytes": plan["temp_bytes"], "argument_bytes": plan["argument_bytes"],
            "params_bytes": plan["params_bytes"], "opt_state_bytes": plan["opt_state_bytes"],
            "collectives": plan["collectives"], "collective_counts": plan["collective_counts"]}


def collectives_cell(plan: dict) -> str:
    return "<br>".join(f"{op} {plan['collective_counts'][op]} x, {plan['collectives'][op]:,d} B" for op in KINDS
                       if plan["collective_counts"][op]) or "none"


def gemms_cell(gpu: dict) -> str:
    groups: dict[str, int] = {}
    for g in gpu["gemms"]:
        key = f"{g['kind']} {'x'.join(g['operands'])}->{g['result']}"
        groups[key] = groups.get(key, 0) + g["count"]
    calls = ", ".join(f"{t} x{n}" for t, n in gpu["custom_calls"].items()) or "none"
    return "<br>".join(f"{k}: {n}" for k, n in sorted(groups.items())) + f"<br>custom calls: {calls}"


def mib(value: int) -> str:
    return f"{value / 2 ** 20:,.1f}"


def rows(results: list[dict], memory_bytes: float) -> list[list[str]]:
    out = []
    for r in results:
        cpu, gpu = r["cpu"], r["gpu"]
        total = gpu["argument_bytes"] + gpu["temp_bytes"]
        out.append([r["name"], f"{gpu['devices']} ({gpu['layout']})",
                    f"{mib(cpu['temp_bytes'])} / {mib(gpu['temp_bytes'])}",
                    f"{mib(cpu['argument_bytes'])} / {mib(gpu['argument_bytes'])}",
                    f"{total / 1e9:,.2f} GB ({total / memory_bytes:.0%})",
                    collectives_cell(cpu), collectives_cell(gpu), gemms_cell(gpu)])
    return out


def gradients_line(r: dict) -> str:
    """Whether XLA:GPU's program reduce-scatters the gradients, from its collectives: for a ZeRO-2/3 layout."""
    cpu, gpu = r["cpu"], r["gpu"]
    scattered = gpu["collective_counts"]["reduce-scatter"]
    return (f"{r['name']}: XLA:GPU {scattered} reduce-scatters per step ({gpu['collectives']['reduce-scatter']:,d} "
            f"bytes), {gpu['collective_counts']['all-reduce']} all-reduces ({gpu['collectives']['all-reduce']:,d} "
            f"bytes); XLA:CPU {cpu['collective_counts']['reduce-scatter']} reduce-scatters, "
            f"{cpu['collective_counts']['all-reduce']} all-reduces ({cpu['collectives']['all-reduce']:,d} bytes)")


def run_child(name: str, target: str) -> dict:
    args = [sys.executable, __file__, "--one", name, "--target", target]
    done = subprocess.run(args, cwd=REPO, capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    if done.returncode:
        sys.exit(f"{name}: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="these layouts (names as in LAYOUTS, or a word of them)")
    parser.add_argument("--target", default="h100", help="the GPU to compile for (default %(default)s)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child: measure this layout, print JSON
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.target)))
        return
    from jaxpar.plan.gpu_target import TARGETS
    from jaxpar.runtime.machine import processor

    names = [n for n in LAYOUTS if not args.only or any(word in n for word in args.only)]
    results = []
    for name in names:
        results.append(run_child(name, args.target))
        r = results[-1]
        print(f"{name}: compiled by XLA:CPU in {r['cpu_seconds']:.0f} s, by XLA:GPU in {r['gpu_seconds']:.0f} s",
              file=sys.stderr)
    spec = TARGETS[args.target]
    print(f"{datetime.date.today()}, commit {git_commit()}, {processor()} ({os.cpu_count()} cores); XLA:GPU for "
          f"{spec.device_kind} ({args.target}), per device; CPU / GPU\n")
    header = ["layout", "GPUs", "temporaries MiB", "arguments MiB", f"GPU total (of {spec.memory_bytes / 1e9:g} GB)",
              "XLA:CPU collectives per step", "XLA:GPU collectives per step", "XLA:GPU GEMMs per step"]
    print(markdown(header, rows(results, spec.memory_bytes)))
    print()
    for r in results:
        if "ZeRO" in r["name"]:
            print(gradients_line(r))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
