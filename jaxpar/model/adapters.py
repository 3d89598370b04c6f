"""Low-rank adapters (LoRA) on frozen weights.

A target weight W (inputs x outputs, after any leading expert dimension) gains two small trainable
matrices: A (inputs x r), drawn small, and B (r x outputs), zero, so the first step computes the
base model. A projection adds (alpha / r) (x A) B to x W (lora_output): the small product first, so
backward forms only the adapters' gradients. The routed experts' weights take W + (alpha / r) A B,
formed layer by layer inside the layer scan (adapted), which their grouped matmuls take as they are.

Logical names: A shares W's input names, B its output names, and the rank axis has none
(replicated). So a column-split projection splits B, a row-split one splits A, and ZeRO-3 shards
both like their weight.

Freezing: every other weight of the model becomes `Frozen`, stored as integers (its float's bit
pattern). JAX differentiates no integer input (its tangent is a zero-size float0), so the base
weights get no gradient buffer and no optimizer state, in every layout, with no executor knowing
about adapters. Reading a Frozen weight (`[...]`) gives the float back.

Quantized (model.lora.base_dtype int8 or nf4, QLoRA): the projections' weights (QUANTIZED) are stored
as blocks of 64 along their 'embed' dimension, each its codes and its bf16 scale packed into uint16 words
(jaxpar.model.quantize.pack: 34 bytes a block for nf4, 66 for int8), still one variable of the weight's
rank and names; reading one unpacks it to float32, inside the layer scan, one layer at a time. The
embeddings, norms, routers and biases stay bf16 bits.
"""

from __future__ import annotations

import string

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.config.adapters import LORA_TARGETS, LoRAConfig
from jaxpar.model import quantize
from jaxpar.model.axes import constrain, is_variable

_BITS = {"float32": jnp.uint32, "bfloat16": jnp.uint16}
_FLOAT_OF_BITS = {jnp.dtype(jnp.uint32): jnp.float32, jnp.dtype(jnp.uint16): jnp.bfloat16}
_FLOATS = {"fp32": "float32", "bf16": "bfloat16"}
# The weights int8 and nf4 quantize (by attribute): attention's and the MLP's projections, the experts' matrices.
QUANTIZED = frozenset({"w_qkv", "w_q", "w_kv", "wo", "w_gate_up", "w_up", "w_down"})


class Frozen(nnx.Variable):
    """A weight that does not train, stored as the bit pattern of its float, or quantized and packed.
    Metadata: `float`, the dtype it reads back as; `bits`, the float whose bits are stored where that
    differs (bfloat16 under int8 and nf4); `quantized`, (kind, blocked axis from the end) for a quantized
    one. `[...]` reads the float weight."""

    def __getitem__(self, key):
        metadata = self.get_metadata()
        return decode(self.get_value(), metadata["float"], metadata.get("quantized"))[key]

    def encoded(self, value: jax.Array) -> Frozen:
        """This variable holding float `value` stored as its metadata says."""
        metadata = self.get_metadata()
        return self.replace(encode(value, metadata.get("bits") or metadata["float"], metadata.get("quantized")))


def encode(value: jax.Array, dtype: str, quantized: tuple[str, int] | None = None) -> jax.Array:
    """A float weight as the unsigned integers of its bits in `dtype` (float32 or bfloat16), or, given
    `quantized` (kind, axis), its blocks quantized and packed (jaxpar.model.quantize.pack)."""
    if quantized is not None:
        return quantize.pack(jnp.asarray(value, jnp.float32), *quantized)
    return jax.lax.bitcast_convert_type(jnp.asarray(value).astype(dtype), _BITS[dtype])


def decode(stored: jax.Array, dtype: str, quantized: tuple[str, int] | None = None) -> jax.Array:
    """The float weight, in `dtype`, of `encode`'s integers (a ShapeDtypeStruct stays abstract: the float
    weight's shape, with the stored sharding)."""
    if isinstance(stored, jax.ShapeDtypeStruct):
        shape = stored.shape if quantized is None else quantize.unpacked_shape(stored.shape, *quantized)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=stored.sharding)
    if quantized is not None:
        return quantize.unpack(stored, *quantized, dtype)
    return jax.lax.bitcast_convert_type(stored, _FLOAT_OF_BITS[jnp.dtype(stored.dtype)]).astype(dtype)


