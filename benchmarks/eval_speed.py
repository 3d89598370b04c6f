"""Requests a second: `jaxpar eval`'s harness against lm-eval's own Hugging Face backend, on the same CPU and
the same weights (tests/fixtures/eval/model, or --model DIR), the same tasks (configs/evals' colors_mc,
colors_qa and colors_text: 200 multiple-choice, 50 generation and 10 perplexity requests), batch 8.

Usage:
    python benchmarks/eval_speed.py --hf-python /tmp/hfe/bin/python [--rounds 3] [--model DIR]
        [--width D --layers N]

--width and --layers make a model of that size from the fixture's config (heads of 64, a quarter of them
key/value heads, d_ff 3 x D), random weights, exported with the fixture's tokenizer into a temporary folder:
the same requests on a model whose matmuls, not the harness, take the time.

The peer runs in its own environment (torch, transformers, lm-eval[hf]): --hf-python is its interpreter
(tests/fixtures/eval/make_fixtures.py says how to make one). Each side is a process of its own that loads
the model once and runs lm_eval.simple_evaluate of the three tasks twice: the first run (jaxpar compiles
its programs then; torch warms up) and the second (everything compiled), timing each request type inside
the model (requests/s) apart from the evaluator's own work (building the requests, the metrics). The sides
run alternately, --rounds times; printed: the machine's line, a markdown table of the medians, then one JSON
line with every time. jaxpar runs on one CPU device (no emulated mesh: the devices would share the same
cores) in fp32; the Hugging Face backend in fp32 with torch's threads.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import REPO, git_commit

TASKS = ("colors_mc", "colors_qa", "colors_text")
REQUESTS = 4 * 50 + 50 + 10
BATCH = 8
KEYS = ("total", "loglikelihood", "generate_until", "loglikelihood_rolling")

# Both sides: each request type's seconds inside the model (the evaluator's own work apart), for each run.
TIMED = """
def timed_runs(model, evaluate):
    runs = []
    for _ in range(2):
        spent = {}
        for name in ("loglikelihood", "loglikelihood_rolling", "generate_until"):
            method = getattr(type(model), name)
            def timed(requests, *args, _method=method, _name=name, **kwargs):
                started = time.perf_counter()
                out = _method(model, requests, *args, **kwargs)
                spent[_name] = time.perf_counter() - started
                return out
            setattr(model, name, timed)
        started = time.perf_counter()
        results = evaluate()
        runs.append({"total": time.perf_counter() - started, **spent})
    print(json.dumps({"seconds": runs, "acc": results["results"]["colors_mc"]["acc,none"]}))
