"""Log-likelihoods of continuations on the training layout: lm-eval's `loglikelihood` requests as jaxpar
computes them.

Each request is a row of tokens (context then continuation, cut from the left to the model's length) and
how many of its last targets are the continuation. Rows are sorted longest first and run B at a time,
right-padded to a length bucket (a power of two, at least MIN_BUCKET), so a whole task compiles a few
programs and pads little. Causal attention keeps the padding out of every real position. The program
returns each target's log-probability (fp32 log-softmax of fp32 logits) and whether it is the argmax, and
the last position's whole distribution; the host sums a request's continuation in float64 (a sum of a few
hundred log-probabilities near 1000 in fp32 would be rounded to its spacing there, 6e-5).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.config.precision import PrecisionPolicy
from jaxpar.errors import UserError
from jaxpar.model.adapters import read_as
from jaxpar.parallel.layout import Layout
from jaxpar.sampling.batched import evaluating_on, place_rows

MIN_BUCKET = 8
PAD_ID = 0  # what pads a row's tail (never a target: its weight is zero)


@dataclasses.dataclass(frozen=True)
class Scored:
    """One request's result: the continuation's log-likelihood and whether greedy decoding gives it."""

    loglikelihood: float
    is_greedy: bool


def bucket(length: int, max_length: int) -> int:
    """The padded length of a row of `length` tokens: the next power of two (at least MIN_BUCKET), at most
    the model's length."""
    return min(max(MIN_BUCKET, 1 << max(length - 1, 0).bit_length()), max(max_length, length))


def request_row(context: list[int], continuation: list[int], max_length: int) -> tuple[list[int], int]:
    """The tokens (context + continuation, the last max_length + 1 of them) and the continuation's
    length, as lm-eval's Hugging Face backend cuts them (a continuation longer than max_length it refuses)."""
    if len(continuation) > max_length:
        raise UserError(f"a request's continuation has {len(continuation)} tokens, more than the "
                        f"{max_length} a sequence may hold (--max-length).")
    whole = (context + continuation)[-(max_length + 1):]
    return whole, len(continuation)


class TokenScorer:
    """score(params, rows) -> a Scored per row (rows: (tokens, continuation length) pairs, tokens at least
    two and at most max_length + 1 long). `batch` rows run at once; params in model order, on the layout's
    shardings (or one device without a layout).

    Rows whose inputs (all their tokens but the last) are the same run once, as lm-eval's Hugging Face
    backend does: the choices of a multiple-choice question that are one token each differ only in the last
    target, so one row gives them all, from the log-probabilities of its last position over the vocabulary."""

    def __init__(self, graphdef: nnx.GraphDef, precision: PrecisionPolicy, batch: int, max_length: int,
                 layout: Layout | None = None):
        self.graphdef, self.precision, self.batch, self.layout = graphdef, precision, batch, layout
        self.max_length = max_length
        replicated = None if layout is None else NamedSharding(layout.mesh, PartitionSpec())
        self._program = jax.jit(self._score, out_shardings=replicated)

    def __call__(self, params, rows: list[tuple[list[int], int]]) -> list[Scored]:
        inputs: dict[tuple[int, ...], list[int]] = {}
        for i, (tokens, _) in enumerate(rows):
            inputs.setdefault(tuple(tokens[:-1]), []).append(i)
        order = sorted(inputs, key=lambda shared: (-len(shared), shared))
        results: list[Scored | None] = [None] * len(rows)
        for first in range(0, len(order), self.batch):
            chunk = order[first:first + self.batch]
            for shared, ran in zip(chunk, self._run(params, [rows[inputs[s][0]][0] for s in chunk])):
                for i in inputs[shared]:
                    results[i] = _scored(ran, *rows[i])
        return results

    def _run(self, params, rows: list[list[int]]) -> list[tuple[np.ndarray, ...]]:
        """One batch of at most `batch` rows of tokens (the rest padded with copies of the last): each row's
        (target log-probabilities, whether each target is the argmax, its last position's log-probabilities
        over the vocabulary and argmax)."""
        length = bucket(max(len(tokens) for tokens in rows) - 1, self.max_length)
        padded = rows + [rows[-1]] * (self.batch - len(rows))
        inputs_BL = np.full((self.batch, length), PAD_ID, np.int32)
        targets_BL = np.full((self.batch, length), PAD_ID, np.int32)
        for b, tokens in enumerate(padded):
            inputs_BL[b, :len(tokens) - 1], targets_BL[b, :len(tokens) - 1] = tokens[:-1], tokens[1:]
        last_B = np.asarray([len(tokens) - 2 for tokens in padded], np.int32)
        placed = [place_rows(a, self.layout) for a in (inputs_BL, targets_BL, last_B)]
        outputs = jax.device_get(self._program(params, *placed))
        return [tuple(output[b] for output in outputs) for b in range(len(rows))]

    def _score(self, params, inputs_BL: jax.Array, targets_BL: jax.Array, last_B: jax.Array):
        with evaluating_on(self.layout):
            return self._traced(params, inputs_BL, targets_BL, last_B)

    def _traced(self, params, inputs_BL, targets_BL, last_B):
        model = nnx.merge(self.graphdef, read_as(self.precision.cast_to_compute(params), self.precision.compute))
        logits_BLV = model(inputs_BL).astype(jnp.float32)
        logp_BLV = jax.nn.log_softmax(logits_BLV, axis=-1)
        target_logp_BL = jnp.take_along_axis(logp_BLV, targets_BL[..., None], axis=-1)[..., 0]
        argmax_BL = jnp.argmax(logits_BLV, axis=-1)
        last_logp_BV = jnp.take_along_axis(logp_BLV, last_B[:, None, None], axis=1)[:, 0]
        last_argmax_B = jnp.take_along_axis(argmax_BL, last_B[:, None], axis=1)[:, 0]
        return target_logp_BL, argmax_BL == targets_BL, last_logp_BV, last_argmax_B


def _scored(ran: tuple[np.ndarray, ...], tokens: list[int], continuation: int) -> Scored:
    """A request's result from the row that ran its inputs: the targets before its last from the row's own
    (they are the same tokens), its last target from the last position's distribution; summed in float64."""
    target_logp_L, greedy_L, last_logp_V, last_argmax = ran
    n = len(tokens) - 1  # targets: positions 0 .. n - 1, the continuation the last `continuation` of them
    before = slice(n - continuation, n - 1)
    total = float(np.sum(target_logp_L[before].astype(np.float64)) + np.float64(last_logp_V[tokens[-1]]))
    return Scored(total, bool(np.all(greedy_L[before]) and last_argmax == tokens[-1]))
