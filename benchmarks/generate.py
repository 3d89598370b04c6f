"""Batched greedy generation: jaxpar against transformers' generate on the same weights and CPU, and
against the memory-bandwidth bound of a decode step.

    .venv/bin/python benchmarks/generate.py [--models default,1b] [--batch 32] [--new-tokens 128]
        [--repeats 3] [--torch-python /tmp/hf/bin/python] [--results FILE]

Models, random weights written once as an fp32 Hugging Face checkpoint (jaxpar.interop.hf.save) into
a temporary folder, which both sides then read:
  * default: jaxpar's default model shape with model.mlp=swiglu (the default GELU MLP has no Hugging
    Face family; SwiGLU makes it a Llama checkpoint), rotary positions;
  * 1b: the shape of configs/llama3_2_1b.yaml (Llama 3.2 1B: 16 layers of width 2048, 8 KV heads,
    llama3 rope scaling, tied output) with the vocabulary shrunk to --vocab-1b (32000; the real one is
    128256) to save memory and time.
Each side: --batch prompts of --prompt-len random ids (equal lengths: no padding on either side),
--new-tokens new tokens, greedy, no end token; fp32 weights and compute. jaxpar:
jaxpar.sampling.BatchedGenerator on one device (one jitted program: prefill and a while_loop of decode
steps). transformers: AutoModelForCausalLM.generate (do_sample=False, eos_token_id=None, its dynamic
cache) under torch.inference_mode with every core's thread, run by --torch-python (an interpreter with
torch and transformers; jaxpar's has none) as a worker process that stays up for the model's rounds.
Each side makes one untimed warm-up call (jaxpar's compiles); then the sides alternate, a whole
generate call each, --repeats times, and the table gives the medians. Decode tokens/s = batch x new
tokens / seconds of the call (the prefill of the prompts included). Token agreement: the share of
equal tokens in the first --agree-steps new tokens of every row (greedy picks of random weights can
differ in a near tie, and a row differs from then on).

Bounds of the machine. Bandwidth: a 1 GiB fp32 array copied by numpy (bytes read + written, the median
of 5). A decode step reads every weight (fp32; the output is tied to the embedding, read once) and the
key/value cache at its mean length (prompt + new tokens / 2 slots): bound tokens/s = batch x bandwidth
/ those bytes. Matmul: the fp32 rate of a 2048^3 matmul (the machine line's) over the call's FLOPs,
2 x parameters + the attention's 4 x layers x heads x head size x mean slots a token, for the prompts'
tokens (the prefill) as well as the new ones; on a few cores at batch 32 this one, not the bandwidth, is
what limits a step.

Run it on a quiet machine: torch's OpenMP threads spin at their barriers, and on cores shared with other
processes a step then takes many times as long (on a loaded 2-core host, the default model's 16 tokens
took 0.12 s with one thread and 1.6-7 s with two); the heading records the load average at the start
and OMP_WAIT_POLICY when set (the worker inherits the environment).

Cost on a 2-core host (estimated from a 2-layer cut of the 1b shape): the default row takes under a minute,
the 1b row 25-45 minutes: a call for 32 rows of 16 + 128 tokens is ~9.6 TFLOP, 3-6 minutes at the 28-37
GFLOP/s the two sides reached on the cut on a loaded host (up to ~55 on a quiet one), and each side makes
1 + --repeats calls. Its memory: ~10 GB while the random weights are written (4.2 GB of fp32 safetensors
in the temporary folder), then ~4.5 GB in jaxpar's process and ~4.6 GB in the worker at once.

Printed: the machine line, the markdown table, then one JSON line with every number. --results FILE
appends the table under a heading naming the date, the commit and the machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, git_commit, markdown

MODELS = {
    "default": (None, ["model.mlp=swiglu"]),
    "1b": (str(REPO / "configs" / "llama3_2_1b.yaml"), []),
}
COPY_GIB, COPY_REPEATS = 1, 5
HEADER = ["model", "params", "batch", "new tokens", "jaxpar tok/s", "transformers tok/s", "jaxpar / transformers",
          "bandwidth bound tok/s", "jaxpar / bound", "matmul bound tok/s", "token agreement"]


# ---------------------------------------------------------------- the transformers side (torch's interpreter)

def torch_worker(folder: str, prompts_file: str, new_tokens: int, threads: int) -> None:
    """Load the checkpoint with transformers, warm up with one generate call, print a JSON line; then a
    timed generate call (its seconds and new tokens as a JSON line) for every line read from stdin."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    config = model.generation_config
    config.eos_token_id, config.pad_token_id, config.bos_token_id = None, 0, None
    config.do_sample, config.max_new_tokens, config.min_new_tokens = False, new_tokens, None
    config.temperature, config.top_p, config.top_k = None, None, None
    ids = torch.tensor(json.loads(Path(prompts_file).read_text()), dtype=torch.long)
    mask = torch.ones_like(ids)
    loaded = time.perf_counter() - start

    def call() -> tuple[float, list[list[int]]]:
        begin = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        seconds = time.perf_counter() - begin
        new = out[:, ids.shape[1]:]
        if new.shape[1] != new_tokens:
            raise SystemExit(f"transformers generated {new.shape[1]} new tokens, not {new_tokens}")
        return seconds, new.tolist()

    warm, _ = call()
    print(json.dumps({"load_s": loaded, "warmup_s": warm, "threads": torch.get_num_threads(),
                      "torch": torch.__version__, "transformers": sys.modules["transformers"].__version__}),
          flush=True)
    for _ in sys.stdin:
        seconds, tokens = call()
        print(json.dumps({"seconds": seconds, "tokens": tokens}), flush=True)


