"""The hooks a layout gives a step while it is traced: activation constraints and the expert
all-to-all for the model (jaxpar.model.axes.ModelHooks), and for the step the weights as the
model should use them (`model_weights` for the whole state, `layer_weights` for one layer
inside the layer scan) with the checkpoint policy that goes with them.

Two implementations, both complete:
- `PartitionerHooks`, for a step XLA's SPMD partitioner shards: constraints only. ZeRO-3 constrains
  a layer's weight shard to its full sharding in the compute dtype (an all-gather inside the layer
  scan) and, in a custom VJP, the fp32 gradient back to the shard (a reduce-scatter); ZeRO-2 only
  constrains the gradient.
- `ManualHooks`, inside a shard_map manual over the batch axes (expert parallelism): the collectives
  by hand. ZeRO-3 all-gathers the shard (its VJP reduce-scatters); ZeRO-2 holds the full replicated
  weight, differentiates this device's slice, and a custom VJP gives it its reduce-scattered gradient.

Both run attention across mesh.context (jaxpar.parallel.context) and the column- and row-parallel matmuls,
as the precision policy's GEMM runs them (`gemm`: in fp8 for train.precision=fp8, jaxpar.model.fp8, here
in the step, in evaluation and in generation alike): under sequence parallelism, outside any manual
shard_map, each a shard_map over tensor and the batch axes with its collective by hand
(jaxpar.parallel.sequence_matmul); inside a pipeline or expert shard_map the residual stream's constraints
leave them to XLA. Inside the step's shard_map, where an automatic axis splits the tokens as `tensor` splits
the vocabulary, the embedding lookup is written per tensor rank (jaxpar.parallel.vocab: XLA's own aborts).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.model.axes import PLAIN, Gemm, is_variable, path_names
from jaxpar.model.matmul import wide_einsum
from jaxpar.parallel import context, ragged, vocab
from jaxpar.parallel.layout import Layout
from jaxpar.parallel.reductions import moved_as_bits, rows_gathered, rows_summed, scattered
from jaxpar.parallel.rules import axis_names, logical_to_spec
from jaxpar.parallel.sequence_matmul import sequence_matmul
from jaxpar.parallel.zero import without_axes

# Primitives that expand a weight shard to the full weight (ZeRO-3 gathers, ZeRO-2 slices its
# replica; both wrapped in custom VJPs, which a checkpoint policy sees as one custom_vjp_call).
_EXPANDING_PRIMITIVES = frozenset({"all_gather", "dynamic_slice", "squeeze", "custom_vjp_call"})


def _keep_all_but_expanded_weights(primitive, *_, **__) -> bool:
    """Checkpoint policy: keep every intermediate for backward except expanded layer weights."""
    return primitive.name not in _EXPANDING_PRIMITIVES


class _Hooks:
    """What both implementations share: walking a state to expand each weight with `_expand`.
    in_step: traced inside the step's gradients (under its shard_map when it has one); False for
    code traced outside it with the stored weights (evaluation)."""

    def __init__(self, layout: Layout, in_step: bool = True):
        self.layout, self.in_step = layout, in_step
        self.expands = in_step and layout.zero.shards_gradients
        # ZeRO-2/3 expand each layer's weights from a shard; redo that in backward, never keep it.
        self.layer_weights_policy = _keep_all_but_expanded_weights if self.expands else None

    def model_weights(self, state):
        """The full non-stacked weights (embedding, head, final norm)."""
        if not self.expands:
            return state
        weights = self.layout.weights
        return jax.tree_util.tree_map_with_path(
            lambda p, v: v if weights[path_names(p)].stacked else self._expand(v, path_names(p), None),
            state, is_leaf=is_variable)

    def layer_weights(self, layer_state, index: jax.Array):
        """Layer `index`'s full weights inside the layer scan (`index`: its place in the stacked state)."""
        if not self.expands:
            return layer_state
        stack = self.layout.layer_weights_at
        return jax.tree_util.tree_map_with_path(lambda p, v: self._expand(v, stack + path_names(p), index),
                                                layer_state, is_leaf=is_variable)

    def differentiated(self, params):
        """What the step differentiates: the parameters as stored."""
        return params

    def vocab_lookup(self, table_VD, tokens_BL):
        """The embedding's rows for the tokens: per tensor rank (jaxpar.parallel.vocab) inside the step's
        shard_map where an automatic axis splits the tokens as another splits the vocabulary, else a gather."""
        parts = self._vocab_parts_by_hand()
        if parts == 1:
            return jnp.take(table_VD, tokens_BL, axis=0)
        return vocab.by_rank(table_VD, tokens_BL, parts, self.constrain)

    def _vocab_parts_by_hand(self) -> int:
        """The vocabulary's parts when its lookup is written by hand, else 1."""
        if not self._in_shard_map:
            return 1
        sizes, manual, rules = self.layout.sizes, self.layout.manual, self.layout.rules

        def automatic(names):  # the automatic mesh axes of size > 1 that split these logical axes
            return [a for entry in logical_to_spec(names, rules) for a in axis_names(entry)
                    if a not in manual and sizes[a] > 1]

        vocab_axes = automatic(("vocab",))
        return math.prod(sizes[a] for a in vocab_axes) if vocab_axes and automatic(("batch", "seq")) else 1

    def expert_exchange(self) -> ragged.Exchange | None:  # the ragged dispatch, where `expert` is manual
        return ragged.over_experts(self.layout) if self.in_step and "expert" in self.layout.manual else None

    # ---- the matmuls into and out of a tensor-parallel region -----------------------------
    @property
    def gemm(self) -> Gemm:
        """The blocks' weight matmuls: the precision policy's (jaxpar.model.fp8)."""
        return self.layout.gemm

    def column_parallel(self, equation, x, w, names, out_dtype=None):
        """A column-split matmul: a block's as the layout's GEMM runs it, the logits' (a wider out_dtype)
        with their gradient back in the layout's output_grad_dtype (jaxpar.model.matmul). Under sequence
        parallelism the residual stream x arrives split along the sequence and is all-gathered first (its
        gradient reduce-scattered back)."""
        if not self._sequence_by_hand():
            if out_dtype is None:
                return self.gemm.einsum(equation, x, w)
            return wide_einsum(equation, x, w, out_dtype, self.layout.output_grad_dtype)
        return self._over_tensor(equation, x, w, names, out_dtype, scatter=False)

    def fp32_einsum(self, equation, a, b):
        """An einsum accumulated and returned in fp32 (attention scores), its gradient back in the
        layout's output_grad_dtype."""
        return wide_einsum(equation, a, b, jnp.float32, self.layout.output_grad_dtype)

    def context_attention(self, q, k, v, ids, blocks, options=None, sinks=None):  # None: whole sequences here
        return context.attention(self.layout, q, k, v, ids, blocks, options, sinks) if self.layout.context > 1 else None

    def row_parallel(self, equation, h, w, names):
        """A row-split matmul. Under sequence parallelism its partial sums are reduce-scattered
        along the sequence (in place of the all-reduce), in fp32."""
        if not self._sequence_by_hand():
            return self.gemm.einsum(equation, h, w)
        return self._over_tensor(equation, h, w, names, None, scatter=True)

    def _sequence_by_hand(self) -> bool:
        """Sequence parallelism's collectives are written by hand where no enclosing shard_map is
        manual over any axis. Inside one (a pipeline, expert parallelism) a nested shard_map
        over `tensor` trips a check in XLA (manual axes out of mesh order, jax 0.12.0.1), so
        there the residual stream's sharding constraints leave the collectives to the partitioner."""
        return self.layout.sequence_parallel and not self._in_shard_map

    @property
    def _in_shard_map(self) -> bool:
        """Whether the hooks run inside the step's shard_map (manual over some axes)."""
        return self.in_step and bool(self.layout.manual)

    def _over_tensor(self, equation, x, w, names, out_dtype, scatter: bool):
        """The matmul written per tensor rank in a shard_map (manual over tensor and the batch
        axes), with the sequence collective by hand (jaxpar.parallel.sequence_matmul); the logits
        (a wider out_dtype) never in fp8."""
        gemm = self.gemm if out_dtype is None or scatter else PLAIN
        return sequence_matmul(self.layout, gemm, equation, x, w, names, out_dtype, scatter)


