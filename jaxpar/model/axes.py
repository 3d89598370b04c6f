"""Logical axis names for parameters and activations; no mesh axis appears in model code.

Parameters carry their logical names as Flax `out_sharding` metadata, so
`nnx.get_partition_spec` and `nnx.logical_axis_rules` work on jaxpar modules as on any
Flax model (eager sharding is off: the layout is chosen by jaxpar.parallel). `logical_names`
is the one reader of that metadata, `path_names` the one spelling of a pytree path.

While a step is traced, a parallel layout acts inside the model through hooks
(`ModelHooks`): `constrain` annotates an activation's sharding by logical names,
`expert_all_to_all` moves each expert's tokens to the device holding the expert (dropless routing:
`expert_gather`, or the ragged all-to-all of `expert_exchange`), `vocab_lookup` reads the embedding's
rows, and `column_parallel` / `row_parallel` run the matmuls into and out of a tensor-parallel region
(under sequence parallelism they all-gather the sequence before, and reduce-scatter it after), and
they and the experts' matmuls (`gemm`) run as the precision policy's GEMM (fp8: jaxpar.model.fp8).
They do nothing beyond the plain einsum unless a layout installs its hooks with `layout_hooks`: the
step, evaluation and generation always do, so every one of them multiplies as the policy says.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import TYPE_CHECKING, Protocol

import jax
from flax import nnx

if TYPE_CHECKING:  # annotations only
    from jaxpar.model.scores import ScoreOptions

LOGICAL_AXES = ("batch", "seq", "residual_seq", "embed", "mlp", "heads", "kv_heads", "kv", "vocab", "expert", "layers",
                "pos")


class ModelHooks(Protocol):
    """What a parallel layout provides to the model while a step is traced."""

    @property
    def gemm(self) -> Gemm: ...

    def constrain(self, x: jax.Array, names: tuple) -> jax.Array: ...

    def expert_all_to_all(self, x_EGCD: jax.Array, inverse: bool) -> jax.Array: ...

    def expert_gather(self, x: jax.Array, inverse: bool) -> jax.Array: ...

    def expert_shard(self) -> jax.Array | int: ...

    def expert_exchange(self) -> ExpertExchange | None: ...

    def column_parallel(self, equation: str, x: jax.Array, w: jax.Array, names: tuple, out_dtype) -> jax.Array: ...

    def row_parallel(self, equation: str, h: jax.Array, w: jax.Array, names: tuple) -> jax.Array: ...

    def fp32_einsum(self, equation: str, a: jax.Array, b: jax.Array) -> jax.Array: ...

    def vocab_lookup(self, table_VD: jax.Array, tokens_BL: jax.Array) -> jax.Array: ...

    def context_attention(self, q: jax.Array, k: jax.Array, v: jax.Array, ids: jax.Array | None,
                          blocks: tuple[int, int], options: ScoreOptions | None = None,
                          sinks: jax.Array | None = None) -> jax.Array | None: ...


class Gemm(Protocol):
    """How the blocks' weight matmuls run: `einsum` (out_dtype None: the operands' result type) and the
    dropless experts' `ragged_dot`. PLAIN here; fp8 in jaxpar.model.fp8."""

    def einsum(self, equation: str, x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array: ...

    def ragged_dot(self, x_MK: jax.Array, w_GKN: jax.Array, sizes_G: jax.Array) -> jax.Array: ...


class _PlainGemm:
    """In the operands' dtype (the compute dtype)."""

    def einsum(self, equation: str, x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
        return jax.numpy.einsum(equation, x, w, preferred_element_type=out_dtype)

    def ragged_dot(self, x_MK: jax.Array, w_GKN: jax.Array, sizes_G: jax.Array) -> jax.Array:
        return jax.lax.ragged_dot(x_MK, w_GKN, sizes_G)


PLAIN: Gemm = _PlainGemm()


class ExpertExchange(Protocol):
    """Dropless routing's ragged dispatch over the `shards` devices holding the experts (jaxpar.parallel.ragged)."""

    shards: int

    def shard(self) -> jax.Array: ...

    def gathered(self, x: jax.Array) -> jax.Array: ...  # every shard's x, stacked (S, ...)

    def ragged_all_to_all(self, operand: jax.Array, output: jax.Array, input_offsets: jax.Array,
                          send_sizes: jax.Array, output_offsets: jax.Array, recv_sizes: jax.Array) -> jax.Array: ...


_hooks: contextvars.ContextVar[ModelHooks | None] = contextvars.ContextVar("jaxpar_layout", default=None)


def param(key: jax.Array, shape: tuple[int, ...], names: tuple[str | None, ...], scale: float,
          dtype=jax.numpy.float32) -> nnx.Param:
    """A normal(0, scale) parameter annotated with logical axis names."""
    assert len(names) == len(shape), (names, shape)
    value = scale * jax.random.normal(key, shape, dtype)
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


def ones_param(shape: tuple[int, ...], names: tuple[str | None, ...]) -> nnx.Param:
    """A parameter of ones (norm scales) annotated with logical axis names."""
    return nnx.Param(jax.numpy.ones(shape, jax.numpy.float32), out_sharding=names, eager_sharding=False)


def zeros_param(shape: tuple[int, ...], names: tuple[str | None, ...]) -> nnx.Param:
    """A parameter of zeros (biases) annotated with logical axis names."""
    return nnx.Param(jax.numpy.zeros(shape, jax.numpy.float32), out_sharding=names, eager_sharding=False)


def is_variable(x) -> bool:
    """Whether a pytree node is an nnx.Variable: the leaf a tree of parameters or specs is cut at."""
    return isinstance(x, nnx.Variable)


def holds_array(variable: nnx.Variable) -> bool:
    """Whether a variable holds an array (or its abstract shape), not a placeholder: None for a frozen weight's
    place in the gradients and optimizer state (model.lora), optax.MaskedNode for a weight's place in the state
    of an optimizer part that does not take it (Muon's and AdamW's, jaxpar.train.muon)."""
    return hasattr(variable.get_value(), "shape")


def logical_names(variable: nnx.Variable, ndim: int) -> tuple:
    """A variable's logical axis names, one per dimension (all None when it has none that fit:
    an optimizer statistic of another rank, such as Adafactor's factored moments)."""
    names = tuple(variable.get_metadata().get("out_sharding") or ())
    return names if len(names) == ndim else (None,) * ndim


def weight_names(weight: nnx.Variable, ndim: int) -> tuple:
    """The logical names of a weight as a layer uses it: inside the layer scan a stacked weight's
    slice has lost its leading 'layers' dimension, and its names lose 'layers' with it."""
    names = tuple(weight.get_metadata().get("out_sharding") or ())
    return names[1:] if len(names) == ndim + 1 and names[0] == "layers" else logical_names(weight, ndim)


def is_stacked(variable: nnx.Variable) -> bool:
    """Whether a variable is stacked over layers (its first logical name is 'layers')."""
    names = variable.get_metadata().get("out_sharding") or ()
    return bool(names) and names[0] == "layers"


def path_names(path) -> tuple[str, ...]:
    """A pytree path (dict keys, attributes, sequence indices) as a tuple of strings."""
    return tuple(_entry_name(entry) for entry in path)


def _entry_name(entry) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    raise TypeError(f"unsupported pytree path entry {entry!r}")


def constrain(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """Constrain an activation's sharding by logical names, if a layout is active."""
    hooks = _hooks.get()
    return x if hooks is None else hooks.constrain(x, names)


def expert_all_to_all(x_EGCD: jax.Array, inverse: bool) -> jax.Array:
    """Expert parallelism: (E, groups, C, D) -> (local experts, groups of every shard, C, D), or back."""
    hooks = _hooks.get()
    return x_EGCD if hooks is None else hooks.expert_all_to_all(x_EGCD, inverse)


def expert_gather(x: jax.Array, inverse: bool) -> jax.Array:
    """Dropless expert parallelism: every shard's tokens along axis 0 of x, or back (the sum over the
    shards of each one's own rows)."""
    hooks = _hooks.get()
    return x if hooks is None else hooks.expert_gather(x, inverse)


def expert_shard() -> jax.Array | int:
    """Which block of E / mesh.expert experts this device holds (0 without expert parallelism)."""
    hooks = _hooks.get()
    return 0 if hooks is None else hooks.expert_shard()


def expert_exchange() -> ExpertExchange | None:
    """Dropless routing by ragged all-to-all (parallel.expert_dispatch=ragged under expert parallelism): the
    layout's exchange between the expert shards; None where tokens reach the experts by `expert_gather`."""
    hooks = _hooks.get()
    return None if hooks is None else hooks.expert_exchange()


def gemm() -> Gemm:
    """How a block's weight matmuls run (the experts' too): the layout's precision policy's GEMM (fp8 or
    the compute dtype's, jaxpar.model.fp8); without a layout, plain."""
    hooks = _hooks.get()
    return PLAIN if hooks is None else hooks.gemm


def column_parallel(equation: str, x: jax.Array, weight: nnx.Variable, x_names: tuple, out_names: tuple,
                    out_dtype=None) -> jax.Array:
    """einsum(equation, x, weight) for a weight split by output columns over tensor ranks (Q/K/V,
    MLP up, logits); x is the residual stream, named `x_names`, the result `out_names`. A block's
    (out_dtype None) runs as the layout's `gemm`; the logits' wider result never in fp8."""
    w = weight[...]
    hooks = _hooks.get()
    if hooks is None:
        return jax.numpy.einsum(equation, x, w, preferred_element_type=out_dtype)
    names = (x_names, weight_names(weight, w.ndim), out_names)
    return hooks.column_parallel(equation, x, w, names, out_dtype)


def row_parallel(equation: str, h: jax.Array, weight: nnx.Variable, h_names: tuple, out_names: tuple) -> jax.Array:
    """einsum(equation, h, weight) for a weight split by input rows over tensor ranks (attention
    output, MLP down), as the layout's `gemm`: the partial sums of every rank are added into the
    residual stream."""
    w = weight[...]
    hooks = _hooks.get()
    if hooks is None:
        return jax.numpy.einsum(equation, h, w)
    return hooks.row_parallel(equation, h, w, (h_names, weight_names(weight, w.ndim), out_names))


def vocab_lookup(table_VD: jax.Array, tokens_BL: jax.Array) -> jax.Array:
    """The rows of a vocabulary-split table (the embedding) for integer tokens: (B, L, D); a layout's
    hooks may look them up per tensor rank (jaxpar.parallel.vocab)."""
    hooks = _hooks.get()
    return jax.numpy.take(table_VD, tokens_BL, axis=0) if hooks is None else hooks.vocab_lookup(table_VD, tokens_BL)


def fp32_einsum(equation: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """einsum(equation, a, b) accumulated and returned in fp32 whatever the operands' dtype (attention
    scores); a layout's hooks take its gradient back in the precision policy's output_grad dtype."""
    hooks = _hooks.get()
    if hooks is None:
        return jax.numpy.einsum(equation, a, b, preferred_element_type=jax.numpy.float32)
    return hooks.fp32_einsum(equation, a, b)


def context_attention(q_BLHK: jax.Array, k_BLGK: jax.Array, v_BLGV: jax.Array, ids_BL: jax.Array | None,
                      blocks: tuple[int, int], options: ScoreOptions | None = None,
                      sinks_H: jax.Array | None = None) -> jax.Array | None:
    """Causal attention across a sequence that a layout splits over devices (mesh.context > 1), in
    blocks of (queries, keys), with the score options (jaxpar.model.scores; None: plain) and the sinks'
    logits (H,); None when no layout does, and each device holds whole sequences."""
    hooks = _hooks.get()
    return None if hooks is None else hooks.context_attention(q_BLHK, k_BLGK, v_BLGV, ids_BL, blocks, options, sinks_H)


@contextlib.contextmanager
def layout_hooks(hooks: ModelHooks):
    """Install a layout's hooks while tracing a step."""
    token = _hooks.set(hooks)
    try:
        yield
    finally:
        _hooks.reset(token)
