"""Low-rank adapters (LoRA) on frozen weights.

A target weight W (inputs x outputs, after any leading expert dimension) gains two small trainable
matrices: A (inputs x r), drawn small, and B (r x outputs), zero, so the first step computes the
base model. The layer uses W + (alpha / r) A B, formed layer by layer inside the layer scan just
before the matmul, so every layout's matmul, collectives and ZeRO expansion apply to it unchanged.

Logical names: A shares W's input names, B its output names, and the rank axis has none
(replicated). So a column-split projection splits B, a row-split one splits A, and ZeRO-3 shards
both like their weight.

Freezing: every other weight of the model becomes `Frozen`, stored as integers (its float's bit
pattern). JAX differentiates no integer input (its tangent is a zero-size float0), so the base
weights get no gradient buffer and no optimizer state, in every layout, with no executor knowing
about adapters. Reading a Frozen weight (`[...]`) gives the float back.
"""

from __future__ import annotations

import string

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.config.adapters import LoRAConfig
from jaxpar.model.axes import constrain

_BITS = {"float32": jnp.uint32, "bfloat16": jnp.uint16}
_FLOATS = {"fp32": "float32", "bf16": "bfloat16"}


class Frozen(nnx.Variable):
    """A weight that does not train, stored as the bit pattern of its float (`float` metadata: the
    dtype it reads back as). `[...]` reads the float weight."""

    def __getitem__(self, key):
        return decode(self.get_value(), self.get_metadata()["float"])[key]


def encode(value: jax.Array, dtype: str) -> jax.Array:
    """A float weight as the unsigned integers of its bits in `dtype` (float32 or bfloat16)."""
    return jax.lax.bitcast_convert_type(jnp.asarray(value).astype(dtype), _BITS[dtype])


