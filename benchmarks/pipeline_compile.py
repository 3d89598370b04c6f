"""What a pipelined train step costs to build, before it runs: CPU seconds to trace and lower it and to
compile it, its fusions, and from the compiled program its temporaries and executed FLOPs, for each
schedule at S=4, M=16 on data=2 x stage=4 (8 layers of the default model, seq 256, batch 64, no remat:
the shape of tests/test_pipeline.py's memory and FLOP tests). Nothing runs.

Usage:
    python benchmarks/pipeline_compile.py [--level N] [--rounds R] [CHECKOUT ...]

With checkouts (folders of jaxpar, say a `git worktree` of an older commit, and this one), every
schedule is measured in a fresh process per checkout, the checkouts taking turns within each round,
so that the host's drift hits all alike; the table gives medians over the rounds and each
checkout's ratio to the first. Without, this checkout alone. --level is XLA's backend optimisation
level for the compile (default 3, XLA's own; the test suite compiles at 0). The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SHAPE = ["model.n_layers=8", "model.seq_len=256", "train.batch_size=64", "train.remat=none", "mesh.data=2",
         "mesh.stage=4", "parallel.pipeline.microbatches=16"]
SCHEDULES = {"gpipe": ["parallel.pipeline.schedule=gpipe"], "1f1b": ["parallel.pipeline.schedule=1f1b"],
             "1f1b recompute": ["parallel.pipeline.schedule=1f1b", "parallel.pipeline.recompute=true"],
             "interleaved (v=2)": ["parallel.pipeline.schedule=interleaved", "parallel.pipeline.virtual=2"],
             "zb-h1": ["parallel.pipeline.schedule=zb-h1"], "zbv": ["parallel.pipeline.schedule=zbv"]}
FIELDS = ("trace_lower_s", "compile_s", "fusions", "temp_MiB", "executed_gflops")


def measure(schedule: str, level: int) -> dict:
    """One schedule's figures, in this process (jaxpar is whichever checkout PYTHONPATH gives)."""
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"
    from jaxpar.config.presets import load_config
    from jaxpar.plan.memory import measure_step
    from jaxpar.train.run_session import prepare
    from jaxpar.train.trainer import Trainer

    trainer = Trainer(prepare(load_config(None, [*SHAPE, *SCHEDULES[schedule], f"run.dir={os.devnull}"])))
    start = time.process_time()
    lowered = trainer.step.lower(trainer.abstract_state(), trainer.abstract_batch())
    traced = time.process_time() - start
    start = time.process_time()
    compiled = lowered.compile({"xla_backend_optimization_level": level})
    compiling = time.process_time() - start
    plan = measure_step(trainer)  # its own compile, at the plan's level
    return {"trace_lower_s": traced, "compile_s": compiling, "fusions": compiled.as_text().count(" fusion("),
            "temp_MiB": plan["temp_bytes"] / 2**20, "executed_gflops": plan["executed_flops"] / 1e9}


def run_in(checkout: Path, schedule: str, level: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    done = subprocess.run([sys.executable, __file__, "--one", schedule, "--level", str(level)], env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkouts", nargs="*", type=Path, help="jaxpar checkouts to compare (default: this one)")
    parser.add_argument("--level", type=int, default=3, help="XLA backend optimisation level (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per schedule and checkout")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process: measure this schedule, print JSON
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.level)))
        return
    checkouts = args.checkouts or [Path(__file__).resolve().parent.parent]
    runs = {(c, s): [] for c in checkouts for s in SCHEDULES}
    for r in range(args.rounds):
        for schedule in SCHEDULES:
            for checkout in checkouts:
                runs[checkout, schedule].append(run_in(checkout, schedule, args.level))
            print(f"round {r + 1}: {schedule}", file=sys.stderr)
    medians = {key: {f: statistics.median(run[f] for run in rs) for f in FIELDS} for key, rs in runs.items()}
    print(f"| schedule | checkout | {' | '.join(FIELDS)} | trace+lower / first | compile / first |")
    print("|---|---|" + "---|" * (len(FIELDS) + 2))
    for schedule in SCHEDULES:
        first = medians[checkouts[0], schedule]
        for checkout in checkouts:
            m = medians[checkout, schedule]
            cells = [str(round(m[f])) if f == "fusions" else f"{m[f]:.2f}" for f in FIELDS]
            print(f"| {schedule} | {checkout.name} | {' | '.join(cells)} | "
                  f"{m['trace_lower_s'] / first['trace_lower_s']:.2f} | {m['compile_s'] / first['compile_s']:.2f} |")
    print(json.dumps({f"{c.name} {s}": m for (c, s), m in medians.items()}))


if __name__ == "__main__":
    main()
