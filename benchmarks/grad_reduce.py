"""bf16 gradient reductions against fp32: the loss curve over N steps and the bytes sent.

Usage:
    python benchmarks/grad_reduce.py [key=value ...] [--steps N]

Model: jaxpar's defaults (fp32 compute) on the builtin corpus, mesh.data=8 with parallel.zero=2,
N steps (default 200), then the key=value overrides; parallel.grad_reduce_dtype fp32, then bf16,
from the same initial weights on the same batches.
Printed: a markdown table (the largest relative gap between the two loss curves, over every step and
after the first 20, the final losses; bytes each device sends over `data` per step, read from the
compiled step: `jaxpar.plan.measure_step`, ring algorithms; tokens/s = batch x seq_len / the median
step, every step waited for, the first left out), then one JSON line with every number;
the figure goes to benchmarks/results/grad_reduce.png.
"""

from __future__ import annotations

import json
import sys

from common import RESULTS, curves_setup, data_axis_bytes_sent, markdown, pyplot, save_figure, train_losses


def main() -> int:
    steps, base, devices = curves_setup(__doc__, steps=200, min_steps=21,
                                        layout=["mesh.data=8", "mesh.tensor=1", "parallel.zero=2"])
    curves, sent, speed = {}, {}, {}
    for dtype in ("fp32", "bf16"):
        cfg = base.replace(**{"parallel.grad_reduce_dtype": dtype})
        print(f"grad_reduce: {dtype}, {steps} steps", file=sys.stderr)
        curves[dtype], seconds = train_losses(cfg, devices, steps)
        speed[dtype] = cfg.train.batch_size * cfg.model.seq_len / seconds
        sent[dtype] = data_axis_bytes_sent(cfg, devices)
    gaps = [abs(b - f) / f for f, b in zip(curves["fp32"], curves["bf16"])]
    print(markdown(["reduction", "final loss", "max rel gap", "max rel gap after step 20", "MiB sent per step",
                    "tokens/s (median step)"], [
        [d, f"{curves[d][-1]:.4f}", "-" if d == "fp32" else f"{max(gaps):.2e}",
         "-" if d == "fp32" else f"{max(gaps[20:]):.2e}", f"{sent[d] / 2**20:.2f}", f"{speed[d]:.0f}"]
        for d in ("fp32", "bf16")]))
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for dtype in curves:
        ax.plot(range(1, steps + 1), curves[dtype], label=f"gradients reduced in {dtype}", lw=1)
    ax.set(xlabel="step", ylabel="training loss", title="mesh.data=8, ZeRO-2, fp32 compute")
    ax.legend()
    save_figure(fig, RESULTS / "grad_reduce.png")
    print(json.dumps({"steps": steps, "final_loss": {d: c[-1] for d, c in curves.items()},
                      "max_rel_gap": max(gaps), "max_rel_gap_after_20": max(gaps[20:]),
                      "data_bytes_sent_per_step": sent, "tokens_per_s": speed}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