class TorchSide:
    """The worker process in torch's interpreter: started (it loads and warms up), then one call a `run`."""

    def __init__(self, python: str, folder: Path, prompts_file: Path, new_tokens: int, threads: int):
        command = [python, __file__, "--torch-worker", str(folder), "--prompts-file", str(prompts_file),
                   "--new-tokens", str(new_tokens), "--threads", str(threads)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info = self._line()

    def _line(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"the transformers worker ended (exit status {self.process.wait()})")
        return json.loads(line)

    def run(self) -> tuple[float, list[list[int]]]:
        self.process.stdin.write("run\n")
        self.process.stdin.flush()
        found = self._line()
        return found["seconds"], found["tokens"]

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


# ---------------------------------------------------------------- the jaxpar side

def write_checkpoint(name: str, folder: Path, vocab_1b: int) -> int:
    """A fresh model of `name`'s shape (random weights) written as an fp32 Hugging Face checkpoint in
    `folder`; returns its parameter count."""
    import jax
    from flax import nnx

    from jaxpar.config.presets import load_config
    from jaxpar.interop import hf
    from jaxpar.model.transformer import Transformer

    preset, overrides = MODELS[name]
    if name == "1b":
        overrides = [*overrides, f"model.vocab_size={vocab_1b}"]
    cfg = load_config(preset, [*overrides, "train.precision=fp32"])
    model = Transformer(cfg.model, rngs=nnx.Rngs(0))
    count = sum(leaf.size for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))
    hf.save(model, cfg, folder, "float32")
    return count


class JaxparSide:
    """The checkpoint read by jaxpar.interop.hf.load, and its BatchedGenerator, warmed up (compiled)."""

    def __init__(self, folder: Path, prompts: list[list[int]], new_tokens: int):
        from flax import nnx

        from jaxpar.config import precision
        from jaxpar.interop import hf
        from jaxpar.sampling.batched import BatchedGenerator, Shape
        from jaxpar.sampling.choice import Sampling

        start = time.perf_counter()
        model, self.cfg = hf.load(folder)
        self.graphdef, self.params = nnx.split(model)
        self.load_s = time.perf_counter() - start
        shape = Shape(len(prompts), len(prompts[0]), new_tokens)
        self.generator = BatchedGenerator(self.graphdef, self.cfg.model, precision.of(self.cfg), shape, Sampling(),
                                          stop_ids=frozenset(), layout=None)
        self.prompts, self.new_tokens = prompts, new_tokens
        self.warmup_s, _ = self.run()

    def run(self) -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        tokens = self.generator(self.params, self.prompts)
        seconds = time.perf_counter() - start
        if any(len(row) != self.new_tokens for row in tokens):
            raise SystemExit(f"jaxpar generated {sorted({len(r) for r in tokens})} new tokens, not {self.new_tokens}")
        return seconds, tokens


