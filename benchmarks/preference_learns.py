"""A preference objective learns to tell a right continuation from a corrupted one.

A synthetic preference set from the built-in corpus: each record's prompt is a stretch of a
paragraph, its chosen response the words that follow, its rejected response the same words in
reverse order. The default model (SwiGLU) first trains on the corpus as plain text, is exported,
and then trains with the objective (DPO by default, on rank-r LoRA adapters, whose reference is
the base with the adapters off) on the pairs. The pair accuracy (chosen reward > rejected) and the
reward margin are read from metrics.jsonl (every step's batch of about 32 pairs): at the first step,
over the first 10 steps, and over the last `--last` steps.

    .venv/bin/python benchmarks/preference_learns.py [--objective dpo] [--steps 150] [--rank 16]
        [--work /tmp/preference_learns]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

from jaxpar.data.corpus import builtin_topics

JAXPAR = [sys.executable, "-m", "jaxpar"]
COMMON = ["--no-progress", "configs/default.yaml", "model.mlp=swiglu", "train.sample_tokens=0", "train.log_every=5"]


def run(args: list[str]) -> None:
    print("+ jaxpar", " ".join(args), flush=True)
    subprocess.run(JAXPAR + args, check=True)


def records(count: int, seed: int = 0) -> list[dict]:
    """Prompt: 12 words of a paragraph; chosen: the next 8; rejected: those 8 reversed."""
    rng, out = random.Random(seed), []
    words = [w for text in builtin_topics() for w in text.split()]
    while len(out) < count:
        at = rng.randrange(len(words) - 20)
        prompt, follow = words[at:at + 12], words[at + 12:at + 20]
        if follow != follow[::-1]:
            out.append({"prompt": " ".join(prompt) + " ", "chosen": " ".join(follow),
                        "rejected": " ".join(reversed(follow))})
    return out


def logged(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if '"rewards/chosen"' in line]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--objective", default="dpo", choices=("dpo", "simpo", "orpo"))
    p.add_argument("--base-steps", type=int, default=200)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--last", type=int, default=25, help="steps averaged at the end")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--pairs", type=int, default=4000)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--work", default="/tmp/preference_learns")
    a = p.parse_args()
    work = Path(a.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    text = work / "corpus.txt"
    text.write_text("\n\n".join(builtin_topics()))
    pairs = work / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in records(a.pairs)))
    run(["tokenize", "--input", str(text), "--split", "paragraphs", "--vocab-size", "512", "--out",
         str(work / "tok"), "--no-progress"])
    run(["tokenize", "--input", str(pairs), "--tokenizer", str(work / "tok"), "--preference", "--field-prompt",
         "prompt", "--field-chosen", "chosen", "--field-rejected", "rejected", "--out", str(work / "pairs"),
         "--no-progress"])
    vocab = json.loads((work / "tok" / "meta.json").read_text())["vocab_size"]
    run(["train", *COMMON, f"model.vocab_size={vocab}", f"data.source={work / 'tok'}", f"train.steps={a.base_steps}",
         f"run.dir={work / 'base'}"])
    run(["export-hf", str(work / "base"), "--out", str(work / "base_hf"), "--dtype", "fp32", "--no-progress"])
    adapters = [f"model.lora.rank={a.rank}"] if a.rank else []
    run(["train", *COMMON, f"model.from_hf={work / 'base_hf'}", f"data.source={work / 'pairs'}", "data.packing=pack",
         f"train.objective={a.objective}", f"train.preference.beta={a.beta}", f"train.steps={a.steps}",
         f"train.lr={a.lr}", "train.warmup=5", "train.log_every=1", *adapters, f"run.dir={work / 'tuned'}"])
    rows = logged(work / "tuned")
    keys = ("loss", "accuracy", "margin", "rewards/chosen", "rewards/rejected")
    mean = lambda part: {k: round(sum(r[k] for r in part) / len(part), 4) for k in keys}  # noqa: E731
    print(json.dumps({"objective": a.objective, "rank": a.rank, "beta": a.beta, "steps": a.steps,
                      "step 1": mean(rows[:1]), "steps 1-10": mean(rows[:10]),
                      f"last {a.last} steps": mean(rows[-a.last:])}))


if __name__ == "__main__":
    main()