class Adapter(nnx.Module):
    """A and B of one target. The weight is (*batch, *inputs, *outputs): `batch` leading dimensions
    (the experts) that A and B keep, then the dimensions a token's input and output span."""

    def __init__(self, key: jax.Array, shapes: tuple[tuple, tuple, tuple], names: tuple[tuple, tuple, tuple],
                 lora: LoRAConfig, tag: int = 0):
        (batch, ins, outs), (batch_names, in_names, out_names) = shapes, names
        r = lora.rank
        fan_in = int(np.prod(ins))
        a = fan_in ** -0.5 * jax.random.normal(key, (*batch, *ins, r), jnp.float32)
        self.a = nnx.LoRAParam(a, out_sharding=(*batch_names, *in_names, None), eager_sharding=False)
        self.b = nnx.LoRAParam(jnp.zeros((*batch, r, *outs), jnp.float32),
                               out_sharding=(*batch_names, None, *out_names), eager_sharding=False)
        self.dims = (len(batch), len(ins), len(outs))
        self.scale = lora.scale
        self.dropout, self.tag = lora.dropout, tag  # tag: its own dropout stream (the target's index)

    def delta(self) -> jax.Array:
        """(alpha / r) A B, shaped like the weight (and like a stack of them: leading layer dimensions
        are kept as the expert ones are)."""
        _, ni, no = self.dims
        letters = iter(string.ascii_letters.replace("r", ""))
        ins, outs = ("".join(next(letters) for _ in range(n)) for n in (ni, no))
        return self.scale * jnp.einsum(f"...{ins}r,...r{outs}->...{ins}{outs}", self.a[...], self.b[...])


def adapters(cfg_lora: LoRAConfig, rngs: nnx.Rngs, targets: dict[str, tuple],
             target: str | None = None) -> dict[str, Adapter | None]:
    """An Adapter for each of `targets` (name -> (shapes, names) as Adapter takes them) that
    model.lora.targets names (or, given `target`, for all of them when it names that); None for the
    rest, and for all without adapters. Drawn from the `lora` stream, so the base weights come out the
    same with adapters or without."""
    chosen = cfg_lora.target_set if cfg_lora.enabled else ()
    return {name: Adapter(rngs.lora(), shapes, names, cfg_lora, LORA_TARGETS.index(target or name))
            if (target or name) in chosen else None for name, (shapes, names) in targets.items()}


def lora_output(x: jax.Array, slots: tuple[Adapter | None, ...] | Adapter | None, x_names: tuple,
                out_names: tuple, ins: int = 1, keys_B: jax.Array | None = None) -> jax.Array | None:
    """What the adapters add to a projection's output, (alpha / r) (x A) B, computed that way round: the
    small (tokens x r) product first, so backward forms only the adapters' gradients (never the weight's)
    and a data-parallel step sums only those. x: (*lead, *inputs) named x_names; `ins` input dimensions.
    `slots`: one adapter, or one per slot of a fused projection (the result stacks them on the axis
    before the outputs, zeros where a slot has none). None where there is no adapter. keys_B (training):
    a PRNG key per row for model.lora.dropout on x (see dropped)."""
    many = isinstance(slots, tuple)
    present = [s for s in (slots if many else (slots,)) if s is not None]
    if not present:
        return None
    lead = x.ndim - ins
    lead_names = tuple(x_names[:lead])

    def one(adapter: Adapter) -> jax.Array:
        a, b = adapter.a[...].astype(x.dtype), adapter.b[...].astype(x.dtype)
        x_in = dropped(x, adapter, keys_B)
        h = jnp.tensordot(x_in, a, axes=(tuple(range(lead, x.ndim)), tuple(range(ins))))  # (*lead, r)
        h = constrain(h, (*lead_names, None))
        return adapter.scale * jnp.tensordot(h, b, axes=((lead,), (0,)))

    if not many:
        return constrain(one(slots), out_names)
    outs = [one(s) if s is not None else None for s in slots]
    zero = jnp.zeros_like(next(o for o in outs if o is not None))
    return constrain(jnp.stack([zero if o is None else o for o in outs], axis=lead), out_names)


def dropped(x: jax.Array, adapter: Adapter, keys_B: jax.Array | None) -> jax.Array:
    """x with each element zeroed with probability model.lora.dropout and the rest scaled by 1 / (1 - p),
    while training (keys_B given). Each row's mask comes from its own key (the step's, folded with the row,
    the layer and the adapter's tag), so no layout, microbatch or device changes which elements drop."""
    if keys_B is None or not adapter.dropout:
        return x
    keep = 1.0 - adapter.dropout
    mask = jax.vmap(lambda key: jax.random.bernoulli(jax.random.fold_in(key, 1000 + adapter.tag), keep,
                                                     x.shape[1:]))(keys_B)
    return jnp.where(mask, x / keep, 0).astype(x.dtype)


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
        deltas = [jnp.zeros(np.delete(w.shape, slot_axis % w.ndim), w.dtype) if s is None
                  else s.delta().astype(w.dtype) for s in slots]
        w = w + jnp.stack(deltas, axis=slot_axis)
    else:
        w = w + slots.delta().astype(w.dtype)
    return nnx.Param(w, out_sharding=weight.get_metadata().get("out_sharding"), eager_sharding=False)


