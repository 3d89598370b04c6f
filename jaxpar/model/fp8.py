"""FP8 GEMMs (train.precision=fp8): the blocks' weight matmuls with e4m3 operands forward and an e5m2
gradient backward, each tensor quantized with its own current, power-of-two scale.

A quantized tensor is x8 = round(x s) in the fp8 dtype, where s comes from the tensor's amax taken in the
step itself (current scaling: torchtitan's "tensorwise" recipe), and the matmul's fp32 result is
multiplied by 1 / (s_x s_w) after the GEMM. Forward: x and w in e4m3 (3 mantissa bits; max 448);
backward: the incoming gradient in e5m2 (2 mantissa bits, range to 57344, as gradients need), and
dx = g8 . w8, dw = x8 . g8 with the forward's f8 operands kept as the residuals (no bf16 copy is kept).
Mixed e5m2 x e4m3 is what cuBLASLt and XLA:GPU take; e5m2 x e5m2 they do not, so the backward never
multiplies two gradients. The f8 arrays themselves are the dot's operands, with an fp32 result
(preferred_element_type), so XLA:GPU compiles f8 GEMMs rather than converting them back to bf16 first
(Triton's, or cuBLASLt's __cublas$lt$matmul$f8: `jaxpar plan --target h100`, docs/memory.md); XLA:CPU
upcasts them inside the dot, which emulates the same numbers.

Why the scale is a power of two (torchtitan's round_scales_to_power_of_2; the MX formats do the same):
s = 2^floor(log2(max / amax)). Multiplying by a power of two only moves the exponent, and floating-point
rounding is invariant under it: round(x 2^k) = 2^k round(x) while both stay in the normal range. So a
value quantizes to the same fp8 value, once descaled, whether its scale came from the amax of the whole
batch, of one microbatch or of one device's shard, as long as neither scaled value falls into e4m3's
subnormals (below 2^-6, where the spacing is absolute rather than relative: only that tail of tiny
values can differ). Every layout therefore quantizes as the single-device reference does, without any
cross-device amax reduction: inside jaxpar's shard_maps (expert parallelism, pipelines, the
sequence-parallel matmuls) each device takes its own shard's amax, each microbatch its own, and where
XLA's partitioner shards a tensor it takes the global amax (a scalar all-reduce it inserts); the numbers
agree. A scale of max / amax without rounding would differ from shard to shard in every mantissa bit.

Not built: delayed scaling (a history of past amaxes, Transformer Engine's default). Its amax history
is state that would have to be threaded through the step, the checkpoint and every layout's carry, and
a tensor whose amax jumps beyond the history's saturates until the history catches up. Current scaling
needs no state and takes the jump in the same step (tests/test_fp8.py, an amax 1e4 times larger).

Which matmuls: attention's Q/K/V and output projections and the MLP's up/gate/down (through
jaxpar.model.axes.column_parallel / row_parallel), the experts' (dense slots and dropless rows). Not the
embedding, the head's logits, the router, attention's scores and softmax, nor the norms.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxpar.model.axes import PLAIN, Gemm

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
_F32 = jnp.float32
# The scale's exponent stays where 2^k and 2^-k are normal fp32 numbers (an all-zero tensor: max's own exponent).
_MAX_EXPONENT = 126


def scale_exponent(amax: jax.Array, dtype) -> jax.Array:
    """k = floor(log2(max(dtype) / amax)), exactly: the largest k with amax 2^k <= max, from the exponents
    of amax and max (no division to round). amax = m 2^e and max = M 2^E with m, M in [0.5, 1)."""
    top_mantissa, top_exponent = jnp.frexp(jnp.asarray(jnp.finfo(dtype).max, _F32))
    mantissa, exponent = jnp.frexp(amax.astype(_F32))
    k = top_exponent - exponent - (mantissa > top_mantissa).astype(exponent.dtype)
    return jnp.clip(k, -_MAX_EXPONENT, _MAX_EXPONENT)


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """(x8, 1 / s): x times its power-of-two current scale s, rounded to the fp8 `dtype`, and the scale to
    multiply a product of x8 by. A non-finite amax leaves a non-finite x8 (e4m3 has no infinity: NaN),
    which the step's finiteness check sees."""
    k = scale_exponent(jnp.max(jnp.abs(x)), dtype)
    one = jnp.ones((), _F32)
    return (x.astype(_F32) * jnp.ldexp(one, k)).astype(dtype), jnp.ldexp(one, -k)


def _bits(x8: jax.Array) -> jax.Array:
    """An f8 residual kept as its bit patterns. jax's remat (ZeRO-3's layer policy, train.remat) passes every
    floating residual it saves through reduce_precision with the dtype's finfo (4 exponent and 3 mantissa
    bits for e4m3fn), which XLA rounds as IEEE e4m3: largest finite 240, so e4m3fn's top binade (256 to 448,
    where every amax lands) would come back as infinity, NaN once cast back. Integers it leaves alone."""
    return jax.lax.bitcast_convert_type(x8, jnp.uint8)


def _f8(bits: jax.Array, dtype) -> jax.Array:
    return jax.lax.bitcast_convert_type(bits, dtype)


