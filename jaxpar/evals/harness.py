"""lm-evaluation-harness's `LM` interface on a jaxpar model, for lm-eval's evaluator.

Requests are tokenized and cut as lm-eval's own Hugging Face backend does (its `TemplateLM` pairs, the same
left truncation, the same rolling windows, the same stop sequences), so the two agree on the same weights:
  - loglikelihood: jaxpar.evals.scoring's compiled program, rows sorted by length and batched;
  - loglikelihood_rolling: the text's disjoint windows of the model's length, scored the same way;
  - generate_until: jaxpar.sampling.batched's generator (greedy unless do_sample; sampling takes the task's
    temperature, top_p and top_k, the last 50 unless it says, as transformers does), prompts sorted by length,
    each batch's prompt slots a power of two, then the text cut at the first stop sequence.
The prefix of an empty context (and of a rolling window) is the tokenizer's BOS, else its end-of-sequence
token; a model of bytes has neither and takes the newline byte.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from flax import nnx
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, has_bos_prefix, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from jaxpar.config import Config, ModelConfig
from jaxpar.config.precision import PrecisionPolicy
from jaxpar.data.token_folder import TextCodec, end_of_document, special_token, tokenizer_folder, tokenizer_settings
from jaxpar.errors import UserError
from jaxpar.evals.scoring import Scored, TokenScorer, bucket, request_row
from jaxpar.parallel.layout import Layout
from jaxpar.sampling.batched import BatchedGenerator, Shape
from jaxpar.sampling.choice import Sampling
from jaxpar.sampling.command import stop_ids

BYTE_PREFIX = ord("\n")  # a model of bytes: what an empty context starts from
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's Hugging Face backend's, for requests that name none
TRANSFORMERS_TOP_K = 50  # what transformers' sampling keeps when a task names no top_k


@dataclasses.dataclass(frozen=True)
class EvalModel:
    """What evaluation runs: the model's graph and weights (model order, on the layout's shardings, or on
    one device with no layout), its shape and precision, its tokenizer's folder (None: bytes), the end
    tokens generation stops at, the rows of a batch (a multiple of the mesh's data x expert) and the longest
    sequence a request runs at (0: model.seq_len; a context is cut from the left to fit)."""

    graphdef: nnx.GraphDef
    params: nnx.State
    model_cfg: ModelConfig
    precision: PrecisionPolicy
    layout: Layout | None
    tokenizer: Path | None
    stop_ids: frozenset[int] = frozenset()
    batch: int = 8
    max_length: int = 0

    @classmethod
    def of_config(cls, graphdef: nnx.GraphDef, params, cfg: Config, precision: PrecisionPolicy,
                  layout: Layout | None, batch: int, tokenizer: Path | None = None, max_length: int = 0) -> EvalModel:
        """A model of the run config `cfg`: its tokenizer the one it trains with (data.source's tokenized folder,
        or model.from_hf's) unless `tokenizer` names a folder, its end tokens model.from_hf's."""
        origin = Path(cfg.model.from_hf) if cfg.model.from_hf else None
        folder = tokenizer if tokenizer is not None else tokenizer_folder(cfg.data, cfg.model.from_hf)
        return cls(graphdef, params, cfg.model, precision, layout, folder, stop_ids(origin), batch, max_length)

    def __post_init__(self):
        learned = self.model_cfg.positions == "learned"
        if self.max_length < 0 or (learned and self.max_length > self.model_cfg.seq_len):
            raise UserError(f"the longest sequence must be positive and, with learned positions, at most "
                            f"model.seq_len={self.model_cfg.seq_len}; got {self.max_length}.")


class JaxparLM(TemplateLM):
    """An lm-eval model over an EvalModel. `requests` counts what it has answered."""

    def __init__(self, model: EvalModel, progress: bool = False):
        super().__init__()
        self.model, self.progress = model, progress
        self.codec = TextCodec(model.tokenizer)
        self._eot, self._prefix = _special_ids(self.codec, model.tokenizer)
        # lm-eval stops every generation at the end of sequence too (its Hugging Face backend adds it)
        self._stop_ids = model.stop_ids | ({self._eot} if self._eot is not None else set())
        self._prefix_text = None if model.tokenizer is None else self.codec.decode([self._prefix], skip_special=False)
        self.scorer = TokenScorer(model.graphdef, model.precision, model.batch, self.max_length, model.layout)
        self._generators: dict[tuple, BatchedGenerator] = {}
        self.requests = 0

    @property
    def eot_token_id(self) -> int | None:
        return self._eot

    @property
    def prefix_token_id(self) -> int:
        return self._prefix

    @property
    def max_length(self) -> int:
        return self.model.max_length or self.model.model_cfg.seq_len

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """As the Hugging Face backend: the tokenizer's special tokens, unless the text starts with its own."""
        if add_special_tokens is None:
            add_special_tokens = not (self._prefix_text and has_bos_prefix(string, self._prefix_text))
        return self.codec.encode(string, special=add_special_tokens)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not self.progress)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        scored = self._score([(context, continuation) for _, context, continuation in requests])
        self.requests += len(requests)
        return [(s.loglikelihood, s.is_greedy) for s in scored]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood: the sum over its disjoint windows of max_length tokens."""
        windows, owners = [], []
        for index, request in enumerate(requests):
            tokens = self.tok_encode(request.args[0])
            for window in get_rolling_token_windows(tokens, self.prefix_token_id, self.max_length, 1):
                windows.append(make_disjoint_window(window))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, scored in zip(owners, self._score(windows)):
            totals[owner] += scored.loglikelihood
        self.requests += len(requests)
        return totals

    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[Scored]:
        """(context, continuation) token pairs, cut as the Hugging Face backend cuts them, scored."""
        return self.scorer(self.model.params, [request_row(c, d, self.max_length) for c, d in pairs])

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each request's generation, grouped by its settings and sorted longest first."""
        groups: dict[str, list[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(index)
        out: list[str | None] = [None] * len(requests)
        with tqdm(total=len(requests), desc="generate", unit="request", disable=not self.progress) as bar:
            for indices in groups.values():
                for index, text in self._generate_group([requests[i].args[0] for i in indices],
                                                        requests[indices[0]].args[1], indices):
                    out[index] = text
                    bar.update(1)
        self.requests += len(requests)
        return out

    def _generate_group(self, contexts: list[str], gen_kwargs: dict, indices: list[int]):
        """(request index, text) for contexts of the same generation settings."""
        kwargs = normalize_gen_kwargs(gen_kwargs, DEFAULT_MAX_GEN_TOKS)
        eos = None if self._eot is None else self.codec.decode([self._eot], skip_special=False)
        until, new_tokens = handle_stop_sequences(kwargs.pop("until", None), eos or None), kwargs.pop("max_gen_toks")
        self._check_room("a task", new_tokens)
        prompts = [self.tok_encode(c)[-(self.max_length - new_tokens):] for c in contexts]
        order = sorted(range(len(prompts)), key=lambda i: (-len(prompts[i]), contexts[i]))
        sampling = _sampling(kwargs, self.model.model_cfg.vocab_size)
        for first in range(0, len(order), self.model.batch):
            chunk = order[first:first + self.model.batch]
            slots = bucket(len(prompts[chunk[0]]), self.max_length - new_tokens)
            generator = self._generator(Shape(self.model.batch, slots, new_tokens), sampling)
            for i, ids in zip(chunk, generator(self.model.params, [prompts[i] for i in chunk],
                                               [indices[i] for i in chunk])):
                yield indices[i], postprocess_generated_text(self.codec.decode(ids), until, None)

    def _generator(self, shape: Shape, sampling: Sampling) -> BatchedGenerator:
        key = (shape, sampling)
        if key not in self._generators:
            m = self.model
            self._generators[key] = BatchedGenerator(m.graphdef, m.model_cfg, m.precision, shape, sampling,
                                                     frozenset(self._stop_ids), m.layout)
        return self._generators[key]

    def check(self, tasks) -> None:
        """One sentence for a generation task whose new tokens leave no room for a context, or whose sampling
        settings are out of range, before any task runs."""
        vocab_size = self.model.model_cfg.vocab_size
        for task in tasks:
            if task.OUTPUT_TYPE == "generate_until":
                kwargs = normalize_gen_kwargs(task.config.generation_kwargs or {}, DEFAULT_MAX_GEN_TOKS)
                self._check_room(f"task {task.config.task}", kwargs["max_gen_toks"])
                _sampling(kwargs, vocab_size).check(vocab_size)

    def _check_room(self, asker: str, new_tokens: int) -> None:
        if new_tokens >= self.max_length:
            raise UserError(f"{asker} asks for {new_tokens} new tokens, but requests run at {self.max_length} tokens "
                            f"at most (--max-length; a run's model.seq_len).")


def _sampling(kwargs: dict, vocab_size: int) -> Sampling:
    """Greedy, unless the task samples (do_sample with a temperature): then as transformers samples, its top_k
    50 unless the task names one."""
    if not kwargs.get("do_sample") or not kwargs.get("temperature"):
        return Sampling()
    top_k = min(int(kwargs.get("top_k", TRANSFORMERS_TOP_K) or 0), vocab_size)
    return Sampling(float(kwargs["temperature"]), top_k, float(kwargs.get("top_p") or 1.0))


def _special_ids(codec: TextCodec, tokenizer: Path | None) -> tuple[int | None, int]:
    """(the end-of-sequence id or None, the prefix of an empty context) as the Hugging Face backend picks
    them: the BOS when the tokenizer has one, else the end of sequence."""
    if tokenizer is None:
        return None, BYTE_PREFIX
    settings = tokenizer_settings(tokenizer)
    eot = end_of_document(codec, settings)
    bos = special_token(settings, "bos_token")
    prefix = codec.token_to_id(bos) if bos else None
    prefix = eot if prefix is None else prefix
    if prefix is None:
        raise UserError(f"the tokenizer in {tokenizer} has neither a BOS nor an end-of-sequence token, so an "
                        f"empty context has nothing to start from.")
    return eot, prefix
