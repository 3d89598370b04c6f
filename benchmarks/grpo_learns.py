"""GRPO learns a toy verifiable task that the quick-start model cannot do at first.

The task is configs/grpo_numbers.yaml: after 48 prompts such as "How many files are there? ", the reward
is 1 when the completion starts with a digit (rl.reward=regex, ^[0-9]), else 0. The quick-start model
(the default model after its 300 steps on the built-in corpus) writes words there. GRPO starts from it
(model.from_run) on the emulated 8-device mesh (data=4 x tensor=2) and samples 8 completions of 4
prompts each step. The mean reward of every step is read from metrics.jsonl; the task is learned when
the mean of the last 5 steps reaches r0 + 0.5 (1 - r0), r0 the mean of the first 3.

    .venv/bin/python benchmarks/grpo_learns.py [--from-run runs/default] [--steps 30]
        [--work /tmp/grpo_learns]
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import subprocess
import sys
from pathlib import Path

from common import git_commit, machine_line, machine_record

JAXPAR = [sys.executable, "-m", "jaxpar"]


def run(args: list[str]) -> None:
    print("+ jaxpar", " ".join(args), flush=True)
    subprocess.run(JAXPAR + args, check=True)


def rewards(run_dir: Path) -> list[tuple[int, float, float, float]]:
    """(step, mean reward, KL, sampling's share of the step) of every logged step."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["reward_mean"], r["kl"], r["generate_share"]) for r in rows]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--from-run", help="a finished quick-start run (default: train one under --work)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--work", default="/tmp/grpo_learns")
    args = p.parse_args()
    work = Path(args.work)
    shutil.rmtree(work / "grpo", ignore_errors=True)
    base = Path(args.from_run) if args.from_run else work / "quick_start"
    if not args.from_run:
        shutil.rmtree(base, ignore_errors=True)
        run(["train", "--no-progress", "configs/default.yaml", f"run.dir={base}", "train.sample_tokens=0"])
    run(["train", "--no-progress", "configs/grpo_numbers.yaml", f"model.from_run={base}",
         f"train.steps={args.steps}", f"run.dir={work / 'grpo'}"])
    curve = rewards(work / "grpo")
    r0 = sum(r for _, r, _, _ in curve[:3]) / 3
    last = sum(r for _, r, _, _ in curve[-5:]) / 5
    goal = r0 + 0.5 * (1 - r0)
    import jax  # after the runs, which set up their own devices

    record = machine_record(jax.devices()[:1], ("float32",))
    print(f"\ncommit {git_commit()}, {datetime.date.today()}, {machine_line(record)}\n")
    print("| step | mean reward | KL | sampling share |\n|---|---|---|---|")
    for step, reward, kl, share in curve:
        if step in (1, 2, 3) or step % 5 == 0:
            print(f"| {step} | {reward:.3f} | {kl:.3f} | {share:.0%} |")
    print(f"\nr0 (first 3 steps) {r0:.3f}, last 5 steps {last:.3f}, goal r0 + 0.5 (1 - r0) = {goal:.3f}: "
          f"{'reached' if last >= goal else 'NOT reached'}")


if __name__ == "__main__":
    main()
