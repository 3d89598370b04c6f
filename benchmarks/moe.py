"""Mixture of experts: throughput and routing by router x expert-parallel degree, capacity, balance loss.

Usage:
    python benchmarks/moe.py [key=value ...] [--steps N] [--warmup W] [--train-steps T]

Model: jaxpar's defaults with `model.moe.experts=8 model.moe.every=2` (8 experts on every other
layer) on the builtin corpus, then the key=value overrides; 8 devices, emulated on a CPU-only host.
  * Table 1: for each router (topk, switch, expert_choice) and mesh.expert in {1, 2, 4, 8} (the rest
    on mesh.data): tokens/s = batch_size * seq_len / median of N timed steps after W warm-up steps
    (compilation included in the warm-up, every step waited for with block_until_ready); dropped
    fraction and load CV from the last timed step's metrics; all-to-all bytes per device and step
    from `jaxpar.plan.measure_step(trainer)["collectives"]["all-to-all"]`.
  * Table 2: switch router, T training steps (`jaxpar.train.loop.train`, metrics every 10 steps, into
    a temporary run dir, mesh.data=8) at model.moe.capacity_factor 1.0, 1.25 and 2.0: dropped fraction
    at the last logged step, and the loss.
  * Table 3: switch and topk, T steps with model.moe.aux_loss_weight 0 vs 0.01: load CV, dropped
    fraction, loss and per-expert token counts (whole batch, mean over MoE layers) at the last step.
  * Table 4: first vs last logged loss of every training run (plus one expert_choice run).
A run whose settings coincide with an earlier one (switch, capacity 1.25, aux 0.01) is reused. If
`train` fails after its last step was logged (e.g. in its text sample), the metrics are kept and the
error is reported on stderr and in the JSON.
Printed: the tables as markdown, then one JSON line with every number; one progress line per run on
stderr; the figure goes to benchmarks/results/moe.png (tokens/s; per-expert tokens, aux off vs on).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from common import RESULTS, host_batches, markdown, pyplot, run_line, save_figure, step_parser, time_trainer, trainer_on

from jaxpar.config.presets import load_config
from jaxpar.runtime.devices import setup_devices
from jaxpar.session import on_devices

ROUTERS, EXPERT_DEGREES, CAPACITIES, AUX_WEIGHTS = ("topk", "switch", "expert_choice"), (1, 2, 4, 8), \
    (1.0, 1.25, 2.0), (0.0, 0.01)
MODEL = ["model.moe.experts=8", "model.moe.every=2"]
OUT_PNG = RESULTS / "moe.png"

parser = step_parser(__doc__, steps=6, warmup=2, steps_help="timed steps per layout (default %(default)s, at least 5)")
parser.add_argument("--train-steps", type=int, default=100, help="steps per training run (default 100)")
ARGS = parser.parse_args()
if ARGS.steps < 5 or ARGS.warmup < 1 or ARGS.train_steps < 10:
    parser.error("need --steps >= 5, --warmup >= 1 and --train-steps >= 10")
BASE = [*MODEL, *ARGS.overrides]
# jax must not start before setup_devices has set XLA_FLAGS (emulated CPU devices).
DEVICES = setup_devices(load_config(None, [f"run.dir={os.devnull}", *BASE]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxpar.model.routers import capacity  # noqa: E402
from jaxpar.plan import measure_step  # noqa: E402
from jaxpar.runtime.jsonl import read_jsonl  # noqa: E402
from jaxpar.train.loop import train  # noqa: E402
from jaxpar.train.run_session import prepare  # noqa: E402


def throughput_row(router: str, expert: int, batches: list[np.ndarray]) -> dict:
    """Measure one (router, mesh.expert) layout's compiled step, time it, read the last step's routing metrics."""
    start = time.perf_counter()
    cfg = load_config(None, [f"run.dir={os.devnull}", *BASE, f"model.moe.router={router}",
                             f"mesh.expert={expert}", f"mesh.data={len(DEVICES) // expert}"])
    trainer = trainer_on(cfg, DEVICES)
    all_to_all = measure_step(trainer)["collectives"].get("all-to-all", 0)
    seconds, metrics, _ = time_trainer(trainer, batches, ARGS.warmup)
    last = jax.device_get(metrics)
    print(f"{router} expert={expert}: {seconds * 1e3:.1f} ms/step, done in {time.perf_counter() - start:.1f} s",
          file=sys.stderr)
    return {"router": router, "expert": expert, "data": len(DEVICES) // expert, "median_step_ms": seconds * 1e3,
            "tokens_per_s": cfg.train.batch_size * cfg.model.seq_len / seconds,
            "dropped_fraction": _optional(last, "moe_dropped_fraction"),
            "unrouted_fraction": float(last["moe_unrouted_fraction"]), "load_cv": float(last["moe_load_cv"]),
            "all_to_all_bytes": int(all_to_all)}


def _optional(metrics: dict, key: str) -> float | None:
    """A metric only some routers have (Expert Choice never drops for capacity): None where absent."""
    return float(metrics[key]) if key in metrics else None


_RUNS: dict[tuple, dict] = {}


def train_run(router: str, capacity: float = 1.25, aux: float = 0.01) -> dict:
    """Train T steps on mesh.data=8 in a temporary run dir (cached by settings); first and last logged metrics."""
    key = (router, capacity, aux)
    if key in _RUNS:
        return _RUNS[key]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="jaxpar-moe-") as run_dir:
        cfg = load_config(None, [*BASE, f"run.dir={run_dir}", "mesh.data=8", "mesh.expert=1",
                                 f"model.moe.router={router}", f"model.moe.capacity_factor={capacity}",
                                 f"model.moe.aux_loss_weight={aux}", f"train.steps={ARGS.train_steps}",
                                 "train.log_every=10"])
        error = None
        try:
            train(prepare(cfg), progress=False)
        except Exception as e:  # noqa: BLE001 - a failure after the last step still leaves every metric
            error = f"{type(e).__name__}: {e}"
        lines = read_jsonl(Path(run_dir) / "metrics.jsonl")
    if error is not None:
        if not lines or lines[-1]["step"] != ARGS.train_steps:
            raise RuntimeError(f"training run {key} failed before its last step: {error}")
        print(f"train {router}: failed after its last step was logged (metrics kept): {error}", file=sys.stderr)
    first, last = lines[0], lines[-1]
    _RUNS[key] = {"router": router, "capacity_factor": capacity, "aux_loss_weight": aux, "step": last["step"],
                  "first_loss": first["loss"], "final_loss": last["loss"],
                  "dropped_fraction": _optional(last, "moe_dropped_fraction"),
                  "unrouted_fraction": last["moe_unrouted_fraction"], "load_cv": last["moe_load_cv"],
                  "expert_tokens": last["moe_expert_tokens"], "aux_loss": last["moe_aux_loss"],
                  "error_after_training": error}
    print(f"train {router} capacity={capacity} aux={aux}: loss {first['loss']:.3f} -> {last['loss']:.3f}, "
          f"unrouted {last['moe_unrouted_fraction']:.3f}, done in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return _RUNS[key]


def _fraction(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def plot(speed: list[dict], balance: list[dict], path: Path) -> None:
    """Left: tokens/s per router by mesh.expert. Right: switch per-expert tokens with aux loss off vs on."""
    fig, (left, right) = pyplot().subplots(1, 2, figsize=(13, 5))
    width = 0.8 / len(ROUTERS)
    for i, router in enumerate(ROUTERS):
        mine = [r for r in speed if r["router"] == router]
        left.bar(np.arange(len(mine)) + (i - 1) * width, [r["tokens_per_s"] for r in mine], width, label=router)
    left.set_xticks(range(len(EXPERT_DEGREES)), [f"expert={e}\ndata={len(DEVICES) // e}" for e in EXPERT_DEGREES])
    left.set(ylabel="tokens/s", title="Training throughput, 8 emulated CPU devices",
             ylim=(0, 1.2 * max(r["tokens_per_s"] for r in speed)))
    switch = [r for r in balance if r["router"] == "switch"]
    for i, run in enumerate(switch):
        tokens = run["expert_tokens"]
        right.bar(np.arange(len(tokens)) + (i - 0.5) * 0.4, tokens, 0.4,
                  label=f"aux_loss_weight={run['aux_loss_weight']:g} (load CV {run['load_cv']:.2f})")
    cfg = load_config(None, [f"run.dir={os.devnull}", *BASE, "mesh.data=8", "mesh.expert=1"])
    cfg = on_devices(cfg, DEVICES).cfg  # the group size those runs used
    moe, factor, tokens = cfg.model.moe, switch[0]["capacity_factor"], cfg.train.batch_size * cfg.model.seq_len
    right.axhline(tokens / moe.experts, color="gray", ls=":", label=f"even split of all {tokens} tokens")
    cap = capacity("switch", moe.group_size, moe.experts, 1, factor) * tokens // moe.group_size
    right.axhline(cap, color="red", ls="--", label=f"capacity (factor {factor:g})")
    right.set(xlabel="expert", ylabel="tokens kept per step (mean over MoE layers)",
              title=f"Switch router after {ARGS.train_steps} steps", ylim=(0, 1.4 * cap))
    left.legend(fontsize=8, loc="upper center", ncol=3)
    right.legend(fontsize=8, loc="upper center", ncol=2)
    save_figure(fig, path)


def main() -> int:
    """Run every layout and training run, print the tables and the JSON line, write the figure."""
    started = time.perf_counter()
    cfg = load_config(None, [f"run.dir={os.devnull}", *BASE])
    batches = host_batches(cfg, ARGS.warmup + ARGS.steps)
    print(run_line(DEVICES, cfg, ARGS.warmup, ARGS.steps) + " per layout", file=sys.stderr)
    speed = [throughput_row(r, e, batches) for r in ROUTERS for e in EXPERT_DEGREES]
    capacity = [train_run("switch", capacity=c) for c in CAPACITIES]
    balance = [train_run(r, aux=a) for r in ("switch", "topk") for a in AUX_WEIGHTS]
    train_run("expert_choice")

    print(f"MoE ({' '.join(BASE)}), {len(DEVICES)} emulated {DEVICES[0].platform} devices\n")
    print("Table 1: throughput and routing by router x expert-parallel degree\n")
    print(markdown(["router", "mesh", "step ms", "tokens/s", "dropped fraction", "unrouted fraction", "load CV",
                    "all-to-all B/step"],
                   [[r["router"], f"expert={r['expert']} x data={r['data']}", f"{r['median_step_ms']:.1f}",
                     f"{r['tokens_per_s']:,.0f}", _fraction(r["dropped_fraction"]),
                     _fraction(r["unrouted_fraction"]), f"{r['load_cv']:.3f}",
                     f"{r['all_to_all_bytes']:,}"] for r in speed]) + "\n")
    print(f"Table 2: switch router, capacity factor, after {ARGS.train_steps} steps (mesh.data=8)\n")
    print(markdown(["capacity factor", "dropped fraction", "load CV", "final loss"],
                   [[f"{r['capacity_factor']:g}", _fraction(r["dropped_fraction"]), f"{r['load_cv']:.3f}",
                     f"{r['final_loss']:.3f}"] for r in capacity]) + "\n")
    print(f"Table 3: auxiliary load-balancing loss off vs on, after {ARGS.train_steps} steps (capacity 1.25)\n")
    print(markdown(["router", "aux_loss_weight", "load CV", "dropped fraction", "final loss", "tokens per expert"],
                   [[r["router"], f"{r['aux_loss_weight']:g}", f"{r['load_cv']:.3f}", _fraction(r["dropped_fraction"]),
                     f"{r['final_loss']:.3f}", " ".join(f"{t:.0f}" for t in r["expert_tokens"])]
                    for r in balance]) + "\n")
    print(f"Table 4: loss over every training run (first vs last logged step, {ARGS.train_steps} steps)\n")
    runs = list(_RUNS.values())
    print(markdown(["router", "capacity factor", "aux_loss_weight", "first loss", "final loss", "falls"],
                   [[r["router"], f"{r['capacity_factor']:g}", f"{r['aux_loss_weight']:g}", f"{r['first_loss']:.3f}",
                     f"{r['final_loss']:.3f}", "yes" if r["final_loss"] < r["first_loss"] else "NO"]
                    for r in runs]) + "\n")
    plot(speed, balance, OUT_PNG)
    print(f"figure: {OUT_PNG}; total {time.perf_counter() - started:.0f} s", file=sys.stderr)
    print(json.dumps({"overrides": BASE, "timed_steps": ARGS.steps, "warmup": ARGS.warmup,
                      "train_steps": ARGS.train_steps, "throughput": speed, "capacity": capacity,
                      "balance": balance, "runs": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
