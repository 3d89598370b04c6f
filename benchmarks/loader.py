"""Packed, mixed batches delivered per second: jaxpar's own feed on one core, and through grain's loader
with worker processes, against a step that does no work.

Usage:
    python benchmarks/loader.py [--documents N] [--batch B] [--seq-len T] [--steps S] [--workers 1,2,4]

Data: two token folders made here in a temporary folder, in the format jaxpar.data.token_folder reads
('web', N documents of lognormal lengths with mean 1000 tokens, and 'code', N / 2 with mean 2000; random
ids below 32000 in uint16 shards; a placeholder tokenizer.json, the same in both, which nothing here
reads), mixed as data.mixture=web:0.7,code:0.3 with data.packing=pack at model.seq_len=T (default
4096) and train.batch_size=B (default 8). Their packing plans are made (and kept in the folders) once
before the runs, and that time is reported.

Each run is a process of its own, so its peak RSS (resource.getrusage) is its own:
- jaxpar, one core: the process pinned to one core does what the training loop does for a step's
  batch (jaxpar.train.feeds.WindowFeed, Trainer.put_windows on one device): the mixture's starts for
  step n, its windows, its packing efficiency, then the batch put on the CPU device, and no step.
- grain, K workers: grain.MapDataset.range(steps).map(the same step's windows) .to_iter_dataset()
  .mp_prefetch(MultiprocessingOptions(num_workers=K)); each worker opens the folders and reads the
  kept plans; the main process puts each batch on the CPU device. Peak RSS is given for the main
  process and for the largest worker; RSS counts the pages of the token files a process has mapped
  (and the kernel maps the neighbours of each page read), so the private memory (RssAnon) of each
  is given too, a worker's as the most any batch reported.
Tokens are counted as the training loop counts them (batch x seq_len x the packing efficiency: padding
is not credited), over S steps after 5 warm-up steps (the workers' start is in the warm-up).
Printed: the machine's line, a markdown table, then one JSON line with every number.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import git_commit, markdown

WARMUP = 5
FOLDERS = {"web": (1.0, 1000), "code": (0.5, 2000)}  # name: (share of --documents, mean document length)
WEIGHTS = {"web": 0.7, "code": 0.3}
VOCAB = 32000


def write_folder(folder: Path, count: int, mean: int, seed: int) -> None:
    """A token folder of `count` documents of lognormal lengths (mean `mean`), random ids, one uint16 shard."""
    import numpy as np

    from jaxpar.data.token_folder import FORMAT, META, TOKENIZER

    rng = np.random.default_rng(seed)
    sigma = 1.2
    lengths = np.maximum(1, np.ceil(rng.lognormal(np.log(mean) - sigma ** 2 / 2, sigma, count))).astype(np.int64)
    folder.mkdir(parents=True)
    total = int(lengths.sum())
    with open(folder / "shard-0.bin", "wb") as out:
        for begin in range(0, total, 1 << 24):
            rng.integers(0, VOCAB, size=min(1 << 24, total - begin), dtype=np.uint16).tofile(out)
    np.cumsum(lengths).tofile(folder / "documents.bin")
    (folder / TOKENIZER).write_text('{"placeholder": "the loader benchmark draws random ids"}\n')
    (folder / META).write_text(json.dumps({
        "format": FORMAT, "vocab_size": VOCAB, "dtype": "uint16", "tokens": total,
        "shards": [{"file": "shard-0.bin", "tokens": total}],
        "documents": {"file": "documents.bin", "count": count}}))


class StepBatch:
    """Step n's batch of the mixture as the training loop builds it: (its PackedRows, its document tokens,
    this process's private memory in MB). Picklable: each process builds the samplers once (reading the
    kept plans), however many copies of this grain's threads make."""

    def __init__(self, root: str, seq_len: int, batch: int):
        self.root, self.seq_len, self.batch = root, seq_len, batch

    def sampler(self):
        key = (self.root, self.seq_len, self.batch)
        with _BUILDING:
            if key not in _SAMPLERS:
                from jaxpar.config.presets import load_config
                from jaxpar.config.sources import parse_mixture
                from jaxpar.data.mixture import mixture_samplers

                mixture = ",".join(f"{Path(self.root, name)}:{w}" for name, w in WEIGHTS.items())
                cfg = load_config(None, [f"data.mixture={mixture}", "data.packing=pack", f"model.vocab_size={VOCAB}",
                                         f"model.seq_len={self.seq_len}", f"train.batch_size={self.batch}"])
                _SAMPLERS[key] = mixture_samplers(parse_mixture(cfg.data.mixture), cfg.data, cfg.model, cfg.train)[0]
        return _SAMPLERS[key]

    def __call__(self, step: int):
        sampler = self.sampler()
        starts = sampler.starts(int(step))
        return sampler.windows(starts), self.batch * self.seq_len * sampler.efficiency(starts), private_mb()


_SAMPLERS: dict = {}  # this process's samplers, by (root, seq_len, batch)
_BUILDING = threading.Lock()


def private_mb() -> float:
    """This process's resident memory that is its own (RssAnon): not the token files' pages, which RSS
    also counts in every process that maps them (and once for each mapping)."""
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("RssAnon:"))) / 1024


