"""Batched generation with a key/value cache on the training layout.

B prompts are left-padded to the same `prompt_slots` (jaxpar.model.attention.KVCache: each row's
first slot, positions counted from it), run through the model at once (prefill), and then one token a
step for every row in a `lax.while_loop` inside the same jitted program, until every row has met an end
token or `new_tokens` have come. The cache holds prompt_slots + new_tokens slots per row, preallocated,
and is split like the activations by the rules table: rows over the data axes, key/value heads over
tensor. The weights are the training state's own, read in place: nothing is copied.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.config.model import ModelConfig
from jaxpar.config.precision import PrecisionPolicy
from jaxpar.errors import UserError
from jaxpar.model.adapters import read_as
from jaxpar.model.axes import layout_hooks
from jaxpar.parallel.hooks import eval_hooks
from jaxpar.parallel.layout import Layout
from jaxpar.sampling.choice import Sampling, choose, row_keys

PAD_ID = 0  # what a left-padded prompt's slots and a stopped row's later tokens hold (never read)


@dataclasses.dataclass(frozen=True)
class Shape:
    """The compiled program's sizes: rows, prompt slots (the longest prompt it takes) and new tokens."""

    batch: int
    prompt_slots: int
    new_tokens: int

    @property
    def slots(self) -> int:
        """The cache's slots per row (the last token is chosen, never fed back)."""
        return self.prompt_slots + self.new_tokens - 1


def place_rows(array: np.ndarray, layout: Layout | None) -> jax.Array:
    """The host array (the same in every process) split by rows over the mesh, each device its slice (on
    the default device without a layout)."""
    if layout is None:
        return jnp.asarray(array)
    return jax.make_array_from_callback(array.shape, layout.batch_sharding(), lambda index: array[index])


def evaluating_on(layout: Layout | None):
    """What a model traced for inference runs under: the layout's evaluation hooks (nothing without one)."""
    return contextlib.nullcontext() if layout is None else layout_hooks(eval_hooks(layout))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Loop:
    """The decode loop's carry: the step, each row's last token, the tokens so far (B, N), which rows
    have stopped, how many tokens each row has, and the caches."""

    step: jax.Array
    last_B: jax.Array
    tokens_BN: jax.Array
    done_B: jax.Array
    lengths_B: jax.Array
    caches: object


class BatchedGenerator:
    """generate(params, prompts, rows) -> each prompt's new tokens (ending at its end token, if one came).

    One compiled program per Shape; params in model order, as the layout stores them (or on one device
    without a layout). rows: each prompt's id, which keys its draws (jaxpar.sampling.choice)."""

    def __init__(self, graphdef: nnx.GraphDef, model_cfg: ModelConfig, precision: PrecisionPolicy,
                 shape: Shape, sampling: Sampling, stop_ids: frozenset[int] = frozenset(),
                 layout: Layout | None = None):
        sampling.check(model_cfg.vocab_size)
        if model_cfg.positions == "learned" and shape.slots > model_cfg.seq_len:
            raise UserError(f"the model has learned positions for {model_cfg.seq_len} tokens; prompts of up to "
                            f"{shape.prompt_slots} plus {shape.new_tokens} new tokens do not fit.")
        self.graphdef, self.cfg, self.precision, self.shape = graphdef, model_cfg, precision, shape
        self.sampling, self.stop_ids, self.layout = sampling, np.asarray(sorted(stop_ids), np.int32), layout
        # the tokens come back whole on every device: a multi-process run's processes all read them
        replicated = None if layout is None else NamedSharding(layout.mesh, PartitionSpec())
        self._program = jax.jit(self._generate, out_shardings=replicated)

    def __call__(self, params, prompts: list[list[int]], rows: list[int] | None = None) -> list[list[int]]:
        """The new tokens of each prompt (at most shape.batch of them; fewer are padded with copies)."""
        shape = self.shape
        if not 0 < len(prompts) <= shape.batch:
            raise ValueError(f"{len(prompts)} prompts for a program of {shape.batch} rows")
        longest = max(len(p) for p in prompts)
        if longest > shape.prompt_slots or min(len(p) for p in prompts) == 0:
            raise UserError(f"a prompt of {longest} tokens does not fit the cache's {shape.prompt_slots} prompt "
                            f"slots (or is empty).")
        count = len(prompts)
        prompts = prompts + [prompts[-1]] * (shape.batch - count)
        rows = list(range(count)) if rows is None else list(rows)
        rows = rows + [rows[-1]] * (shape.batch - count)
        tokens_BP = np.full((shape.batch, shape.prompt_slots), PAD_ID, np.int32)
        starts_B = np.asarray([shape.prompt_slots - len(p) for p in prompts], np.int32)
        for row, prompt in enumerate(prompts):
            tokens_BP[row, starts_B[row]:] = prompt
        placed = [place_rows(a, self.layout) for a in (tokens_BP, starts_B, np.asarray(rows, np.int32))]
        tokens_BN, lengths_B = jax.device_get(self._program(params, *placed))
        return [tokens_BN[b, :lengths_B[b]].tolist() for b in range(count)]

    def _generate(self, params, tokens_BP: jax.Array, starts_B: jax.Array, rows_B: jax.Array):
        with evaluating_on(self.layout):
            return self._traced(params, tokens_BP, starts_B, rows_B)

    def _traced(self, params, tokens_BP: jax.Array, starts_B: jax.Array, rows_B: jax.Array):
        """Prefill, then the decode loop: (tokens (B, N), lengths (B,))."""
        shape, compute = self.shape, self.precision.compute_dtype
        model = nnx.merge(self.graphdef, read_as(self.precision.cast_to_compute(params), self.precision.compute))
        caches = model.empty_caches(self.cfg, shape.batch, shape.slots, compute, starts_B)
        logits_BPV, caches = model.decode(tokens_BP, caches)
        first_B = choose(logits_BPV[:, -1], self.sampling, row_keys(self.sampling.seed, rows_B, 0))
        B, N = shape.batch, shape.new_tokens
        loop = _Loop(jnp.ones((), jnp.int32), first_B, jnp.zeros((B, N), jnp.int32).at[:, 0].set(first_B),
                     self._stops(first_B), jnp.ones((B,), jnp.int32), caches)

        def running(loop: _Loop) -> jax.Array:
            return (loop.step < N) & ~jnp.all(loop.done_B)

        def one_token(loop: _Loop) -> _Loop:
            logits_B1V, caches = model.decode(loop.last_B[:, None], loop.caches)
            token_B = choose(logits_B1V[:, 0], self.sampling, row_keys(self.sampling.seed, rows_B, loop.step))
            token_B = jnp.where(loop.done_B, PAD_ID, token_B)
            tokens_BN = jax.lax.dynamic_update_slice(loop.tokens_BN, token_B[:, None], (0, loop.step))
            return _Loop(loop.step + 1, token_B, tokens_BN, loop.done_B | self._stops(token_B),
                         loop.lengths_B + (~loop.done_B).astype(jnp.int32), caches)

        loop = jax.lax.while_loop(running, one_token, loop)
        return loop.tokens_BN, loop.lengths_B

    def _stops(self, token_B: jax.Array) -> jax.Array:
        """Which rows' token is an end token."""
        if self.stop_ids.size == 0:
            return jnp.zeros(token_B.shape, bool)
        return jnp.any(token_B[:, None] == jnp.asarray(self.stop_ids)[None, :], axis=1)
