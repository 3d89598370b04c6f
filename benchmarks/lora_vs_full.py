"""LoRA against full fine-tuning from the same trained base, on the same data and steps.

The built-in corpus's documents are split in two halves, each written as .txt files and tokenized
with one tokenizer (trained on the first half). The default model (with a SwiGLU MLP, so that it is
a Llama-family checkpoint) trains on the first half, is exported as a Hugging Face checkpoint, and
then adapts to the second half twice from it: every weight (full fine-tuning), and rank-r LoRA
adapters on q, k, v, o, gate, up and down. Both runs see the same batches; the figures are their
train and validation losses on the second half.

    .venv/bin/python benchmarks/lora_vs_full.py [--base-steps 300] [--steps 100] [--rank 16]
        [--lora-lr 1e-2] [--work /tmp/lora_vs_full]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from jaxpar.data.corpus import builtin_topics

JAXPAR = [sys.executable, "-m", "jaxpar"]
COMMON = ["--no-progress", "configs/default.yaml", "model.mlp=swiglu", "train.sample_tokens=0", "train.log_every=10"]


def run(args: list[str]) -> None:
    print("+ jaxpar", " ".join(args), flush=True)
    subprocess.run(JAXPAR + args, check=True)


def halves(work: Path) -> tuple[list[str], list[str]]:
    """The built-in documents, alternately into two halves, a .txt file each."""
    files: tuple[list[str], list[str]] = ([], [])
    for i, text in enumerate(builtin_topics()):
        folder = work / f"half{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{i:03d}.txt").write_text(text)
        files[i % 2].append(str(folder / f"{i:03d}.txt"))
    return files


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-steps", type=int, default=300)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3, help="full fine-tuning's peak learning rate")
    p.add_argument("--lora-lr", type=float, default=1e-2, help="the adapters' peak learning rate")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--work", default="/tmp/lora_vs_full")
    a = p.parse_args()
    work = Path(a.work)
    shutil.rmtree(work, ignore_errors=True)
    first, second = halves(work)
    run(["tokenize", "--input", *first, "--vocab-size", str(a.vocab), "--out", str(work / "tok0"), "--no-progress"])
    run(["tokenize", "--input", *second, "--tokenizer", str(work / "tok0"), "--out", str(work / "tok1"),
         "--no-progress"])
    vocab = json.loads((work / "tok0" / "meta.json").read_text())["vocab_size"]
    shape = [f"model.vocab_size={vocab}"]
    run(["train", *COMMON, *shape, f"data.source={work / 'tok0'}", f"train.steps={a.base_steps}",
         f"run.dir={work / 'base'}"])
    run(["export-hf", str(work / "base"), "--out", str(work / "base_hf"), "--dtype", "fp32", "--no-progress"])
    adapt = [f"model.from_hf={work / 'base_hf'}", f"data.source={work / 'tok1'}", f"train.steps={a.steps}",
             "train.warmup=10", "train.eval_batches=8"]
    run(["train", *COMMON, *adapt, f"train.lr={a.lr}", f"run.dir={work / 'full'}"])
    run(["train", *COMMON, *adapt, f"train.lr={a.lora_lr}", f"model.lora.rank={a.rank}", f"run.dir={work / 'lora'}"])
    full, lora = summary(work / "full"), summary(work / "lora")
    rows = {name: {key: s[key] for key in ("first_loss", "final_loss", "val_loss") if key in s}
            for name, s in (("full", full), ("lora", lora))}
    print(json.dumps({"base_steps": a.base_steps, "steps": a.steps, "rank": a.rank, "lr": a.lr,
                      "lora_lr": a.lora_lr, **rows}))


if __name__ == "__main__":
    main()
