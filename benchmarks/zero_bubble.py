"""Zero-bubble pipelines against 1F1B on S=4 stages: the step time each table predicts from its
branches' compiled costs, beside the measured CPU step time.

Usage:
    python benchmarks/zero_bubble.py [key=value ...] [--steps N] [--warmup W] [--rounds R] [--predict-only]

Model: jaxpar's defaults with `model.n_layers=8 train.batch_size=64` on mesh.data=2 x mesh.stage=4,
then the key=value overrides. For 1f1b, zb-h1 and zbv at M in {8, 16}:
  * the cost of each branch of the tick switch (idle, F, B and W of the first, a middle and the last
    chunk; 1F1B's B is a fused backward), read from the compiled step (jaxpar.plan.hlo.branch_costs):
    its executed matmul FLOPs, as seconds at a hardware profile's peak, as the planner costs
    compute; and the roofline's cost, those plus the bytes its other work writes at the
    profile's write bandwidth (on the h100 profile the default model, 128 wide, is bound by
    those bytes: the ticks' residual copies cost more than its matmuls);
  * predicted step = the table in lockstep, each tick as long as the slowest stage's branch
    (how the SPMD program runs it: one `lax.switch` per tick on every device, then the stages'
    ppermutes), plus the rest of the step; beside it the ideal asynchronous timeline (each stage
    running as soon as its inputs are ready, the paper's model, jaxpar.parallel.schedule_timing);
  * on the measured `cpu` profile and on the h100 profile (the same compiled costs);
  * measured: the median step time over R rounds that alternate the layouts, each round the
    median of N steps after W warm-up steps (the first round's warm-up compiles). With
    --predict-only, nothing is timed: the compiled costs on the h100 profile alone (the `cpu`
    profile is measured by timing this host's matmuls, once, then cached).
Emulated CPU devices share the host's cores, so a stage that idles frees its core for a busy one
and the bubble barely shows in wall time: the prediction is what devices that work in parallel
would see. Printed: a markdown table, then one JSON line with every number.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

from common import host_batches, markdown, parse_steps, run_line, step_parser, time_steps, trainer_on

from jaxpar.config.presets import load_config
from jaxpar.runtime.devices import setup_devices

STAGES, DATA, MICROBATCHES, SCHEDULES = 4, 2, (8, 16), ("1f1b", "zb-h1", "zbv")
MODEL = ["model.n_layers=8", "train.batch_size=64"]

PARSER = step_parser(__doc__, steps=3, warmup=1)
PARSER.add_argument("--rounds", type=int, default=3, help="alternating rounds of every layout (default %(default)s)")
PARSER.add_argument("--predict-only", action="store_true", help="compile and predict on the h100 profile; time nothing")
ARGS = parse_steps(PARSER)
BASE = [f"run.dir={os.devnull}", *MODEL, *ARGS.overrides]
# jax must not start before setup_devices has set XLA_FLAGS (emulated CPU devices).
DEVICES = setup_devices(load_config(None, BASE))

from jaxpar.config import precision  # noqa: E402
from jaxpar.parallel.pipeline import BRANCHES, TICK_SCOPE, branch_of, compiled_branches  # noqa: E402
from jaxpar.parallel.schedule_timing import idle_fraction, timeline  # noqa: E402
from jaxpar.plan.calibrate import profile  # noqa: E402
from jaxpar.plan.hlo import branch_costs, matmul_flops, parse, written_bytes  # noqa: E402
from jaxpar.plan.memory import PLAN_COMPILER_OPTIONS  # noqa: E402


def compiled_costs(trainer) -> dict:
    """Per-branch and rest-of-step matmul FLOPs and written bytes of the trainer's compiled step."""
    module = parse(trainer.compile_step(PLAN_COMPILER_OPTIONS.get("cpu")).as_text())
    kinds = compiled_branches(trainer.pipeline.table)
    flops, rest_flops = branch_costs(module, TICK_SCOPE, kinds, matmul_flops)
    written, rest_written = branch_costs(module, TICK_SCOPE, kinds, written_bytes)
    return {"branch_flops": flops, "branch_written_bytes": written, "rest_flops": rest_flops,
            "rest_written_bytes": rest_written}


def predicted(table, costs: dict, hardware, compute_dtype: str, with_bytes: bool) -> dict:
    """Seconds of the step on `hardware`: the rest plus the table's ticks in lockstep, and the ideal
    asynchronous timeline instead of the lockstep, from the per-branch FLOPs (with the written
    bytes too when `with_bytes`)."""
    peak, bandwidth = hardware.peak_flops[compute_dtype], hardware.write_bandwidth if with_bytes else float("inf")
    seconds = [f / peak + b / bandwidth for f, b in zip(costs["branch_flops"], costs["branch_written_bytes"])]
    rest = costs["rest_flops"] / peak + costs["rest_written_bytes"] / bandwidth
    last = table.stages * table.virtual - 1
    lockstep = sum(max(seconds[branch_of(a, last)] for a in row) for row in table.ticks)

    def cost(action):
        return seconds[branch_of(action, last)]

    makespan = max(end for stage in timeline(table, cost) for _, _, end in stage)
    return {"lockstep_s": rest + lockstep, "asynchronous_s": rest + makespan, "timed_idle": idle_fraction(table, cost),
            "branch_ms": {BRANCHES[k]: 1e3 * s for k, s in enumerate(seconds)}}


