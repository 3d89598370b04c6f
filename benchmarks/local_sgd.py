"""Local SGD (DiLoCo style): loss against step and against bytes sent over `data`, for H in {1, 4, 16}
and both outer rules, and the H=8 run against synchronous training.

Usage:
    python benchmarks/local_sgd.py [key=value ...] [--steps N]

Model: jaxpar's defaults (4 layers, d_model 128, batch 32 x 128, AdamW lr 3e-3) on the builtin
corpus, mesh.data=4 x mesh.tensor=2 (8 emulated CPU devices), N steps (default 120), then the
key=value overrides. Each run trains from the same initial weights on the same batches.
  * H=1 is synchronous data parallelism (a gradient all-reduce over data in every step).
  * H>1 with parallel.outer=avg (the replicas' weights averaged every H steps) and =nesterov
    (outer_lr 0.7, outer_momentum 0.9: DiLoCo's values, jaxpar's defaults).
Bytes: what each device sends over `data` per step (H=1) or per synchronization (H>1), read from the
compiled step (`jaxpar.plan.measure_step`, ring algorithms; a conditional's branch counted once), times
the steps or synchronizations so far. Tensor-parallel traffic inside a replica is the same for every
run and left out.
Printed: a markdown table (final loss = mean of the last 10 steps' training losses, and its ratio to
H=1; the last step's loss and its ratio; tokens/s = batch x seq_len / the median step, every step
waited for, the first (compiling) one left out), then one JSON line with every number; the figure
(10-step running means of the loss) goes to benchmarks/results/local_sgd.png.
"""

from __future__ import annotations

import json
import sys

from common import RESULTS, curves_setup, data_axis_bytes_sent, markdown, pyplot, save_figure, train_losses

RUNS = [(1, "avg"), (4, "avg"), (4, "nesterov"), (8, "avg"), (8, "nesterov"), (16, "avg"), (16, "nesterov")]


def _running_mean(values: list[float], window: int) -> list[float]:
    return [sum(values[max(0, i + 1 - window):i + 1]) / (i + 1 - max(0, i + 1 - window)) for i in range(len(values))]


def main() -> int:
    steps, base, devices = curves_setup(__doc__, steps=120, min_steps=10, layout=["mesh.data=4", "mesh.tensor=2"])
    results = []
    for H, outer in RUNS:
        cfg = base.replace(**{"parallel.sync_every": H, "parallel.outer": outer})
        print(f"local_sgd: H={H} outer={outer}, {steps} steps", file=sys.stderr)
        losses, seconds = train_losses(cfg, devices, steps)
        per_event = data_axis_bytes_sent(cfg, devices)
        events = [(s + 1) // H for s in range(steps)]  # steps (H=1) or synchronizations so far
        results.append({"H": H, "outer": outer if H > 1 else "sync", "losses": losses,
                        "bytes_per_event": per_event, "bytes": [n * per_event for n in events],
                        "final_loss": sum(losses[-10:]) / 10, "last_loss": losses[-1],
                        "tokens_per_s": cfg.train.batch_size * cfg.model.seq_len / seconds})
    sync = results[0]["final_loss"]
    last = results[0]["last_loss"]
    rows = [[r["H"], r["outer"], f"{r['final_loss']:.4f}", f"{r['final_loss'] / sync:.3f}",
             f"{r['last_loss']:.4f}", f"{r['last_loss'] / last:.3f}", f"{r['bytes_per_event'] / 2**20:.2f}",
             f"{r['bytes'][-1] / 2**20:.1f}", f"{r['tokens_per_s']:.0f}"] for r in results]
    print(markdown(["H", "outer", "final loss (mean of last 10)", "vs H=1", "last step's loss", "vs H=1",
                    "MiB sent per sync", "MiB sent in all", "tokens/s (median step)"], rows))
    plt = pyplot()
    fig, (by_step, by_bytes) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        label = "H=1 (synchronous)" if r["H"] == 1 else f"H={r['H']} {r['outer']}"
        smooth = _running_mean(r["losses"], 10)
        by_step.plot(range(1, steps + 1), smooth, label=label, lw=1)
        # one point per synchronization (H=1: per step): the bytes sent so far, the loss then
        at = [s for s in range(steps) if (s + 1) % r["H"] == 0]
        by_bytes.plot([r["bytes"][s] / 2**20 for s in at], [smooth[s] for s in at], label=label, lw=1,
                      marker="." if r["H"] > 1 else None)
    by_step.set(xlabel="step", ylabel="training loss (mean of the last 10 steps)", title="loss against step")
    by_bytes.set(xlabel="MiB sent per device over data (log)", ylabel="training loss (mean of the last 10 steps)",
                 xscale="log", title="loss against bytes communicated")
    by_step.legend(fontsize=8)
    save_figure(fig, RESULTS / "local_sgd.png")
    print(json.dumps({"steps": steps, "runs": [{k: v for k, v in r.items() if k not in ("losses", "bytes")}
                                                    for r in results]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
