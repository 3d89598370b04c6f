"""Context parallelism against data parallelism on the same global batch: step times, measured alternately.

Usage:
    python benchmarks/context.py [key=value ...] [--steps N] [--warmup W] [--rounds R]

Model: jaxpar's defaults with `model.seq_len=4096 train.batch_size=4 model.attention=flash` on 4
devices, then the key=value overrides. Layouts: data=4 (each device one whole sequence), and
context=4 ring, all-gather and ring unbalanced (each device a quarter of every sequence). Each
round times every layout in turn (the median of N steps after W warm-up steps; the first round's
warm-up compiles), so that the host's drift hits all alike; the table gives the median over the
rounds and the ratio to data=4. Emulated CPU devices share the host's cores: the ring's transfers
are memory copies, and a device that waits frees its core. Printed: the machine's line, a markdown
table, then one JSON line with every number.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

from common import (
    git_commit,
    host_batches,
    machine_line,
    machine_record,
    markdown,
    parse_steps,
    run_line,
    step_parser,
    time_trainer,
    trainer_on,
)

from jaxpar.config.presets import load_config
from jaxpar.runtime.devices import setup_devices

MODEL = ["model.seq_len=4096", "train.batch_size=4", "model.attention=flash", "run.devices=4"]
LAYOUTS = {
    "data=4": ["mesh.data=4"],
    "context=4 ring": ["mesh.data=1", "mesh.context=4"],
    "context=4 allgather": ["mesh.data=1", "mesh.context=4", "parallel.context_attention=allgather"],
    "context=4 ring unbalanced": ["mesh.data=1", "mesh.context=4", "parallel.context_balance=false"],
}

PARSER = step_parser(__doc__, steps=3, warmup=1)
PARSER.add_argument("--rounds", type=int, default=3, help="alternating rounds of every layout (default %(default)s)")
ARGS = parse_steps(PARSER)
BASE = [f"run.dir={os.devnull}", *MODEL, *ARGS.overrides]
# jax must not start before setup_devices has set XLA_FLAGS (emulated CPU devices).
DEVICES = setup_devices(load_config(None, BASE))


def main() -> None:
    record = machine_record(DEVICES)
    trainers = {name: trainer_on(load_config(None, [*BASE, *overrides]), DEVICES)
                for name, overrides in LAYOUTS.items()}
    cfg = trainers["data=4"].cfg
    batches = host_batches(cfg, ARGS.warmup + ARGS.steps)
    print(run_line(DEVICES, cfg, ARGS.warmup, ARGS.steps), file=sys.stderr)
    rounds = {name: [] for name in LAYOUTS}
    for r in range(ARGS.rounds):
        for name, trainer in trainers.items():
            seconds, _, _ = time_trainer(trainer, batches, ARGS.warmup)
            rounds[name].append(seconds)
            print(f"round {r + 1}: {name}: {seconds * 1e3:.0f} ms", file=sys.stderr)
    base = statistics.median(rounds["data=4"])
    rows = [[name, trainers[name].session.layout_name(), f"{statistics.median(times) * 1e3:,.0f}",
             f"{statistics.median(times) / base:.2f}"] for name, times in rounds.items()]
    print(machine_line(record) + "\n")
    print(markdown(["layout", "as named", "step ms (median)", "vs data=4"], rows))
    print(json.dumps({"benchmark": "context", "commit": git_commit(), "machine": record, "model": BASE,
                      "steps": ARGS.steps, "warmup": ARGS.warmup,
                      "rounds_s": rounds, "median_s": {n: statistics.median(t) for n, t in rounds.items()}}))


if __name__ == "__main__":
    main()
