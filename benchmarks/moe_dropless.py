"""Dropless routing against capacity routing, and fine-grained experts against coarse ones: tokens/s and temporaries.

Usage:
    python benchmarks/moe_dropless.py [key=value ...] [--steps N] [--warmup W] [--rounds R]

Model: `configs/default.yaml`'s shape (d_model 128, 4 layers, d_ff 512, batch 32 x 128 tokens,
fp32) with experts on every other layer, top-2 without noise, on 8 emulated CPU devices as
data=2 x expert=4, then the key=value overrides. Four variants, each R times in alternation,
each time a fresh Trainer timed over W warm-up + N steps (median, every step waited for):
  * capacity: 8 experts of width d_ff, router=topk, capacity_factor 1.25;
  * dropless: the same experts, router=dropless;
  * dropless, 64 fine-grained: 64 experts of width d_ff / 8, top-2 x 8 = top-16 (the active
    FLOPs of the 8 coarse experts at top-2);
  * capacity, 64 fine-grained: the same with router=topk, capacity_factor 1.25.
Temporaries: XLA's temp bytes per device of the compiled step (`jaxpar.plan.measure_step`).
Printed: a markdown table (median tokens/s over the rounds, each round, temporaries) and each
variant's ratio to `capacity`.
"""

from __future__ import annotations

import statistics
import sys

from common import host_batches, load_settings, markdown, step_parser, time_trainer, trainer_on

from jaxpar.runtime.devices import setup_devices

BASE = ["mesh.data=2", "mesh.tensor=1", "mesh.expert=4", "model.moe.experts=8", "model.moe.every=2",
        "model.moe.top_k=2", "model.moe.noise=false"]
VARIANTS = {
    "capacity (8 x d_ff, top-2, factor 1.25)": ["model.moe.router=topk"],
    "dropless (8 x d_ff, top-2)": ["model.moe.router=dropless"],
    "dropless (64 x d_ff/8, top-16)": ["model.moe.router=dropless", "model.moe.experts=64",
                                       "model.moe.d_ff=64", "model.moe.top_k=16"],
    "capacity (64 x d_ff/8, top-16, factor 1.25)": ["model.moe.router=topk", "model.moe.experts=64",
                                                    "model.moe.d_ff=64", "model.moe.top_k=16"],
}


def main() -> None:
    parser = step_parser(__doc__, steps=8, warmup=2)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default %(default)s)")
    args = parser.parse_args()
    configs = {name: load_settings(["configs/default.yaml", *BASE, *overrides, *args.overrides])
               for name, overrides in VARIANTS.items()}
    devices = setup_devices(next(iter(configs.values())))  # before jax starts: 8 emulated CPU devices
    results: dict[str, list[float]] = {name: [] for name in VARIANTS}
    temporaries: dict[str, int] = {}
    for round_index in range(args.rounds):
        for name, cfg in configs.items():
            trainer = trainer_on(cfg, devices)
            batches = host_batches(cfg, args.warmup + args.steps)
            seconds, _, _ = time_trainer(trainer, batches, args.warmup)
            results[name].append(cfg.train.batch_size * cfg.model.seq_len / seconds)
            if name not in temporaries:
                from jaxpar.plan import measure_step

                temporaries[name] = measure_step(trainer)["temp_bytes"]
            print(f"round {round_index + 1} {name}: {results[name][-1]:.0f} tokens/s", file=sys.stderr)
    base = statistics.median(results[next(iter(VARIANTS))])
    rows = [[name, f"{statistics.median(v):.0f}", f"{statistics.median(v) / base:.2f}",
             ", ".join(f"{x:.0f}" for x in v), f"{temporaries[name] / 2**20:.1f}"] for name, v in results.items()]
    print(markdown(["variant", "tokens/s (median of rounds)", "ratio to capacity", "each round",
                    "temporaries MiB/device"], rows))


if __name__ == "__main__":
    main()