def run(args) -> dict:
    """One run (args.run: 'jaxpar' or 'grain'), timed in this process."""
    import jax

    cpu = jax.devices("cpu")[0]
    # this module by its name, not as __main__: grain's workers then import it, and pickle StepBatch by reference
    batches = importlib.import_module(Path(__file__).stem).StepBatch(args.root, args.seq_len, args.batch)
    if args.run == "jaxpar":
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        feed = (batches(step) for step in range(WARMUP + args.steps))
    else:
        import grain
        from absl import flags

        flags.FLAGS.mark_as_parsed()  # grain reads its absl flags (at their defaults) when it starts workers
        dataset = grain.MapDataset.range(WARMUP + args.steps).map(batches).to_iter_dataset()
        feed = iter(dataset.mp_prefetch(grain.MultiprocessingOptions(num_workers=args.workers)))
    tokens, start, private = 0.0, time.perf_counter(), 0.0
    for step, (rows, document_tokens, producer_mb) in enumerate(feed):
        jax.block_until_ready(jax.device_put(rows, cpu))  # the step's input; the step does no work
        if step == WARMUP - 1:
            tokens, start = 0.0, time.perf_counter()
        elif step >= WARMUP:
            tokens += document_tokens
        private = max(private, producer_mb)
    seconds = time.perf_counter() - start
    if args.run == "grain":
        feed.close()
    usage = {who: resource.getrusage(who).ru_maxrss / 1024 for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)}
    return {"run": args.run, "workers": args.workers, "steps": args.steps, "seconds": seconds,
            "tokens_per_s": tokens / seconds, "batches_per_s": args.steps / seconds,
            "peak_rss_mb": usage[resource.RUSAGE_SELF], "worker_peak_rss_mb": usage[resource.RUSAGE_CHILDREN],
            "main_private_mb": private_mb(), "producer_private_mb": private}


def prepare(root: Path, documents: int, seq_len: int, batch: int) -> float:
    """Write the folders; the seconds to make and keep their packing plans."""
    for seed, (name, (share, mean)) in enumerate(FOLDERS.items()):
        write_folder(root / name, int(documents * share), mean, seed)
    start = time.perf_counter()
    StepBatch(str(root), seq_len, batch)(0)
    return time.perf_counter() - start


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=200_000, help="documents of 'web' (default %(default)s)")
    parser.add_argument("--batch", type=int, default=8, help="train.batch_size (default %(default)s)")
    parser.add_argument("--seq-len", type=int, default=4096, help="model.seq_len (default %(default)s)")
    parser.add_argument("--steps", type=int, default=1000, help="timed steps per run (default %(default)s)")
    parser.add_argument("--workers", default="1,2,4", help="grain's worker counts (default %(default)s)")
    parser.add_argument("--run", choices=("jaxpar", "grain"), help=argparse.SUPPRESS)  # a child's one run
    parser.add_argument("--root", help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> int:
    args = parse()
    if args.run:
        args.workers = int(args.workers)
        print(json.dumps(run(args)))
        return 0
    import jax
    from common import machine_line, machine_record

    record = machine_record(jax.devices("cpu"), ("float32",))
    results = []
    with tempfile.TemporaryDirectory() as root:
        planned = prepare(Path(root), args.documents, args.seq_len, args.batch)
        print(f"folders written; plans made and kept in {planned:.1f} s", file=sys.stderr)
        for name, workers in [("jaxpar", "0")] + [("grain", k) for k in args.workers.split(",")]:
            command = [sys.executable, __file__, "--run", name, "--workers", workers, "--root", root, "--steps",
                       str(args.steps), "--batch", str(args.batch), "--seq-len", str(args.seq_len)]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"loader: the {name} run with {workers} workers failed:\n{done.stderr[-3000:]}")
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"{name} {workers}: {results[-1]['tokens_per_s']:,.0f} tokens/s", file=sys.stderr)
    print(f"{machine_line(record)}; {len(os.sched_getaffinity(0))} cores allowed; commit {git_commit()}; "
          f"jax {jax.__version__}\n")
    print(f"mixture web:0.7,code:0.3 ({args.documents:,} and {args.documents // 2:,} documents), data.packing=pack, "
          f"batch {args.batch} x seq {args.seq_len}, {args.steps} steps after {WARMUP}; plans made in "
          f"{planned:.1f} s\n")
    rows = [["jaxpar feed, one core" if r["run"] == "jaxpar" else f"grain, {r['workers']} worker(s)",
             f"{r['tokens_per_s']:,.0f}", f"{r['batches_per_s']:.1f}", f"{r['peak_rss_mb']:.0f}",
             f"{r['main_private_mb']:.0f}", f"{r['worker_peak_rss_mb']:.0f}" if r["run"] == "grain" else "-",
             f"{r['producer_private_mb']:.0f}" if r["run"] == "grain" else "-"] for r in results]
    print(markdown(["feed", "packed tokens/s", "batches/s", "main: peak RSS (MB)", "main: private (MB)",
                    "largest worker: peak RSS (MB)", "a worker: private, most (MB)"], rows))
    print(json.dumps({"benchmark": "loader", "commit": git_commit(), "machine": record, "documents": args.documents,
                      "batch": args.batch, "seq_len": args.seq_len, "plans_s": planned, "runs": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