def build_layouts(profiles: dict) -> dict:
    """Every (schedule, M): its trainer and state, its compiled costs and its predictions."""
    layouts = {}
    for m in MICROBATCHES:
        for schedule in SCHEDULES:
            cfg = load_config(None, [*BASE, f"mesh.data={DATA}", f"mesh.stage={STAGES}",
                                     f"parallel.pipeline.schedule={schedule}", f"parallel.pipeline.microbatches={m}"])
            trainer = trainer_on(cfg, DEVICES)
            costs, table = compiled_costs(trainer), trainer.pipeline.table
            layouts[schedule, m] = {"trainer": trainer, "rounds": [], "costs": costs, "ticks": len(table.ticks),
                                    "idle_table": table.idle_fraction,
                                    **{f"{name} {model}": predicted(table, costs, hw, precision.of(cfg).compute,
                                                                     model == "roofline")
                                       for name, hw in profiles.items() for model in ("compute", "roofline")}}
            print(f"{schedule} M={m}: compiled", file=sys.stderr)
    return layouts


def time_layouts(layouts: dict, batches: list) -> None:
    """R rounds, each timing every layout in turn, so that the host's drift hits all alike."""
    for run in layouts.values():
        run["state"] = run["trainer"].init()
    for _ in range(ARGS.rounds):
        for (schedule, m), run in layouts.items():
            trainer = run["trainer"]
            seconds, _, run["state"] = time_steps(trainer.step, run["state"], trainer.put_batch, batches, ARGS.warmup)
            run["rounds"].append(seconds)
            print(f"{schedule} M={m}: {seconds * 1e3:.1f} ms", file=sys.stderr)


def report(layouts: dict, profiles: dict) -> tuple[list, list]:
    """The markdown rows and the JSON records: predictions against 1F1B's, measured beside them."""
    rows, records = [], []
    models = [f"{p} {m}" for p in profiles for m in ("compute", "roofline")]
    for (schedule, m), run in layouts.items():
        one = layouts["1f1b", m]
        ratio = {k: run[k]["lockstep_s"] / one[k]["lockstep_s"] for k in models}
        measured = statistics.median(run["rounds"]) if run["rounds"] else None
        measured_ratio = measured / statistics.median(one["rounds"]) if measured else None
        cells = [schedule, m, run["ticks"], f"{run['idle_table']:.3f}"]
        for p in profiles:
            compute = run[f"{p} compute"]
            cells += [f"{compute['lockstep_s'] * 1e3:.3f}", f"{compute['asynchronous_s'] * 1e3:.3f}",
                      f"{ratio[p + ' compute']:.3f}", f"{ratio[p + ' roofline']:.3f}"]
        if measured:
            cells += [f"{measured * 1e3:.1f}", f"{measured_ratio:.3f}"]
        rows.append(cells)
        records.append({"schedule": schedule, "M": m, "ticks": run["ticks"], "idle_table": run["idle_table"],
                        "costs": run["costs"], **{k: run[k] for k in models}, "predicted_vs_1f1b": ratio,
                        "measured_s": measured, "measured_rounds_s": run["rounds"], "measured_vs_1f1b": measured_ratio})
    return rows, records


def main() -> int:
    cfg = load_config(None, BASE)
    profiles = {"h100": profile("h100", DEVICES)} if ARGS.predict_only else {
        "cpu": profile("cpu", DEVICES), "h100": profile("h100", DEVICES)}
    layouts = build_layouts(profiles)
    if not ARGS.predict_only:
        print(run_line(DEVICES, cfg, ARGS.warmup, ARGS.steps) + f" per layout and round, {ARGS.rounds} rounds",
              file=sys.stderr)
        time_layouts(layouts, host_batches(cfg, ARGS.warmup + ARGS.steps))
    rows, records = report(layouts, profiles)
    header = ["schedule", "M", "ticks", "idle (table)"]
    for p in profiles:
        header += [f"{p}: matmul ms, lockstep", f"{p}: matmul ms, async", f"{p}: matmul / 1F1B",
                   f"{p}: roofline / 1F1B"]
    if not ARGS.predict_only:
        header += ["measured ms (cpu)", "measured / 1F1B"]
    print(f"Zero bubble against 1F1B, S={STAGES} on data={DATA} x stage={STAGES} ({' '.join(BASE[1:])})\n")
    print(markdown(header, rows) + "\n")
    print(json.dumps({"overrides": BASE[1:], "rounds": ARGS.rounds, "steps": ARGS.steps, "warmup": ARGS.warmup,
                      "predict_only": ARGS.predict_only, "rows": records}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