class PartitionerHooks(_Hooks):
    """Hooks for a step the compiler partitions (no shard_map, or a pipeline's manual `stage` only)."""

    def constrain(self, x: jax.Array, names: tuple) -> jax.Array:
        return jax.lax.with_sharding_constraint(x, self._sharding(logical_to_spec(names, self.layout.rules)))

    def expert_all_to_all(self, x_EGCD: jax.Array, inverse: bool) -> jax.Array:
        return x_EGCD  # experts are only split by hand (the batch axes are manual with mesh.expert > 1)

    def expert_gather(self, x: jax.Array, inverse: bool) -> jax.Array:
        return x

    def expert_shard(self) -> int:
        return 0

    def _sharding(self, spec: PartitionSpec):
        # Inside a pipeline's shard_map (manual over `stage`), a bare spec of the automatic axes.
        if self._in_shard_map:
            return without_axes(spec, self.layout.manual)
        return NamedSharding(self.layout.mesh, spec)

    def _expand(self, variable, path, layer):
        plan = self.layout.weights[path]
        if plan.zero_dim is None:
            return variable
        full, shard = plan.spec, plan.zero_spec
        if layer is not None:  # a layer's slice of a stacked weight has no 'layers' dimension
            full, shard = PartitionSpec(*full[1:]), PartitionSpec(*shard[1:])
        full, shard = self._sharding(full), self._sharding(shard)
        value = variable.get_value()
        if self.layout.zero.shards_params:
            dtype = self.layout.compute_dtype if jnp.issubdtype(value.dtype, jnp.floating) else value.dtype
            return variable.replace(_constrained_gather(value, dtype, full, shard))
        return variable.replace(_gradient_constrained(value, shard))


