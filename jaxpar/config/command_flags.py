"""The flags of `jaxpar tokenize`, `jaxpar export-hf` and `jaxpar generate`, and the checks of `jaxpar schedule`'s and
`jaxpar launch`'s, made before anything starts.

Every failure is a ConfigError with one sentence saying what to change. Pure Python (no jax).
"""

from __future__ import annotations

import argparse

from jaxpar.config import ConfigError

LAUNCHABLE_COMMANDS = ("train", "verify", "plan")


def check_schedule_flags(schedule: str, stages: int, microbatches: int, virtual: int, schedules: tuple,
                         costs: str = "1,1,1") -> tuple[float, ...]:
    """The flags of `jaxpar schedule`: one of `schedules`, positive sizes, what interleaving and zbv
    need, and --costs: returns its three non-negative numbers F,B,W."""
    if schedule not in schedules:
        raise ConfigError(f"--schedule must be one of {', '.join(schedules)}, got {schedule!r}.")
    if stages < 1 or microbatches < 1 or virtual < 1:
        raise ConfigError("--stages, --microbatches and --virtual must be positive.")
    if virtual > 1 and schedule != "interleaved":
        raise ConfigError(f"--virtual {virtual} needs --schedule interleaved.")
    if schedule == "interleaved" and microbatches % stages:
        raise ConfigError(f"interleaved 1F1B needs --microbatches to be a multiple of --stages ({stages}).")
    if schedule == "naive" and microbatches > 1:
        raise ConfigError(f"the naive schedule runs one batch through the stages, no microbatches: give "
                          f"--microbatches 1 (got {microbatches}).")
    if schedule == "zbv" and microbatches < stages:
        raise ConfigError(f"the zbv schedule needs at least as many microbatches as stages, got --microbatches "
                          f"{microbatches} < --stages {stages}.")
    numbers = [float(c) if c.strip().replace(".", "", 1).isdigit() else -1.0 for c in costs.split(",")]
    if len(numbers) != 3 or min(numbers) < 0 or numbers[0] + numbers[1] <= 0:
        raise ConfigError(f"--costs must be three non-negative numbers F,B,W with F + B > 0, got {costs!r}.")
    return tuple(numbers)


def check_launch_flags(processes: int, devices_per_process: int | None, command: list[str]) -> None:
    """The flags of `jaxpar launch`: positive counts, and a command to run after '--'."""
    if processes < 1:
        raise ConfigError(f"--processes must be positive, got {processes}.")
    if devices_per_process is not None and devices_per_process < 1:
        raise ConfigError(f"--devices-per-process must be positive, got {devices_per_process}.")
    if not command or command[0] not in LAUNCHABLE_COMMANDS:
        raise ConfigError("give the jaxpar command to run after '--', e.g. "
                          "'jaxpar launch --processes 2 -- train mesh.tensor=4'.")


