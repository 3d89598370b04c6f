"""`jaxpar eval SOURCE --tasks T1,T2 [--limit N] [--batch B] [--out FILE] [key=value ...]`: lm-eval tasks on a
run's checkpoint (or a Hugging Face checkpoint) laid out as the overrides say, and `evaluate_model`, the same
on a live model from Python.

The tasks are read first (an unknown name or an unreadable dataset is one sentence before any weights load),
then the model is laid out and lm-eval's evaluator runs it through jaxpar.evals.harness.JaxparLM. The results
are lm-eval's own JSON (`lm_eval.simple_evaluate`'s dict), written to --out.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

from flax import nnx
from lm_eval.utils import handle_non_serializable

from jaxpar.config import Config
from jaxpar.config.hf_config import read_config
from jaxpar.config.precision import of as precision_of
from jaxpar.data.folders import write_atomically
from jaxpar.data.token_folder import tokenizer_settings
from jaxpar.errors import UserError
from jaxpar.evals.harness import EvalModel, JaxparLM
from jaxpar.evals.tasks import evaluate, load_tasks, parse_tasks
from jaxpar.sampling.command import stop_ids
from jaxpar.sampling.model_source import load_model

DEFAULT_CONTEXT = 2048  # lm-eval's Hugging Face backend's, for a config.json that names none
TOKENIZER_UNSET = int(1e30)  # transformers' model_max_length when a tokenizer sets none


@dataclasses.dataclass(frozen=True)
class Request:
    """What to evaluate: tasks ('T1,T2'), documents a task at most (None: all), rows a batch, where the JSON
    goes (None: <run>/eval/results-step<N>.json, or eval-results.json here for a Hugging Face folder),
    the checkpoint step, few-shot examples (None: each task's own), whether to keep every request, and the
    longest sequence a request runs at (None: a run's model.seq_len, or a Hugging Face checkpoint's context
    as lm-eval's Hugging Face backend reads it from config.json)."""

    tasks: str
    limit: int | None = None
    batch: int = 8
    out: str | None = None
    step: int | None = None
    num_fewshot: int | None = None
    log_samples: bool = False
    max_length: int | None = None


def evaluate_source(source: str, request: Request, settings: list[str] = (), progress: bool = True) -> dict:
    """Run request.tasks on `source`'s model; write lm-eval's JSON and return the summary."""
    for flag, value in (("--limit", request.limit), ("--max-length", request.max_length)):
        if value is not None and value < 1:
            raise UserError(f"{flag} must be at least 1, got {value}.")
    tasks = load_tasks(parse_tasks(request.tasks), progress)
    loaded = load_model(source, request.step, list(settings), request.batch, "evaluation", progress)
    laid_out = loaded.model
    max_length = request.max_length or (laid_out.cfg.model.seq_len if loaded.step is not None
                                        else hf_context_length(Path(source)))
    model = EvalModel(laid_out.graphdef, loaded.params, laid_out.cfg.model, laid_out.session.precision, laid_out.layout,
                      loaded.tokenizer, stop_ids(loaded.origin), request.batch, max_length)
    lm = JaxparLM(model, progress)
    lm.check(tasks)
    started = time.perf_counter()
    results = evaluate(lm, tasks, request.limit, request.num_fewshot, request.log_samples, quiet=not progress)
    seconds = time.perf_counter() - started
    out = Path(request.out or _default_out(source, loaded.step))
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(out, json.dumps(results, indent=2, default=handle_non_serializable) + "\n")
    return {"tasks": task_metrics(results), "requests": lm.requests, "seconds": seconds,
            "requests_per_s": lm.requests / seconds, "layout": laid_out.session.mesh_name(), "out": str(out)}


def run_command(args) -> int:
    """`jaxpar eval`'s parsed flags run: the summary line on stderr, the summary as JSON on stdout."""
    request = Request(args.tasks, args.limit, args.batch, args.out, args.step, args.num_fewshot, args.log_samples,
                      args.max_length)
    result = evaluate_source(args.source, request, args.settings, progress=not args.no_progress)
    scores = "; ".join(f"{task} " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())
                       for task, metrics in result["tasks"].items())
    print(f"{scores}: {result['requests']} requests in {result['seconds']:.1f} s ({result['requests_per_s']:.1f}/s) "
          f"on {result['layout']}; lm-eval's results in {result['out']}", file=sys.stderr)
    print(json.dumps(result))
    return 0


def evaluate_model(model: nnx.Module, config: Config, tasks: str, limit: int | None = None, batch: int = 8,
                   tokenizer: str | Path | None = None, log_samples: bool = False, max_length: int = 0) -> dict:
    """lm-eval's results dict for `tasks` ('T1,T2') on a live jaxpar model of `config` (its weights where they
    are: one device, or sharded). The tokenizer is the one the config trains with (data.source's tokenized
    folder, or model.from_hf's), unless `tokenizer` names a folder; requests run at up to `max_length` tokens
    (0: model.seq_len)."""
    graphdef, params = nnx.split(model)
    lm = JaxparLM(EvalModel.of_config(graphdef, params, config, precision_of(config), None, batch,
                                      None if tokenizer is None else Path(tokenizer), max_length))
    loaded = load_tasks(parse_tasks(tasks))
    lm.check(loaded)
    return evaluate(lm, loaded, limit, log_samples=log_samples)


def task_metrics(results: dict) -> dict[str, dict[str, float]]:
    """Each task's numeric metrics ('acc', 'exact_match', a filter's as 'metric,filter'), standard errors left
    out."""
    metrics = {}
    for task, values in results["results"].items():
        metrics[task] = {_metric_name(key): float(value) for key, value in values.items()
                         if "," in key and "_stderr" not in key and isinstance(value, (int, float))}
    return metrics


def _metric_name(key: str) -> str:
    metric, _, filter_name = key.partition(",")
    return metric if filter_name == "none" else key


def hf_context_length(folder: Path) -> int:
    """A Hugging Face checkpoint's context as lm-eval's Hugging Face backend reads it: n_positions,
    max_position_embeddings or n_ctx of config.json (its text_config's first), else its tokenizer's
    model_max_length (when set: transformers' 'unset' is 1e30), else 2048."""
    config = read_config(folder)
    for section in (config.get("text_config") or {}, config):
        for key in ("n_positions", "max_position_embeddings", "n_ctx"):
            if isinstance(section.get(key), int):
                return section[key]
    tokenizer_length = tokenizer_settings(folder).get("model_max_length")
    if isinstance(tokenizer_length, int) and tokenizer_length < TOKENIZER_UNSET:
        return tokenizer_length
    return DEFAULT_CONTEXT


def _default_out(source: str, step: int | None) -> str:
    """A run's eval/results-step<N>.json, or eval-results.json here for a Hugging Face folder."""
    return "eval-results.json" if step is None else str(Path(source) / "eval" / f"results-step{step}.json")