class ManualHooks(_Hooks):
    """Hooks inside a shard_map that is manual over the batch axes. Under ZeRO-2, `replicas`
    holds the full (replicated) weights by path, and the step differentiates the shards."""

    def __init__(self, layout: Layout, replicas: dict | None = None):
        super().__init__(layout)
        self.replicas = replicas

    @classmethod
    def for_params(cls, layout: Layout, params) -> ManualHooks:
        if not layout.zero.slices_replicated_weights:
            return cls(layout)
        flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_variable)[0]
        return cls(layout, {path_names(p): v.get_value() for p, v in flat})

    def constrain(self, x: jax.Array, names: tuple) -> jax.Array:
        """Constrain the automatic axes only."""
        return jax.lax.with_sharding_constraint(x, without_axes(logical_to_spec(names, self.layout.rules),
                                                                self.layout.manual))

    def expert_all_to_all(self, x_EGCD: jax.Array, inverse: bool) -> jax.Array:
        """Send each expert's slots to the device holding it (and back)."""
        if self.layout.sizes.get("expert", 1) == 1:
            return x_EGCD
        split, concat = (1, 0) if inverse else (0, 1)
        return jax.lax.all_to_all(x_EGCD, "expert", split, concat, tiled=True)

    def expert_gather(self, x: jax.Array, inverse: bool) -> jax.Array:
        """Every `expert` shard's rows (all-gather), or each shard's own rows summed over the shards
        (reduce-scatter): dropless routing's token exchange, whose buffers are fixed by the shapes."""
        if self.layout.sizes.get("expert", 1) == 1:
            return x
        if inverse:
            return rows_summed(x, "expert")
        if jnp.issubdtype(x.dtype, jnp.floating):
            return rows_gathered(x, "expert")
        return jax.lax.all_gather(x, "expert", axis=0, tiled=True)

    def expert_shard(self) -> jax.Array | int:
        return jax.lax.axis_index("expert") if self.layout.sizes.get("expert", 1) > 1 else 0

    def differentiated(self, params):
        """ZeRO-2: this device's slice of each replicated weight (a local slice, no communication);
        the layers look the full weights up in `replicas`."""
        if self.replicas is None:
            return params
        weights, sizes = self.layout.weights, self.layout.sizes
        return jax.tree_util.tree_map_with_path(
            lambda p, v: v if weights[path_names(p)].zero_dim is None else v.replace(
                _local_slice(v.get_value(), *weights[path_names(p)].zero_dim, sizes)), params, is_leaf=is_variable)

    def _expand(self, variable, path, layer):
        found = self.layout.weights[path].zero_dim
        if found is None:
            return variable
        d, axes = found
        shard = variable.get_value()
        if layer is not None:
            d -= 1  # a layer's slice of a stacked weight has no 'layers' dimension
        if self.layout.zero.shards_params:
            dtype = self.layout.compute_dtype if jnp.issubdtype(shard.dtype, jnp.floating) else shard.dtype
            return variable.replace(_gathered_in(shard, dtype, d, axes, self.layout.reduce_dtype))
        full = self.replicas[path]
        full = full if layer is None else jax.lax.dynamic_index_in_dim(full, layer, keepdims=False)
        return variable.replace(_replica_with_scattered_grad(shard, full.astype(shard.dtype), d, axes,
                                                             self.layout.reduce_dtype))


