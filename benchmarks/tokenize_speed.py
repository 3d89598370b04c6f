"""`jaxpar tokenize` against the tokenizer's own encode_batch, one and two workers, and --shard + --merge.

Usage:
    python benchmarks/tokenize_speed.py [--mb 200] [--repeats 3] [--tokenizer FILE|DIR] [--vocab-size 32768]

Makes a JSONL corpus of at least --mb MB in a temporary folder (documents of 1 to 20 paragraphs of the
built-in corpus, drawn with a fixed seed; nothing is downloaded) and a tokenizer (--tokenizer, or a
byte-level BPE of --vocab-size trained on the built-in corpus). Then, --repeats times in turn, each in a
process of its own with one thread per process (TOKENIZERS_PARALLELISM=false):
  - encode_batch: the tokenizer's own `encode_batch` (and `encode_batch_fast`, no offsets) over the
    documents' texts in batches of 1,000 read from the file as they are needed, on one core (taskset -c 0);
    only the encoding is timed (holding all 200 MB of texts at once made both 20-40% slower);
  - workers 1: `jaxpar tokenize --workers 1` on one core, the whole command timed (start-up, reading,
    parsing, writing);
  - workers 2: `jaxpar tokenize --workers 2` on two cores (taskset -c 0,1).
Then once: four `--shard i/4` tasks one after the other and `--merge`, and a byte-for-byte comparison of
the three folders. Rates are MB of document text (UTF-8) per second and tokens per second; the table
gives medians over the repeats and the ratios the acceptance asks for.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, git_commit

ENCODE_BATCH = """
import itertools, json, sys, time
from tokenizers import Tokenizer
tokenizer = Tokenizer.from_file(sys.argv[1])
result = {}
for method in ("encode_batch", "encode_batch_fast"):
    encode, tokens, seconds = getattr(tokenizer, method), 0, 0.0
    with open(sys.argv[2], encoding="utf-8") as lines:
        while batch := [json.loads(line)["text"] for line in itertools.islice(lines, 1000)]:
            start = time.perf_counter()
            tokens += sum(len(e.ids) for e in encode(batch, add_special_tokens=False))
            seconds += time.perf_counter() - start
    result[method] = {"seconds": seconds, "tokens": tokens}
print(json.dumps(result))
"""


def write_corpus(path: Path, megabytes: float, seed: int = 0) -> int:
    """A JSONL file of at least `megabytes` MB; returns its documents' text bytes (UTF-8)."""
    import numpy as np

    from jaxpar.data import builtin_text

    paragraphs = [p for p in builtin_text().split("\n\n") if p.strip()]
    rng, text_bytes, size = np.random.default_rng(seed), 0, 0
    with path.open("w", encoding="utf-8") as f:
        while size < megabytes * 1e6:
            text = "\n\n".join(paragraphs[i] for i in rng.integers(0, len(paragraphs), rng.integers(1, 21)))
            line = json.dumps({"text": text}) + "\n"
            f.write(line)
            size += len(line.encode("utf-8"))
            text_bytes += len(text.encode("utf-8"))
    return text_bytes


def make_tokenizer(folder: Path, vocab_size: int) -> Path:
    """A byte-level BPE of `vocab_size` trained on the built-in corpus by `jaxpar tokenize`."""
    from jaxpar.data import builtin_text

    (folder / "builtin.txt").write_text(builtin_text(), encoding="utf-8")
    jaxpar(["tokenize", "--input", str(folder / "builtin.txt"), "--vocab-size", str(vocab_size),
            "--out", str(folder / "trained")], cores="0,1")
    return folder / "trained" / "tokenizer.json"


