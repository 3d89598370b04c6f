"""Calibration of the layout planner: its predicted step times against measured ones.

Usage:
    python benchmarks/planner.py [CONFIG.yaml] [key=value ...] [--steps N] [--warmup W]
                                 [--rounds R] [--each K] [--processes P]

Runs `jaxpar plan --search`'s search for the config (default: the default model on 8 emulated
CPU devices, with the `cpu` profile measured here) over every layout (no pruning; layouts
compiled before come from the cache), then trains the K fastest and the K slowest predicted
layouts that fit (default K=5). Every layout runs W untimed warm-up steps (compilation
included), then R rounds go over all of them in turn (forwards, then backwards), N timed steps
each, so that the machine's drift touches every layout alike; a layout's measured time is the median of its R x N steps.
Reported: the Spearman rank correlation of predicted and measured times, a markdown table under
the machine's line (the cpu profile's record, jaxpar.runtime.machine: processor, native bf16, matmul rates),
the figure results/planner.png (predicted against measured, log-log), and a JSON line.
"""

from __future__ import annotations

import json
import sys

from common import (
    RESULTS,
    git_commit,
    host_batches,
    load_settings,
    machine_line,
    machine_record,
    markdown,
    parse_steps,
    pyplot,
    save_figure,
    step_parser,
)

parser = step_parser(__doc__, steps=4, warmup=2, config_file=True, steps_help="timed steps per layout and round "
                     "(default %(default)s)")
parser.add_argument("--rounds", type=int, default=3, help="rounds over all layouts (default %(default)s)")
parser.add_argument("--each", type=int, default=5,
                    help="how many of the fastest and of the slowest (default %(default)s)")
parser.add_argument("--processes", type=int, default=2, help="processes compiling layouts (default %(default)s)")
ARGS = parse_steps(parser)
if ARGS.rounds < 1 or ARGS.each < 1:
    parser.error("--rounds and --each must be at least 1")
CFG = load_settings(["run.devices=8", *ARGS.settings])

from jaxpar.runtime.devices import setup_devices  # noqa: E402

DEVICES = setup_devices(CFG)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxpar.plan.calibrate import profile  # noqa: E402
from jaxpar.plan.search import search  # noqa: E402


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation (ties get their mean rank)."""
    def ranks(values):
        values = np.asarray(values, float)
        order = values.argsort()
        r = np.empty(len(values))
        r[order] = np.arange(len(values))
        for v in np.unique(values):  # average the ranks of ties
            r[values == v] = r[values == v].mean()
        return r

    return float(np.corrcoef(ranks(x), ranks(y))[0, 1])


def measured_seconds(candidates: list, batches: list) -> list[float]:
    """Median step seconds of each candidate's layout, timed in alternating rounds."""
    import statistics
    import time

    from common import trainer_on

    runs = []
    for c in candidates:
        trainer = trainer_on(CFG.replace(**c.overrides), DEVICES)
        state = trainer.init()
        for host in batches[:ARGS.warmup]:
            state, _ = trainer.step(state, trainer.put_batch(host))
        jax.block_until_ready(state)
        runs.append([trainer, state, []])
        print(f"  warmed up {c.name}", file=sys.stderr)
    timed = batches[ARGS.warmup:]
    for round_ in range(ARGS.rounds):
        for run in runs if round_ % 2 == 0 else runs[::-1]:  # the order flips each round: no layout always goes first
            trainer, state, times = run
            for host in timed[round_ * ARGS.steps:(round_ + 1) * ARGS.steps]:
                batch = jax.block_until_ready(trainer.put_batch(host))
                start = time.perf_counter()
                state, out = trainer.step(state, batch)
                jax.block_until_ready((state, out))
                times.append(time.perf_counter() - start)
            run[1] = state
    return [statistics.median(times) for _, _, times in runs]


def main() -> int:
    hardware = profile("cpu" if DEVICES[0].platform == "cpu" else "h100", DEVICES)
    machine = hardware.machine or machine_record(DEVICES)
    result = search(CFG, DEVICES, hardware, hardware.memory_bytes, {}, processes=ARGS.processes)
    ranked = result.ranked
    chosen = ranked[:ARGS.each] + ranked[-ARGS.each:] if len(ranked) > 2 * ARGS.each else ranked
    print(f"{len(ranked)} layouts fit; timing {len(chosen)}: {ARGS.warmup} warm-up + {ARGS.rounds} rounds x "
          f"{ARGS.steps} steps each", file=sys.stderr)
    batches = host_batches(CFG, ARGS.warmup + ARGS.rounds * ARGS.steps)
    measured = measured_seconds(chosen, batches)
    predicted = [c.prediction.seconds for c in chosen]
    rho = spearman(predicted, measured)
    measured_rank = {i: r for r, i in enumerate(sorted(range(len(chosen)), key=measured.__getitem__), 1)}
    rows = [[str(ranked.index(c) + 1), str(measured_rank[i]), c.name, f"{predicted[i] * 1e3:.1f}",
             f"{measured[i] * 1e3:.1f}", f"{measured[i] / predicted[i]:.2f}", c.prediction.limiting]
            for i, c in enumerate(chosen)]
    print(machine_line(machine) + "\n")
    print(markdown(["predicted rank (of all)", "measured rank (of these)", "layout", "predicted ms", "measured ms",
                    "measured / predicted", "limiting"], rows))
    print(f"\nSpearman rank correlation over {len(chosen)} layouts: {rho:.3f}")

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 5.2))
    fast = [i < ARGS.each for i in range(len(chosen))]
    for group, color, label in ((True, "#4C72B0", "fastest predicted"), (False, "#DD8452", "slowest predicted")):
        xs = [p * 1e3 for p, f in zip(predicted, fast) if f == group]
        ys = [m * 1e3 for m, f in zip(measured, fast) if f == group]
        ax.scatter(xs, ys, color=color, label=label, zorder=3)
    for i, c in enumerate(chosen):
        ax.annotate(c.name.removesuffix(" fp32"), (predicted[i] * 1e3, measured[i] * 1e3), fontsize=6,
                    xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("predicted step time (ms)")
    ax.set_ylabel("measured step time (ms, median)")
    ax.set_title(f"planner calibration: {len(DEVICES)} x {DEVICES[0].platform}, Spearman {rho:.2f}", fontsize=10)
    ax.legend(fontsize=8)
    save_figure(fig, RESULTS / "planner.png")
    print(json.dumps({"spearman": rho, "commit": git_commit(), "machine": machine, "search_seconds": result.seconds,
                      "fit": len(ranked), "layouts": [
                          {"layout": c.name, "overrides": c.overrides, "predicted_s": predicted[i],
                           "measured_s": measured[i]} for i, c in enumerate(chosen)]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