def _descaled(product: jax.Array, first: jax.Array, second: jax.Array, dtype) -> jax.Array:
    """An fp32 product of two quantized operands times their inverse scales (one after the other: their
    product could underflow), in `dtype`."""
    return (product * first * second).astype(dtype)


@functools.cache
def _transposed(equation: str) -> tuple[str, str]:
    """The einsums of an einsum's gradients: (g, w -> dx) and (x, g -> dw) for `equation` 'x,w->y'. Each
    index of an operand must appear in the other or in the result (else its gradient is a broadcast)."""
    inputs, out = equation.replace(" ", "").split("->")
    x, w = inputs.split(",")
    if any(i not in w + out for i in x) or any(i not in x + out for i in w):
        raise ValueError(f"fp8 einsum {equation!r}: an index summed within one operand has no matmul gradient")
    return f"{out},{w}->{x}", f"{x},{out}->{w}"


def fp8_einsum(equation: str, x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    """einsum(equation, x, w) as an fp8 GEMM: in out_dtype (None: the operands' result type)."""
    _transposed(equation)  # refuse an equation whose gradient is not two einsums before tracing it
    dtypes = (jnp.dtype(x.dtype), jnp.dtype(w.dtype), jnp.dtype(out_dtype or jnp.result_type(x, w)))
    return _einsum(equation, dtypes, x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _einsum(equation, dtypes, x, w):
    return _einsum_fwd(equation, dtypes, x, w)[0]


def _einsum_fwd(equation, dtypes, x, w):
    (x8, x_inverse), (w8, w_inverse) = quantize(x, E4M3), quantize(w, E4M3)
    product = jnp.einsum(equation, x8, w8, preferred_element_type=_F32)
    return _descaled(product, x_inverse, w_inverse, dtypes[2]), (_bits(x8), x_inverse, _bits(w8), w_inverse)


def _einsum_bwd(equation, dtypes, residuals, grad):
    x_bits, x_inverse, w_bits, w_inverse = residuals
    x8, w8 = _f8(x_bits, E4M3), _f8(w_bits, E4M3)
    g8, g_inverse = quantize(grad, E5M2)
    dx_equation, dw_equation = _transposed(equation)
    dx = jnp.einsum(dx_equation, g8, w8, preferred_element_type=_F32)
    dw = jnp.einsum(dw_equation, x8, g8, preferred_element_type=_F32)
    return _descaled(dx, g_inverse, w_inverse, dtypes[0]), _descaled(dw, x_inverse, g_inverse, dtypes[1])


_einsum.defvjp(_einsum_fwd, _einsum_bwd)

# ragged_dot's weight gradient: rows (the ragged dimension) contracted group by group into (G, K, N).
_RAGGED_WEIGHT_GRAD = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((0,), (0,)), ((), ())),
                                                        lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


def fp8_ragged_dot(x_MK: jax.Array, w_GKN: jax.Array, sizes_G: jax.Array) -> jax.Array:
    """jax.lax.ragged_dot(x_MK, w_GKN, sizes_G) (rows sorted by group, sizes_G rows each) as an fp8 GEMM."""
    dtypes = (jnp.dtype(x_MK.dtype), jnp.dtype(w_GKN.dtype), jnp.dtype(jnp.result_type(x_MK, w_GKN)))
    return _ragged(dtypes, x_MK, w_GKN, sizes_G)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ragged(dtypes, x, w, sizes):
    return _ragged_fwd(dtypes, x, w, sizes)[0]


def _ragged_fwd(dtypes, x, w, sizes):
    (x8, x_inverse), (w8, w_inverse) = quantize(x, E4M3), quantize(w, E4M3)
    product = jax.lax.ragged_dot(x8, w8, sizes, preferred_element_type=_F32)
    return _descaled(product, x_inverse, w_inverse, dtypes[2]), (_bits(x8), x_inverse, _bits(w8), w_inverse, sizes)


def _ragged_bwd(dtypes, residuals, grad):
    x_bits, x_inverse, w_bits, w_inverse, sizes = residuals
    x8, w8 = _f8(x_bits, E4M3), _f8(w_bits, E4M3)
    g8, g_inverse = quantize(grad, E5M2)
    dx = jax.lax.ragged_dot(g8, w8.swapaxes(1, 2), sizes, preferred_element_type=_F32)
    dw = jax.lax.ragged_dot_general(x8, g8, sizes, _RAGGED_WEIGHT_GRAD, preferred_element_type=_F32)
    return _descaled(dx, g_inverse, w_inverse, dtypes[0]), _descaled(dw, x_inverse, g_inverse, dtypes[1]), None


_ragged.defvjp(_ragged_fwd, _ragged_bwd)


class Fp8Gemm:
    """The blocks' weight matmuls in fp8 (jaxpar.model.axes.Gemm)."""

    def einsum(self, equation: str, x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
        return fp8_einsum(equation, x, w, out_dtype)

    def ragged_dot(self, x_MK: jax.Array, w_GKN: jax.Array, sizes_G: jax.Array) -> jax.Array:
        return fp8_ragged_dot(x_MK, w_GKN, sizes_G)


# the precision policy's `gemm` -> how the blocks' weight matmuls run (jaxpar.config.precision)
GEMMS: dict[str, Gemm] = {"compute": PLAIN, "fp8": Fp8Gemm()}