# ---------------------------------------------------------------- bounds

def copy_bandwidth(gib: int = COPY_GIB, repeats: int = COPY_REPEATS) -> float:
    """Bytes/s of numpy copying a `gib` GiB fp32 array into another (read + written), the median of `repeats`."""
    import numpy as np

    source = np.ones(gib * 2**30 // 4, np.float32)
    target = np.empty_like(source)
    np.copyto(target, source)  # both arrays' pages touched before the timing
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(target, source)
        times.append(time.perf_counter() - start)
    return 2 * source.nbytes / statistics.median(times)


def bounds(m, params: int, batch: int, prompt_len: int, new_tokens: int, bandwidth: float,
           matmul_flops: float) -> dict:
    """The bandwidth bound (new tokens/s) of a decode step at the cache's mean length, and the matmul bound
    of the whole call (the prefill's FLOPs included)."""
    mean_slots = prompt_len + new_tokens / 2
    cache_bytes = 2 * m.n_layers * batch * m.kv_heads * m.head_size * 4 * mean_slots
    step_bytes = 4 * params + cache_bytes
    token_flops = 2 * params + 4 * m.n_layers * m.n_heads * m.head_size * mean_slots
    return {"step_bytes": step_bytes, "cache_bytes": cache_bytes, "bandwidth_bound": batch * bandwidth / step_bytes,
            "token_flops": token_flops,
            "matmul_bound": matmul_flops / token_flops * new_tokens / (new_tokens + prompt_len)}


def agreement(a: list[list[int]], b: list[list[int]], steps: int) -> float:
    """The share of equal tokens among the first `steps` of every row."""
    pairs = [(x, y) for row_a, row_b in zip(a, b) for x, y in zip(row_a[:steps], row_b[:steps])]
    return sum(x == y for x, y in pairs) / len(pairs)


# ---------------------------------------------------------------- one model, both sides alternately

def measure(name: str, args: argparse.Namespace, bandwidth: float, matmul_flops: float) -> dict:
    """One model's row: both sides warmed up, then alternately timed --repeats times."""
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix=f"generate_{name}_") as work:
        folder, prompts_file = Path(work) / "hf", Path(work) / "prompts.json"
        start = time.perf_counter()
        params = write_checkpoint(name, folder, args.vocab_1b)
        print(f"{name}: {params:,} parameters written in {time.perf_counter() - start:.0f} s", file=sys.stderr)
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        prompts = [[rng.randrange(1, vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)]
        prompts_file.write_text(json.dumps(prompts))
        jaxpar = JaxparSide(folder, prompts, args.new_tokens)
        print(f"{name}: jaxpar loaded in {jaxpar.load_s:.0f} s, warm-up (compile) {jaxpar.warmup_s:.1f} s",
              file=sys.stderr)
        torch = TorchSide(args.torch_python, folder, prompts_file, args.new_tokens, args.threads)
        print(f"{name}: transformers {torch.info}", file=sys.stderr)
        times: dict[str, list[float]] = {"jaxpar": [], "transformers": []}
        last: dict[str, list[list[int]]] = {}
        try:
            for r in range(args.repeats):
                for side, call in (("jaxpar", jaxpar.run), ("transformers", torch.run)):
                    seconds, tokens = call()
                    times[side].append(seconds)
                    last[side] = tokens
                    print(f"{name} round {r + 1}: {side} {seconds:.2f} s", file=sys.stderr)
        finally:
            torch.close()
    m = jaxpar.cfg.model
    median = {side: statistics.median(t) for side, t in times.items()}
    rate = {side: args.batch * args.new_tokens / s for side, s in median.items()}
    bound = bounds(m, params, args.batch, args.prompt_len, args.new_tokens, bandwidth, matmul_flops)
    return {"model": name, "params": params, "batch": args.batch, "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens, "layers": m.n_layers, "d_model": m.d_model, "vocab": m.vocab_size,
            "seconds": times, "median_s": median, "tokens_per_s": rate, **bound,
            "agreement": agreement(last["jaxpar"], last["transformers"], args.agree_steps),
            "jaxpar_load_s": jaxpar.load_s, "jaxpar_warmup_s": jaxpar.warmup_s, "transformers_info": torch.info}


def table_row(row: dict) -> list:
    jaxpar, torch = row["tokens_per_s"]["jaxpar"], row["tokens_per_s"]["transformers"]
    return [row["model"], f"{row['params'] / 1e6:,.1f}M", row["batch"], row["new_tokens"], f"{jaxpar:,.1f}",
            f"{torch:,.1f}", f"{jaxpar / torch:.2f}", f"{row['bandwidth_bound']:,.1f}",
            f"{jaxpar / row['bandwidth_bound']:.1%}", f"{row['matmul_bound']:,.1f}", f"{row['agreement']:.1%}"]


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="default,1b", help="comma-separated, of: " + ", ".join(MODELS))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=16, help="tokens of every prompt (all equal)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="timed calls of each side, alternately")
    p.add_argument("--agree-steps", type=int, default=8, help="new tokens compared between the sides")
    p.add_argument("--vocab-1b", type=int, default=32000, help="the 1b model's vocabulary (Llama 3.2's: 128256)")
    p.add_argument("--torch-python", default=os.environ.get("JAXPAR_TORCH_PYTHON", "/tmp/hf/bin/python"),
                   help="an interpreter with torch and transformers (default: $JAXPAR_TORCH_PYTHON or %(default)s)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch's threads (default: every core)")
    p.add_argument("--results", type=Path, help="append the table to this markdown file")
    p.add_argument("--torch-worker", help=argparse.SUPPRESS)  # the checkpoint folder, in torch's interpreter
    p.add_argument("--prompts-file", help=argparse.SUPPRESS)
    args = p.parse_args()
    unknown = set(args.models.split(",")) - set(MODELS)
    if unknown:
        p.error(f"unknown models {sorted(unknown)}; choose from {', '.join(MODELS)}")
    if min(args.batch, args.prompt_len, args.new_tokens, args.repeats, args.agree_steps) < 1:
        p.error("--batch, --prompt-len, --new-tokens, --repeats and --agree-steps must be at least 1")
    return args