def _local_slice(value: jax.Array, dim: int, axes: tuple[str, ...], sizes) -> jax.Array:
    """This device's block of `value` along `dim`, split over the (data-parallel) `axes`."""
    size = value.shape[dim] // math.prod(sizes[a] for a in axes)
    return jax.lax.dynamic_slice_in_dim(value, jax.lax.axis_index(axes) * size, size, axis=dim)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _constrained_gather(shard, dtype, full, sharded):
    """Forward: the weight in the compute dtype with its full sharding (an all-gather).
    Backward: the gradient summed in fp32 and constrained to the shard (a reduce-scatter)."""
    return jax.lax.with_sharding_constraint(shard.astype(dtype), full)


def _constrained_gather_fwd(shard, dtype, full, sharded):
    return _constrained_gather(shard, dtype, full, sharded), jnp.zeros((), shard.dtype)


def _constrained_gather_bwd(dtype, full, sharded, like, grad):
    return (jax.lax.with_sharding_constraint(grad.astype(jnp.float32), sharded).astype(like.dtype),)


_constrained_gather.defvjp(_constrained_gather_fwd, _constrained_gather_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gradient_constrained(weight, sharded):
    """Forward: the weight. Backward: its gradient summed in fp32 onto the shard (ZeRO-2)."""
    return weight


def _gradient_constrained_fwd(weight, sharded):
    return weight, None


def _gradient_constrained_bwd(sharded, _, grad):
    return (jax.lax.with_sharding_constraint(grad.astype(jnp.float32), sharded).astype(grad.dtype),)


_gradient_constrained.defvjp(_gradient_constrained_fwd, _gradient_constrained_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _replica_with_scattered_grad(shard, full, dim, axes, payload):
    """Forward: the full (replicated) weight. Backward: its gradient reduce-scattered onto `shard`,
    sent as `payload` (parallel.grad_reduce_dtype)."""
    return full


def _replica_fwd(shard, full, dim, axes, payload):
    return full, None


def _replica_bwd(dim, axes, payload, _, grad):
    return scattered(grad, axes, dim, payload).astype(grad.dtype), None


_replica_with_scattered_grad.defvjp(_replica_fwd, _replica_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _gathered_in(shard, dtype, dim, axes, payload):
    """Forward: the full weight, all-gathered in the compute dtype (half the bytes of fp32 in
    bf16). Backward: its gradient reduce-scattered onto the shard, sent as `payload`
    (parallel.grad_reduce_dtype; fp32 by default whatever the compute dtype), in the shard's dtype."""
    return moved_as_bits(lambda x: jax.lax.all_gather(x, axes, axis=dim, tiled=True), shard.astype(dtype))


def _gathered_fwd(shard, dtype, dim, axes, payload):
    return _gathered_in(shard, dtype, dim, axes, payload), jnp.zeros((), shard.dtype)


def _gathered_bwd(dtype, dim, axes, payload, like, grad):
    return (scattered(grad, axes, dim, payload).astype(like.dtype),)


_gathered_in.defvjp(_gathered_fwd, _gathered_bwd)




def eval_hooks(layout: Layout) -> PartitionerHooks:
    """Hooks for code traced outside shard_map with the stored weights (evaluation)."""
    return PartitionerHooks(layout, in_step=False)
