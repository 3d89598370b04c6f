"""Load balance with an auxiliary loss against bias balancing: the default model with 8 top-2 experts.

Trains `configs/default.yaml` (data=4 x tensor=2 on 8 emulated CPU devices) with
`model.moe.experts=8 model.moe.router=topk model.moe.top_k=2 model.moe.noise=false`, once with
`model.moe.balance=aux` (the default auxiliary loss, weight model.moe.aux_loss_weight) and once with
`balance=bias` (no auxiliary loss), and reads each step's `moe_max_load`: the busiest expert's
chosen assignments over the mean, per MoE layer and device, averaged. Prints a table of the curves
every 25 steps and the mean of the last 50 steps, and draws both curves.

    python benchmarks/moe_balance.py --steps 300 --plot benchmarks/results/moe_balance.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MOE = ["model.moe.experts=8", "model.moe.router=topk", "model.moe.top_k=2", "model.moe.noise=false"]
BALANCES = ("aux", "bias")


def one_run(balance: str, steps: int, folder: Path) -> list[dict]:
    run_dir = folder / balance
    subprocess.run([sys.executable, "-m", "jaxpar", "train", "configs/default.yaml", *MOE,
                    f"model.moe.balance={balance}", f"train.steps={steps}", "train.sample_tokens=0",
                    "train.log_every=1", f"run.dir={run_dir}", "--no-progress"],
                   cwd=REPO, check=True, capture_output=True, text=True)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def plot(curves: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (load, loss) = plt.subplots(1, 2, figsize=(10, 4))
    for balance, rows in curves.items():
        steps = [r["step"] for r in rows]
        load.plot(steps, [r["moe_max_load"] for r in rows], label=f"balance={balance}")
        loss.plot(steps, [r["loss"] for r in rows], label=f"balance={balance}")
    load.axhline(1.3, color="grey", linestyle=":", label="1.3")
    load.set(xlabel="step", ylabel="max / mean expert load", title="busiest expert (per layer and device)")
    loss.set(xlabel="step", ylabel="train loss", title="loss")
    load.legend(), loss.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="steps per run (default %(default)s)")
    parser.add_argument("--plot", type=Path, help="where to draw the curves (a .png)")
    args = parser.parse_args()
    curves = {}
    for balance in BALANCES:
        with tempfile.TemporaryDirectory() as folder:
            curves[balance] = one_run(balance, args.steps, Path(folder))
        print(f"{balance}: done", file=sys.stderr)
    print("| step | " + " | ".join(f"max/mean load, {b}" for b in BALANCES) + " | "
          + " | ".join(f"loss, {b}" for b in BALANCES) + " |")
    print("| ---: |" + " ---: |" * (2 * len(BALANCES)))
    for index in [0, *range(24, args.steps, 25)]:
        rows = [curves[b][index] for b in BALANCES]
        print(f"| {rows[0]['step']} | " + " | ".join(f"{r['moe_max_load']:.3f}" for r in rows) + " | "
              + " | ".join(f"{r['loss']:.3f}" for r in rows) + " |")
    tail = min(50, args.steps)
    for b in BALANCES:
        print(f"{b}: mean max/mean load over the last {tail} steps "
              f"{statistics.mean(r['moe_max_load'] for r in curves[b][-tail:]):.3f}, final loss "
              f"{curves[b][-1]['loss']:.3f}")
    if args.plot:
        plot(curves, args.plot)


if __name__ == "__main__":
    main()