def main() -> None:
    args = parse()
    if args.torch_worker:
        torch_worker(args.torch_worker, args.prompts_file, args.new_tokens, args.threads)
        return
    import jax
    from common import machine_line, machine_record

    load = os.getloadavg()[0]
    omp = f"; OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}" if "OMP_WAIT_POLICY" in os.environ else ""
    bandwidth = copy_bandwidth()
    record = machine_record(jax.devices(), ("float32",))
    print(f"{machine_line(record)}; numpy copy {bandwidth / 1e9:.1f} GB/s", file=sys.stderr)
    rows = [measure(name, args, bandwidth, record["matmul_flops"]["float32"]) for name in args.models.split(",")]
    heading = (f"## {datetime.date.today()} — batched greedy generation, jaxpar against transformers, commit "
               f"{git_commit()}\n\n{machine_line(record)}; numpy copy bandwidth {bandwidth / 1e9:.1f} GB/s; "
               f"torch {rows[0]['transformers_info']['torch']} with {rows[0]['transformers_info']['threads']} "
               f"threads, transformers {rows[0]['transformers_info']['transformers']}, jax {jax.__version__}; "
               f"load average {load:.1f} at the start" + omp)
    command = ("`.venv/bin/python benchmarks/generate.py " + " ".join(sys.argv[1:])).rstrip() + "`"
    text = (f"{heading}\n\n{command}: prompts of {args.prompt_len} random ids, greedy, fp32, median of "
            f"{args.repeats} alternating calls a side; agreement over the first {args.agree_steps} new tokens.\n\n"
            + markdown(HEADER, [table_row(r) for r in rows]))
    print(text)
    if args.results is not None:
        with args.results.open("a") as out:
            out.write(f"\n{text}\n")
    print(json.dumps({"benchmark": "generate", "commit": git_commit(), "machine": record,
                      "copy_bandwidth": bandwidth, "rows": rows}))


if __name__ == "__main__":
    main()
