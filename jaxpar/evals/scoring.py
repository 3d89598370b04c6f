"""Log-likelihoods of continuations on the training layout: lm-eval's `loglikelihood` requests as jaxpar
computes them.

Each request is a row of tokens (context then continuation, cut from the left to the model's length) and
how many of its last targets are the continuation. Rows are sorted longest first and run B at a time,
right-padded to a length bucket (a power of two, at least MIN_BUCKET), so a whole task compiles a few
programs and pads little. Causal attention keeps the padding out of every real position. The program
returns the continuation tokens' log-probabilities (fp32 log-softmax of fp32 logits, zero elsewhere) and
whether every continuation token is the argmax; the host sums each row in float64 (a sum of a few hundred
log-probabilities near 1000 in fp32 would be rounded to its spacing there, 6e-5).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.config import ModelConfig
from jaxpar.config.precision import PrecisionPolicy
from jaxpar.errors import UserError
from jaxpar.model.adapters import read_as
from jaxpar.parallel.layout import Layout
from jaxpar.sampling.batched import evaluating_on, place_rows

MIN_BUCKET = 16
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
    shardings (or one device without a layout)."""

    def __init__(self, graphdef: nnx.GraphDef, model_cfg: ModelConfig, precision: PrecisionPolicy, batch: int,
                 max_length: int, layout: Layout | None = None):
        self.graphdef, self.cfg, self.precision, self.batch, self.layout = graphdef, model_cfg, precision, batch, layout
        self.max_length = max_length
        replicated = None if layout is None else NamedSharding(layout.mesh, PartitionSpec())
        self._program = jax.jit(self._score, out_shardings=replicated)

    def __call__(self, params, rows: list[tuple[list[int], int]]) -> list[Scored]:
        order = sorted(range(len(rows)), key=lambda i: (-len(rows[i][0]), rows[i][0]))
        results: list[Scored | None] = [None] * len(rows)
        for first in range(0, len(order), self.batch):
            chunk = order[first:first + self.batch]
            for i, scored in zip(chunk, self._run(params, [rows[i] for i in chunk])):
                results[i] = scored
        return results

    def _run(self, params, rows: list[tuple[list[int], int]]) -> list[Scored]:
        """One batch of at most `batch` rows (the rest padded with copies of the last)."""
        length = bucket(max(len(tokens) for tokens, _ in rows) - 1, self.max_length)
        padded = rows + [rows[-1]] * (self.batch - len(rows))
        inputs_BL = np.full((self.batch, length), PAD_ID, np.int32)
        targets_BL = np.full((self.batch, length), PAD_ID, np.int32)
        weights_BL = np.zeros((self.batch, length), np.float32)
        for b, (tokens, continuation) in enumerate(padded):
            n = len(tokens) - 1
            inputs_BL[b, :n], targets_BL[b, :n] = tokens[:-1], tokens[1:]
            weights_BL[b, n - continuation:n] = 1.0
        placed = [place_rows(a, self.layout) for a in (inputs_BL, targets_BL, weights_BL)]
        logp_BL, greedy_B = jax.device_get(self._program(params, *placed))
        sums_B = logp_BL.astype(np.float64).sum(axis=1)
        return [Scored(float(sums_B[b]), bool(greedy_B[b])) for b in range(len(rows))]

    def _score(self, params, inputs_BL: jax.Array, targets_BL: jax.Array, weights_BL: jax.Array):
        with evaluating_on(self.layout):
            return self._traced(params, inputs_BL, targets_BL, weights_BL)

    def _traced(self, params, inputs_BL, targets_BL, weights_BL):
        model = nnx.merge(self.graphdef, read_as(self.precision.cast_to_compute(params), self.precision.compute))
        logits_BLV = model(inputs_BL).astype(jnp.float32)
        logp_BLV = jax.nn.log_softmax(logits_BLV, axis=-1)
        target_logp_BL = jnp.take_along_axis(logp_BLV, targets_BL[..., None], axis=-1)[..., 0]
        counted_BL = weights_BL > 0
        greedy_B = jnp.all(jnp.where(counted_BL, jnp.argmax(logits_BLV, axis=-1) == targets_BL, True), axis=1)
        return jnp.where(counted_BL, target_logp_BL, 0.0), greedy_B
