"""fp8 against bf16 on the quick-start model: the same 300 steps, seed and batches, two loss curves.

`jaxpar train configs/default.yaml` (the README's `bash run.sh train`: the default model on 8 emulated
CPU devices, data=4 x tensor=2) runs twice, train.precision=bf16 and train.precision=fp8, each logging
every step. The script prints both final losses (the last step's, on the same batch), their ratio, the
mean of the last 20 steps, the validation losses and the median tokens/s, and writes both curves as
JSON. Not a timing benchmark: XLA:CPU emulates the fp8 GEMMs (it upcasts their operands inside the dot).

    .venv/bin/python benchmarks/fp8_vs_bf16.py [--steps 300] [--work /tmp/fp8_vs_bf16]
        [--out benchmarks/results/fp8_vs_bf16.json] [key=value ...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import subprocess
import sys
from pathlib import Path

from common import RESULTS, git_commit

JAXPAR = [sys.executable, "-m", "jaxpar"]
PRECISIONS = ("bf16", "fp8")
LAST = 20  # steps in the late mean


def run(args: list[str]) -> None:
    print("+ jaxpar", " ".join(args), flush=True)
    subprocess.run(JAXPAR + args, check=True)


def curve(run_dir: Path) -> list[float]:
    """Every step's training loss, from metrics.jsonl (train.log_every=1)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if "loss" in row]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("overrides", nargs="*", help="key=value config overrides, for both runs")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--work", default="/tmp/fp8_vs_bf16")
    p.add_argument("--out", default=str(RESULTS / "fp8_vs_bf16.json"))
    a = p.parse_args()
    work = Path(a.work)
    shutil.rmtree(work, ignore_errors=True)
    runs = {}
    for precision in PRECISIONS:
        run_dir = work / precision
        run(["train", "--no-progress", "configs/default.yaml", f"train.precision={precision}",
             f"train.steps={a.steps}", "train.log_every=1", "train.sample_tokens=0", f"run.dir={run_dir}",
             *a.overrides])
        summary = json.loads((run_dir / "summary.json").read_text())
        losses = curve(run_dir)
        runs[precision] = {"final_loss": summary["final_loss"], "val_loss": summary["val_loss"],
                           f"last_{LAST}_mean": sum(losses[-LAST:]) / len(losses[-LAST:]),
                           "tokens_per_s_median": summary["tokens_per_s_median"], "losses": losses}
    bf16, fp8 = runs["bf16"], runs["fp8"]
    ratio = fp8["final_loss"] / bf16["final_loss"]
    result = {"commit": git_commit(), "date": str(datetime.date.today()), "steps": a.steps,
              "overrides": a.overrides, "final_loss_ratio": ratio, **runs}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result) + "\n")
    print("\n| precision | final loss | mean of the last 20 | validation loss | tokens/s (median) |\n"
          "|---|---|---|---|---|")
    for precision in PRECISIONS:
        r = runs[precision]
        print(f"| {precision} | {r['final_loss']:.4f} | {r[f'last_{LAST}_mean']:.4f} | {r['val_loss']:.4f} | "
              f"{r['tokens_per_s_median']:.0f} |")
    print(f"\nfp8 / bf16 final loss: {ratio:.4f} ({(ratio - 1):+.2%}); curves in {a.out}")


if __name__ == "__main__":
    main()