def decode(bits: jax.Array, dtype: str) -> jax.Array:
    """The float weight of `encode`'s integers (a ShapeDtypeStruct stays abstract)."""
    if isinstance(bits, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(bits.shape, dtype, sharding=bits.sharding)
    return jax.lax.bitcast_convert_type(bits, dtype)


class Adapter(nnx.Module):
    """A and B of one target. The weight is (*batch, *inputs, *outputs): `batch` leading dimensions
    (the experts) that A and B keep, then the dimensions a token's input and output span."""

    def __init__(self, key: jax.Array, shapes: tuple[tuple, tuple, tuple], names: tuple[tuple, tuple, tuple],
                 lora: LoRAConfig):
        (batch, ins, outs), (batch_names, in_names, out_names) = shapes, names
        r = lora.rank
        fan_in = int(np.prod(ins))
        a = fan_in ** -0.5 * jax.random.normal(key, (*batch, *ins, r), jnp.float32)
        self.a = nnx.LoRAParam(a, out_sharding=(*batch_names, *in_names, None), eager_sharding=False)
        self.b = nnx.LoRAParam(jnp.zeros((*batch, r, *outs), jnp.float32),
                               out_sharding=(*batch_names, None, *out_names), eager_sharding=False)
        self.dims = (len(batch), len(ins), len(outs))
        self.scale = lora.scale

    def delta(self) -> jax.Array:
        """(alpha / r) A B, shaped like the weight."""
        nb, ni, no = self.dims
        letters = iter(string.ascii_letters.replace("r", ""))
        batch, ins, outs = ("".join(next(letters) for _ in range(n)) for n in (nb, ni, no))
        a, b = self.a[...], self.b[...]
        return self.scale * jnp.einsum(f"{batch}{ins}r,{batch}r{outs}->{batch}{ins}{outs}", a, b)


def adapters(cfg_lora: LoRAConfig, rngs: nnx.Rngs, targets: dict[str, tuple],
             target: str | None = None) -> dict[str, Adapter | None]:
    """An Adapter for each of `targets` (name -> (shapes, names) as Adapter takes them) that
    model.lora.targets names (or, given `target`, for all of them when it names that); None for the
    rest, and for all without adapters. Drawn from the `lora` stream, so the base weights come out the
    same with adapters or without."""
    chosen = cfg_lora.target_set if cfg_lora.enabled else ()
    return {name: Adapter(rngs.lora(), shapes, names, cfg_lora) if (target or name) in chosen else None
            for name, (shapes, names) in targets.items()}


def lora_output(x: jax.Array, slots: tuple[Adapter | None, ...] | Adapter | None, x_names: tuple,
                out_names: tuple, ins: int = 1) -> jax.Array | None:
    """What the adapters add to a projection's output, (alpha / r) (x A) B, computed that way round: the
    small (tokens x r) product first, so backward forms only the adapters' gradients (never the weight's)
    and a data-parallel step sums only those. x: (*lead, *inputs) named x_names; `ins` input dimensions.
    `slots`: one adapter, or one per slot of a fused projection (the result stacks them on the axis
    before the outputs, zeros where a slot has none). None where there is no adapter."""
    many = isinstance(slots, tuple)
    present = [s for s in (slots if many else (slots,)) if s is not None]
    if not present:
        return None
    lead = x.ndim - ins
    lead_names = tuple(x_names[:lead])

    def one(adapter: Adapter) -> jax.Array:
        a, b = adapter.a[...].astype(x.dtype), adapter.b[...].astype(x.dtype)
        h = jnp.tensordot(x, a, axes=(tuple(range(lead, x.ndim)), tuple(range(ins))))  # (*lead, r)
        h = constrain(h, (*lead_names, None))
        return adapter.scale * jnp.tensordot(h, b, axes=((lead,), (0,)))

    if not many:
        return constrain(one(slots), out_names)
    outs = [one(s) if s is not None else None for s in slots]
    zero = jnp.zeros_like(next(o for o in outs if o is not None))
    return constrain(jnp.stack([zero if o is None else o for o in outs], axis=lead), out_names)


def with_lora(y: jax.Array, delta: jax.Array | None) -> jax.Array:
    """A projection's output plus its adapters' (lora_output), or as it is."""
    return y if delta is None else y + delta.astype(y.dtype)


def adapted(weight: nnx.Variable, slots: tuple[Adapter | None, ...] | Adapter | None, slot_axis: int | None = None):
    """The weight as a layer uses it: W + the adapters' products. `slots`: one adapter for the whole
    weight, or one per slot along `slot_axis` of a fused weight (None where a slot has none). The
    result keeps W's logical names, so the layout treats it as W."""
    many = isinstance(slots, tuple)
    if not (any(s is not None for s in slots) if many else slots is not None):
        return weight
    w = weight[...]
    if many:
        deltas = [jnp.zeros(np.delete(w.shape, slot_axis), w.dtype) if s is None else s.delta().astype(w.dtype)
                  for s in slots]
        w = w + jnp.stack(deltas, axis=slot_axis)
    else:
        w = w + slots.delta().astype(w.dtype)
    return nnx.Param(w, out_sharding=weight.get_metadata().get("out_sharding"), eager_sharding=False)


def freeze(module: nnx.Module, lora: LoRAConfig) -> None:
    """Every weight of `module` but the adapters becomes Frozen, stored as bits of model.lora.base_dtype
    (fp32 or bf16 here; int8 and nf4 quantize: jaxpar.model.quantize)."""
    dtype = _FLOATS[lora.base_dtype]
    for _, node in list(nnx.iter_graph(module)):
        if not isinstance(node, nnx.Module):
            continue
        for name, value in list(vars(node).items()):
            if isinstance(value, nnx.Param) and not isinstance(value, nnx.LoRAParam):
                metadata = {k: v for k, v in value.get_metadata().items() if k in ("out_sharding", "eager_sharding")}
                setattr(node, name, Frozen(encode(value.get_value(), dtype), float=dtype, **metadata))


def freeze_state(state):
    """A state of Frozen variables holding floats (a checkpoint's weights, as read) with each stored
    as the integers of its `float` dtype."""
    return jax.tree.map(lambda v: v.replace(encode(v.get_value(), v.get_metadata()["float"])), state,
                        is_leaf=lambda x: isinstance(x, Frozen))


def trainable(tree):
    """The tree with its frozen leaves (a Frozen weight's integers, or their float0 gradients) as None:
    what the optimizer, the gradient sums and the update see."""
    return jax.tree.map(lambda x: x if _trains(x) else None, tree)


def with_frozen(params, updated):
    """`params` with its trainable leaves taken from `updated` (a `trainable` view of it)."""
    return jax.tree.map(lambda p, u: p if u is None else u, params, updated, is_leaf=lambda x: x is None)


def zero_grad(param) -> jax.Array:
    """A zero gradient sum in fp32 for a trainable leaf; a zero-size float0 one for a frozen leaf."""
    if _trains(param):
        return jnp.zeros(param.shape, jnp.float32)
    return np.zeros(param.shape, jax.dtypes.float0)


def _trains(x) -> bool:
    return x.dtype != jax.dtypes.float0 and jnp.issubdtype(x.dtype, jnp.inexact)
