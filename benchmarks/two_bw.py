"""PipeDream-2BW without a flush against 1F1B: step time, alternately in one session.

Usage:
    python benchmarks/two_bw.py [key=value ...] [--steps N] [--warmup W] [--rounds R] [--microbatches 4,8]

Model: jaxpar's defaults with `model.n_layers=8 train.batch_size=64`, then the key=value overrides, on
mesh.data=2 x mesh.stage=4 (8 devices, emulated on a CPU-only host). For each M, both schedules are
built and warmed up (W steps each, compilation included; 2BW's first step fills its pipeline), then
R rounds each time N steps of 1F1B and N steps of 2BW, the order flipping every round, every step
waited for with block_until_ready. Printed: a markdown table of the median step time of each and
their ratio, then one JSON line with every step time.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

from common import host_batches, markdown, parse_steps, run_line, step_parser, trainer_on

from jaxpar.config.presets import load_config
from jaxpar.runtime.devices import setup_devices

PARSER = step_parser(__doc__, steps=3, warmup=2)
PARSER.add_argument("--rounds", type=int, default=4, help="alternating rounds (default %(default)s)")
PARSER.add_argument("--microbatches", default="4,8", help="the values of M (default %(default)s)")
ARGS = parse_steps(PARSER)
BASE = [f"run.dir={os.devnull}", "model.n_layers=8", "train.batch_size=64", "mesh.data=2", "mesh.stage=4",
        *ARGS.overrides]
DEVICES = setup_devices(load_config(None, BASE))

import jax  # noqa: E402


def timed(trainer, state, batches, count: int):
    """(state, the seconds of each of `count` steps)."""
    seconds = []
    for batch in batches[:count]:
        start = time.perf_counter()
        state, metrics = trainer.step(state, trainer.put_batch(batch))
        jax.block_until_ready((state, metrics))
        seconds.append(time.perf_counter() - start)
    return state, seconds


def compare(m: int, batches) -> dict:
    """Both schedules at M microbatches, alternately: their step times."""
    trainers, states, times = {}, {}, {"1f1b": [], "2bw": []}
    for schedule in times:
        cfg = load_config(None, [*BASE, f"parallel.pipeline.schedule={schedule}",
                                 f"parallel.pipeline.microbatches={m}"])
        trainers[schedule] = trainer_on(cfg, DEVICES)
        states[schedule], _ = timed(trainers[schedule], trainers[schedule].init(), batches, ARGS.warmup)
    for r in range(ARGS.rounds):
        for schedule in (list(times) if r % 2 == 0 else list(reversed(times))):
            states[schedule], seconds = timed(trainers[schedule], states[schedule], batches, ARGS.steps)
            times[schedule] += seconds
    medians = {s: statistics.median(t) * 1e3 for s, t in times.items()}
    print(f"M={m}: 1f1b {medians['1f1b']:.1f} ms, 2bw {medians['2bw']:.1f} ms", file=sys.stderr)
    return {"M": m, "median_ms": medians, "step_s": times, "speedup": medians["1f1b"] / medians["2bw"]}


def main() -> int:
    cfg = load_config(None, BASE)
    batches = host_batches(cfg, max(ARGS.warmup, ARGS.steps))
    print(run_line(DEVICES, cfg, ARGS.warmup, ARGS.steps) + f" per block, {ARGS.rounds} rounds", file=sys.stderr)
    rows = [compare(int(m), batches) for m in ARGS.microbatches.split(",")]
    print(markdown(["M", "1f1b ms (median)", "2bw ms (median)", "1f1b / 2bw"],
                   [[r["M"], f"{r['median_ms']['1f1b']:.1f}", f"{r['median_ms']['2bw']:.1f}", f"{r['speedup']:.3f}"]
                    for r in rows]) + "\n")
    print(json.dumps({"overrides": BASE[1:], "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