def add_tokenize_flags(p: argparse.ArgumentParser) -> None:
    """`jaxpar tokenize`: the documents to read, how, and the tokenizer to train or apply."""
    p.add_argument("--input", nargs="+", metavar="PATH",
                   help="files, folders or globs: .txt (UTF-8; a document per file), .jsonl, .jsonl.gz, .jsonl.zst (a "
                        "document per line), .parquet (per row), or a folder `datasets` saved (its Arrow files)")
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="processes encoding at once, each with one thread (default 1: this process, with the "
                        "tokenizer's own threads)")
    p.add_argument("--shard", metavar="I/N", help="do the I-th of N parts of the work (units I, I+N, ...), for N tasks "
                   "of a job array; join their --out folders with --merge")
    p.add_argument("--unit-mb", type=float, default=8.0, metavar="MB",  # work_units.UNIT_BYTES
                   help="the work's unit: MB of a plain .jsonl or .txt file (other files are a unit each) that a "
                        "worker takes at a time and an interrupted run redoes (default 8)")
    p.add_argument("--merge", nargs="+", metavar="DIR", help="join the folders of a run's --shard tasks into --out "
                   "(instead of --input)")
    p.add_argument("--split", choices=("file", "paragraphs"), default="file",
                   help=".txt files: a document per file, or per blank-line-separated paragraph")
    p.add_argument("--field", metavar="NAME", help=".jsonl: the field holding each document's text")
    p.add_argument("--column", metavar="NAME", help=".parquet: the column holding each document's text")
    p.add_argument("--sft", action="store_true",
                   help="fine-tuning pairs: the loss counts the response tokens only (with --field-prompt and "
                        "--field-response, fields of .jsonl lines or columns of .parquet rows)")
    p.add_argument("--chat", action="store_true",
                   help="fine-tuning chats: each record's messages (--field/--column, default 'messages': a list of "
                        "{role, content}), rendered with the tokenizer's chat template where it has one; the loss "
                        "counts the assistant's messages only")
    p.add_argument("--preference", action="store_true",
                   help="preference pairs (for train.objective=dpo, simpo or orpo): each record's prompt with a chosen "
                        "and a rejected response (--field-prompt, --field-chosen, --field-rejected), written as two "
                        "documents, chosen first; with --chat, two conversations (--field-chosen, --field-rejected, "
                        "default 'chosen' and 'rejected') that differ only in their last, assistant message")
    p.add_argument("--field-prompt", metavar="NAME", help="--sft, --preference: the prompt's field (column)")
    p.add_argument("--field-response", metavar="NAME", help="--sft: the response's field (column)")
    p.add_argument("--field-chosen", metavar="NAME", help="--preference: the chosen response's field (column)")
    p.add_argument("--field-rejected", metavar="NAME", help="--preference: the rejected response's field (column)")
    p.add_argument("--vocab-size", type=int,
                   help="vocabulary of the tokenizer to train (at least 258: the bytes, the end-of-document token, "
                        "a merge)")
    p.add_argument("--tokenizer", metavar="FILE|DIR",
                   help="apply this tokenizer.json (or the one in this folder: a Hugging Face checkpoint, a tokenized "
                        "folder) instead of training one")
    p.add_argument("--out", required=True, metavar="DIR", help="the folder to write (new or empty)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def add_export_flags(p: argparse.ArgumentParser) -> None:
    """`jaxpar export-hf`'s flags."""
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's folder (run.dir)")
    p.add_argument("--out", required=True, metavar="DIR", help="the folder to write (new or empty)")
    p.add_argument("--step", type=int, help="the checkpoint's step (default: the newest)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                   help="dtype of the written weights (default bf16)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--adapter", action="store_true", help="a run with LoRA adapters: write the adapters alone, "
                   "as peft stores them (adapter_config.json, adapter_model.safetensors)")
    p.add_argument("--merge", action="store_true", help="a run with LoRA adapters: write full weights with the "
                   "adapters merged in")


def add_generate_flags(p: argparse.ArgumentParser) -> None:
    """`jaxpar generate`'s flags: one prompt, or a file of them in batches on a mesh."""
    p.add_argument("source", metavar="RUN_DIR|HF_DIR", help="a run's folder (its newest checkpoint) or a Hugging Face "
                                                           "checkpoint folder")
    p.add_argument("settings", nargs="*", metavar="KEY=VALUE", help="with --prompts: the layout, as for train "
                   "(mesh.data=4 mesh.tensor=2, parallel.zero=3, train.precision=bf16)")
    p.add_argument("--prompt", help="the text to continue (one prompt, on one device)")
    p.add_argument("--prompts", metavar="FILE.jsonl", help="a file of prompts, one JSON record a line with a 'prompt' "
                   "field, continued in batches on the mesh; needs --out")
    p.add_argument("--out", metavar="FILE.jsonl", help="with --prompts: where the completions go (the prompt's record "
                   "with completion, new_tokens and stopped)")
    p.add_argument("--batch", type=int, default=8, help="with --prompts: rows a batch (default 8)")
    p.add_argument("--tokens", type=int, default=64, help="new tokens at most (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); else sample from "
                                                                  "softmax(logits / temperature)")
    p.add_argument("--top-k", type=int, default=0, help="with --prompts: sample from the k likeliest tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="with --prompts: sample from the fewest likeliest tokens "
                   "whose probability reaches p (1: all)")
    p.add_argument("--seed", type=int, default=0, help="the sampling seed")
    p.add_argument("--step", type=int, help="a run's checkpoint step (default: the newest)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def add_eval_flags(p: argparse.ArgumentParser) -> None:
    """`jaxpar eval`'s flags: the model, the tasks, and how they run."""
    p.add_argument("source", metavar="RUN_DIR|HF_DIR", help="a run's folder (its newest checkpoint, or --step) or a "
                                                           "Hugging Face checkpoint folder")
    p.add_argument("settings", nargs="*", metavar="KEY=VALUE", help="the layout, as for train (mesh.data=4 "
                   "mesh.tensor=2, parallel.zero=3, train.precision=fp32)")
    p.add_argument("--tasks", required=True, metavar="T1,T2", help="task YAML files, jaxpar's own tasks "
                   "(configs/evals: colors_mc, colors_qa, colors_text) or names lm-eval knows (hellaswag, "
                   "arc_easy, ...)")
    p.add_argument("--limit", type=int, metavar="N", help="documents a task at most (default: all)")
    p.add_argument("--num-fewshot", type=int, metavar="K", help="few-shot examples (default: each task's own)")
    p.add_argument("--batch", type=int, default=8, metavar="B", help="rows a batch, a multiple of mesh.data x "
                                                                    "mesh.expert (default 8)")
    p.add_argument("--out", metavar="FILE.json", help="where lm-eval's results JSON goes (default: "
                   "RUN_DIR/eval/results-step<N>.json, or eval-results.json for a Hugging Face folder)")
    p.add_argument("--log-samples", action="store_true", help="keep every request and response in the JSON")
    p.add_argument("--max-length", type=int, metavar="N", help="the longest sequence a request runs at, its context "
                   "cut from the left to fit (default: a run's model.seq_len; a Hugging Face checkpoint's "
                   "max_position_embeddings, as lm-eval's Hugging Face backend reads it)")
    p.add_argument("--step", type=int, help="a run's checkpoint step (default: the newest)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