# Each adapted weight (by attribute, in attention, the MLP and the experts) and its adapters: one for the
# whole weight, or one per slot of a fused weight along the given axis (from the end, so that it holds for
# a stack of layers too).
ADAPTED = {"w_qkv": (("lora_q", "lora_k", "lora_v"), -3), "w_q": ("lora_q", None),
           "w_kv": (("lora_k", "lora_v"), -3), "wo": ("lora_o", None),
           "w_gate_up": (("lora_gate", "lora_up"), -2), "w_up": ("lora_up", None), "w_down": ("lora_down", None)}


def merged_weights(model: nnx.Module) -> dict[tuple, jax.Array]:
    """Every weight of a model with adapters as a float array, the adapters merged in (W + (alpha / r) A B),
    by path: the weights of the same model without adapters (export, the merged checkpoint)."""
    merged = {}
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Module):
            continue
        for name, value in vars(node).items():
            if not isinstance(value, nnx.Variable) or isinstance(value, nnx.LoRAParam):
                continue
            names, axis = ADAPTED.get(name, (None, None))
            slots = (tuple(getattr(node, n, None) for n in names) if isinstance(names, tuple)
                     else getattr(node, names, None) if names else None)
            merged[(*map(str, path), name)] = adapted(value, slots, axis)[...]
    return merged


def freeze(module: nnx.Module, lora: LoRAConfig) -> None:
    """Every weight of `module` but the adapters becomes Frozen, stored as bits of model.lora.base_dtype
    (fp32 or bf16). With int8 or nf4 every one reads back as float32: the QUANTIZED weights quantized along
    their 'embed' dimension (jaxpar.model.quantize), every other one stored as bf16 bits."""
    for _, node in list(nnx.iter_graph(module)):
        if not isinstance(node, nnx.Module):
            continue
        for name, value in list(vars(node).items()):
            if isinstance(value, nnx.Param) and not isinstance(value, nnx.LoRAParam):
                metadata = {k: v for k, v in value.get_metadata().items() if k in ("out_sharding", "eager_sharding")}
                storage = _storage(name, metadata, lora)
                stored = encode(value.get_value(), storage.get("bits") or storage["float"], storage.get("quantized"))
                setattr(node, name, Frozen(stored, **metadata, **storage))


def _storage(name: str, metadata: dict, lora: LoRAConfig) -> dict:
    """How `freeze` stores the weight `name` (the Frozen metadata besides its logical names)."""
    if lora.base_dtype not in quantize.KINDS:  # read back as fp32 (the step reads it in its compute dtype)
        return {"float": "float32", "bits": _FLOATS[lora.base_dtype]}
    names = tuple(metadata.get("out_sharding") or ())
    if name in QUANTIZED and "embed" in names:  # the blocked axis counted from the end: it holds for any stacking
        return {"float": "float32", "quantized": (lora.base_dtype, names.index("embed") - len(names))}
    return {"float": "float32", "bits": "bfloat16"}


def freeze_state(state):
    """A state of Frozen variables holding floats (a checkpoint's weights, as read) with each stored as
    `freeze` stores it: the integers of its `float` dtype, or quantized as its `quantized` metadata says.
    Each keeps its sharding: a quantized weight's float and packed forms split at the same blocks."""
    return jax.tree.map(lambda v: v.encoded(v.get_value()), state, is_leaf=lambda x: isinstance(x, Frozen))


def read_as(params, dtype: str):
    """`params` with every Frozen weight reading back in `dtype`, as stored (for the precision policy's compute
    dtype: the frozen weights then enter the matmuls as the trained ones do after their cast; without it a
    weight reads back as its `float` metadata says, and an fp32 read makes the model compute in fp32)."""
    def one(v):  # `bits` keeps what is stored, so that `encoded` still stores the same
        return v.replace(float=dtype, bits=v.get_metadata().get("bits") or v.get_metadata()["float"])

    return jax.tree.map(lambda v: one(v) if isinstance(v, Frozen) else v, params,
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


def without_adapters(params):
    """The parameters with every LoRA adapter's B zeroed: the base model (W + (alpha / r) A 0 = W), DPO's
    reference."""
    def zeroed(path, variable):
        if isinstance(variable, nnx.LoRAParam) and path and getattr(path[-1], "key", None) == "b":
            return variable.replace(jnp.zeros_like(variable.get_value()))
        return variable

    return jax.tree_util.tree_map_with_path(zeroed, params, is_leaf=is_variable)