"""

JAXPAR_SIDE = """
import json, sys, time
from pathlib import Path
from flax import nnx
from jaxpar.config.precision import of
from jaxpar.evals.harness import EvalModel, JaxparLM
from jaxpar.evals.tasks import evaluate, load_tasks
from jaxpar.interop import hf
""" + TIMED + """
model, config = hf.load(sys.argv[1])
graphdef, params = nnx.split(model)
lm = JaxparLM(EvalModel(graphdef, params, config.model, of(config), None, Path(sys.argv[1]), batch=int(sys.argv[3])))
tasks = sys.argv[2].split(",")
timed_runs(lm, lambda: evaluate(lm, load_tasks(tasks)))
"""

HF_SIDE = """
import json, os, sys, time
import lm_eval
from lm_eval.models.huggingface import HFLM
""" + TIMED + """
model = HFLM(pretrained=sys.argv[1], dtype="float32", batch_size=int(sys.argv[3]), max_length=128, device="cpu")
tasks = [os.path.join(sys.argv[4], name + ".yaml") for name in sys.argv[2].split(",")]
os.chdir(sys.argv[4])  # lm-eval reads a task's relative data_files from the working folder
from lm_eval.tasks import TaskManager
manager = TaskManager(include_defaults=False)  # as jaxpar's: no index of lm-eval's own tasks to build
timed_runs(model, lambda: lm_eval.simple_evaluate(model=model, tasks=tasks, task_manager=manager))
"""


def _side(python: str, code: str, model: Path) -> dict:
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    out = subprocess.run([python, "-c", code, str(model), ",".join(TASKS), str(BATCH), str(REPO / "configs" / "evals")],
                         capture_output=True, text=True, env=env, cwd=REPO, check=False)
    if out.returncode:
        sys.exit(f"eval_speed: a side failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _random_model(fixture: Path, width: int, layers: int, out: Path) -> Path:
    """A Llama of d_model `width` and `layers` layers with random weights and the fixture's tokenizer."""
    from flax import nnx

    from jaxpar.interop import hf
    from jaxpar.model.transformer import Transformer

    _, config = hf.load(fixture)
    heads = width // 64
    config = config.replace(**{"model.d_model": width, "model.n_layers": layers, "model.n_heads": heads,
                               "model.n_kv_heads": max(heads // 4, 1), "model.head_dim": 64, "model.d_ff": 3 * width,
                               "model.from_hf": ""})  # its own config.json, not the fixture's shapes
    hf.save(Transformer(config.model, rngs=nnx.Rngs(0)), config, out / "model")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(fixture / name, out / "model" / name)
    return out / "model"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf-python", required=True, help="the interpreter with torch, transformers and lm-eval")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", type=Path, default=REPO / "tests" / "fixtures" / "eval" / "model")
    parser.add_argument("--width", type=int, help="d_model of a random model made from the fixture's config")
    parser.add_argument("--layers", type=int, default=8, help="with --width: its layers (default 8)")
    args = parser.parse_args()
    if args.width:
        args.model = _random_model(args.model, args.width, args.layers, Path(tempfile.mkdtemp(prefix="eval-speed-")))
    runs = {"jaxpar": [], "hf": []}
    for _ in range(args.rounds):
        runs["jaxpar"].append(_side(sys.executable, JAXPAR_SIDE, args.model))
        runs["hf"].append(_side(args.hf_python, HF_SIDE, args.model))
    import jax
    from common import machine_line, machine_record

    record = machine_record(jax.devices("cpu"), ("float32",))
    print(f"{machine_line(record)}; {len(os.sched_getaffinity(0))} cores allowed; commit {git_commit()}")
    print("| side | run | all requests | loglikelihood (200) | generate_until (50) | rolling (10 texts) | "
          "the evaluator's own | colors_mc acc |")
    print("|---|---|---|---|---|---|---|---|")
    medians = {}
    for side, name in (("jaxpar", "jaxpar, one CPU device"), ("hf", "lm-eval's hf backend, torch")):
        for run, label in ((0, "first (compiles)"), (1, "second")):
            m = {key: statistics.median(r["seconds"][run][key] for r in runs[side]) for key in KEYS}
            inside = m["loglikelihood"] + m["generate_until"] + m["loglikelihood_rolling"]
            medians[side, run] = REQUESTS / inside
            print(f"| {name} | {label} | {REQUESTS / inside:.0f}/s | {200 / m['loglikelihood']:.0f}/s | "
                  f"{50 / m['generate_until']:.0f}/s | {10 / m['loglikelihood_rolling']:.0f}/s | "
                  f"{m['total'] - inside:.2f} s | {runs[side][0]['acc']} |")
    print(f"requests/s, jaxpar / hf: second runs {medians['jaxpar', 1] / medians['hf', 1]:.2f}, first runs "
          f"{medians['jaxpar', 0] / medians['hf', 0]:.2f}")
    print(json.dumps({"benchmark": "eval_speed", "commit": git_commit(), "machine": record, "requests": REQUESTS,
                      "model": str(args.model), "width": args.width, "layers": args.layers if args.width else None,
                      "runs": runs, "ratio_second": medians["jaxpar", 1] / medians["hf", 1]}))


if __name__ == "__main__":
    main()
