"""Packed rows against plain windows: tokens/s of document tokens on the default model, alternately.

Each round trains `configs/default.yaml` (data=4 x tensor=2 on 8 emulated CPU devices, the built-in
corpus: a document per topic) once with data.packing=none and once with pack, each in its own
process, and reads the run's median tokens/s (jaxpar counts document tokens only, so padding is not
credited to pack) and its mean packing efficiency. The table gives the medians over rounds and the
ratio pack / none.

    python benchmarks/packing.py --rounds 3 --steps 30
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
MODES = ("none", "pack")


def one_run(mode: str, steps: int, folder: Path) -> tuple[float, float]:
    """(median tokens/s, mean packing efficiency) of one training run."""
    run_dir = folder / f"{mode}"
    subprocess.run([sys.executable, "-m", "jaxpar", "train", "configs/default.yaml", f"data.packing={mode}",
                    f"train.steps={steps}", "train.sample_tokens=0", "train.log_every=1", f"run.dir={run_dir}",
                    "--no-progress"], cwd=REPO, check=True, capture_output=True, text=True)
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    efficiency = statistics.mean(r.get("packing_efficiency", 1.0) for r in rows)
    return summary["tokens_per_s_median"], efficiency


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default %(default)s)")
    parser.add_argument("--steps", type=int, default=30, help="steps per run (default %(default)s)")
    args = parser.parse_args()
    results: dict[str, list] = {mode: [] for mode in MODES}
    for r in range(args.rounds):
        for mode in MODES:
            with tempfile.TemporaryDirectory() as folder:
                results[mode].append(one_run(mode, args.steps, Path(folder)))
            print(f"round {r + 1} {mode}: {results[mode][-1][0]:.0f} tokens/s, efficiency "
                  f"{results[mode][-1][1]:.3f}", file=sys.stderr)
    median = {mode: statistics.median(t for t, _ in results[mode]) for mode in MODES}
    print("| data.packing | document tokens/s (median of rounds) | packing efficiency | each round |")
    print("| --- | ---: | ---: | --- |")
    for mode in MODES:
        rounds = ", ".join(f"{t:.0f}" for t, _ in results[mode])
        print(f"| {mode} | {median[mode]:.0f} | {statistics.mean(e for _, e in results[mode]):.3f} | {rounds} |")
    print(f"\npack / none: {median['pack'] / median['none']:.3f}")


if __name__ == "__main__":
    main()