def jaxpar(arguments: list[str], cores: str) -> float:
    """Run `python -m jaxpar ...` on `cores` (taskset), one thread per process; returns its seconds."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    start = time.perf_counter()
    subprocess.run(["taskset", "-c", cores, sys.executable, "-m", "jaxpar", *arguments, "--no-progress"]
                   if arguments[0] == "tokenize" and "--merge" not in arguments
                   else ["taskset", "-c", cores, sys.executable, "-m", "jaxpar", *arguments],
                   check=True, capture_output=True, cwd=REPO, env=env)
    return time.perf_counter() - start


def encode_batch_rates(tokenizer: Path, corpus: Path) -> dict:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", ENCODE_BATCH, str(tokenizer), str(corpus)],
                         check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out)


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=200, help="MB of JSONL at least (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the timed runs (default %(default)s)")
    parser.add_argument("--tokenizer", help="a tokenizer.json or a folder holding one (default: train one)")
    parser.add_argument("--vocab-size", type=int, default=32768, help="of the trained tokenizer")
    args = parser.parse_args()
    from jaxpar.runtime import machine

    with tempfile.TemporaryDirectory(prefix="jaxpar-tokenize-bench-") as tmp:
        root = Path(tmp)
        corpus = root / "corpus.jsonl"
        text_mb = write_corpus(corpus, args.mb) / 1e6
        tokenizer = Path(args.tokenizer) if args.tokenizer else make_tokenizer(root, args.vocab_size)
        if tokenizer.is_dir():
            tokenizer = tokenizer / "tokenizer.json"
        command = ["tokenize", "--input", str(corpus), "--field", "text", "--tokenizer", str(tokenizer)]
        runs: dict[str, list[float]] = {"encode_batch": [], "encode_batch_fast": [], "workers 1": [], "workers 2": []}
        tokens = 0
        for repeat in range(args.repeats):
            for method, result in encode_batch_rates(tokenizer, corpus).items():
                runs[method].append(result["seconds"])
                tokens = result["tokens"]
            for workers, cores in ((1, "0"), (2, "0,1")):
                out = root / f"w{workers}-{repeat}"
                runs[f"workers {workers}"].append(jaxpar([*command, "--workers", str(workers), "--out", str(out)],
                                                         cores))
        meta = json.loads((root / "w1-0" / "meta.json").read_text())
        shard_seconds = sum(jaxpar([*command, "--shard", f"{i}/4", "--out", str(root / f"part{i}")], "0")
                            for i in range(4))
        shard_seconds += jaxpar(["tokenize", "--merge", *(str(root / f"part{i}") for i in range(4)),
                                 "--out", str(root / "merged")], "0")
        same = folder_bytes(root / "merged") == folder_bytes(root / "w1-0") == folder_bytes(root / "w2-0")
        report(runs, text_mb, tokens, meta, shard_seconds, same, corpus.stat().st_size / 1e6, tokenizer, machine)
    return 0 if same else 1


def report(runs, text_mb, tokens, meta, shard_seconds, same, file_mb, tokenizer, machine) -> None:
    median = {name: statistics.median(seconds) for name, seconds in runs.items()}
    print(f"commit {git_commit()}, {time.strftime('%Y-%m-%d')}; machine: {machine.processor()}, {os.cpu_count()} "
          f"cores (no matmuls: bf16 plays no part)")
    print(f"corpus: {file_mb:.1f} MB of JSONL, {text_mb:.1f} MB of text, {meta['documents']['count']:,} documents, "
          f"{meta['tokens']:,} tokens ({tokenizer}, vocabulary {meta['vocab_size']:,}); medians of "
          f"{len(runs['workers 1'])} rounds\n")
    print("| run | cores | seconds | text MB/s | tokens/s |")
    print("|---|---|---|---|---|")
    for name, cores in (("encode_batch", 1), ("encode_batch_fast", 1), ("workers 1", 1), ("workers 2", 2)):
        label = f"tokenizer's {name} (encoding only)" if name.startswith("encode") else f"jaxpar tokenize --{name}"
        print(f"| {label} | {cores} | {median[name]:.1f} | {text_mb / median[name]:.2f} | "
              f"{tokens / median[name]:,.0f} |")
    print(f"| --shard i/4 x 4, one after the other, then --merge | 1 | {shard_seconds:.1f} | "
          f"{text_mb / shard_seconds:.2f} | {tokens / shard_seconds:,.0f} |")
    one = median["workers 1"]
    print(f"\nworkers 1 / encode_batch: {median['encode_batch'] / one:.2f} (acceptance: at least 0.80); "
          f"/ encode_batch_fast: {median['encode_batch_fast'] / one:.2f}")
    print(f"workers 2 / workers 1: {one / median['workers 2']:.2f} (acceptance: at least 1.7)")
    print(f"--shard x 4 + --merge, --workers 1 and --workers 2 folders byte-identical: {same}")
    print(json.dumps({"median_seconds": median, "shard_and_merge_seconds": shard_seconds, "text_mb": text_mb,
                      "tokens": tokens, "identical": same}))


if __name__ == "__main__":
    sys.exit(main())
