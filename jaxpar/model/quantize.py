"""Blockwise quantization of frozen base weights (QLoRA): NF4 or int8 codes with one scale per block.

A block is BLOCK consecutive elements along one chosen axis of the weight. The codes keep the weight's
shape and the scales have it with that axis divided by BLOCK, so both have the weight's rank and take its
logical axis names: jaxpar's sharding rules, one name per dimension, apply to them unchanged, and a layer
dequantizes only its own shard just before its matmul.

Codes are 4 bits (nf4) or 8 (int8) and scales bfloat16: NF4 costs 0.5 + 2/64 = 0.53125 bytes per parameter,
int8 1 + 2/64 = 1.03125, as XLA's `compiled.memory_analysis()` counts the packed form below.

A frozen weight is one variable (jaxpar.model.adapters.Frozen), so `pack` puts codes and scales in one
uint16 array of the weight's rank: along the blocked axis each block of 64 becomes its codes packed into
words (nf4: four 4-bit codes a word, int8: two bytes) followed by one word, its scale's bfloat16 bits: 17
words (34 bytes) for nf4, 33 (66 bytes) for int8, the same bytes as codes and scales apart. A block's word
count is odd, so a split of the packed axis into a power-of-two number of equal parts (ZeRO's, the only
layouts that split it) always splits whole blocks, at the same places as the float weight's.
Both kinds store the block's absmax as its scale (for int8 too, not absmax / 127), so a dequantized value
is always code_book[code] * scale: NF4_CODE_BOOK for nf4, arange(-127, 128) / 127 for int8. The absmax is
rounded *up* to bfloat16, so every element of a block divided by its stored scale lies in [-1, 1] and the
round-trip error is at most round_trip_error_bound(kind) times the stored scale.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 64
KINDS = ("nf4", "int8")
SCALE_DTYPE = jnp.bfloat16
CODE_DTYPES = {"nf4": jnp.uint4, "int8": jnp.int8}
INT8_LEVELS = 127  # symmetric int8: codes in [-127, 127], -128 unused
WORD = jnp.uint16  # what `pack` stores: a block's codes packed into words, then its scale's bits
CODES_PER_WORD = {"nf4": 4, "int8": 2}

# The 4-bit NormalFloat code book (Dettmers et al. 2023, "QLoRA", section 3 and appendix E). Its values are
# quantiles of N(0, 1), so that for normally distributed weights each code is about equally likely, scaled
# to [-1, 1]. It is asymmetric so that 0 is exact: 8 quantiles on the negative side (-1 to 0) and 9 on the
# positive side (0 to 1), both sets holding 0, put together with the shared 0 kept once: 7 + 1 + 8 = 16.
NF4_CODE_BOOK = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
], dtype=np.float32)


def code_book(kind: str) -> np.ndarray:
    """The values a code decodes to, before the block's scale (read at call time, so tests can swap it)."""
    _check_kind(kind)
    if kind == "nf4":
        return np.asarray(NF4_CODE_BOOK, dtype=np.float32)
    return np.arange(-INT8_LEVELS, INT8_LEVELS + 1, dtype=np.float32) / INT8_LEVELS


def quantize(w: jax.Array, kind: str, axis: int) -> tuple[jax.Array, jax.Array]:
    """The weight as (codes, scales): codes in w's shape, scales in w's shape with `axis` divided by BLOCK."""
    _check_kind(kind)
    axis = _blocked_axis(w.shape, axis)
    w_blocked = _split_blocks(w.astype(jnp.float32), axis)  # (..., n_blocks, BLOCK, ...)
    scale = _round_up_to_bf16(jnp.max(jnp.abs(w_blocked), axis=axis + 1))
    safe_scale = jnp.where(scale == 0, jnp.ones_like(scale), scale)  # an all-zero block: codes of 0
    normalized = w_blocked / jnp.expand_dims(safe_scale.astype(jnp.float32), axis + 1)  # in [-1, 1]
    if kind == "nf4":
        codes = nearest_codes(normalized, code_book("nf4")).astype(CODE_DTYPES["nf4"])
    else:
        codes = jnp.clip(jnp.round(normalized * INT8_LEVELS), -INT8_LEVELS, INT8_LEVELS).astype(jnp.int8)
    return codes.reshape(w.shape), scale


def nearest_codes(normalized: jax.Array, book) -> jax.Array:
    """The index of the nearest value of a sorted code book to each element (int32). A binary search against
    the midpoints between neighbouring values: no (elements x 16) distance table is materialised."""
    book = np.asarray(book, dtype=np.float32)
    midpoints = jnp.asarray((book[1:] + book[:-1]) / 2)
    return jnp.searchsorted(midpoints, normalized, side="left").astype(jnp.int32)


def dequantize(codes: jax.Array, scales: jax.Array, kind: str, axis: int, dtype) -> jax.Array:
    """The weight back in `dtype`: code_book[code] * its block's scale, computed in float32. Elementwise
    after a reshape that only splits `axis`, so a sharded weight dequantizes shard by shard."""
    _check_kind(kind)
    axis = _blocked_axis(codes.shape, axis)
    codes_blocked = _split_blocks(codes, axis)
    if kind == "nf4":
        values = _look_up(codes_blocked.astype(jnp.int32), code_book("nf4"))
    else:
        values = codes_blocked.astype(jnp.float32) / INT8_LEVELS
    w_blocked = values * jnp.expand_dims(scales.astype(jnp.float32), axis + 1)
    return w_blocked.reshape(codes.shape).astype(dtype)


def _look_up(indices: jax.Array, book: np.ndarray) -> jax.Array:
    """book[indices], a gather from the 16 values: inside a differentiated layer scan, an elementwise chain
    of selects against the book's values broadcast to the weight's shape had JAX hoist those 16 full-size
    constants out of the loop (16 float32 copies of the weight's size, measured), a gather holds 16 floats.
    Its result is sharded like `indices`."""
    return jnp.asarray(book)[indices]


def bytes_per_parameter(kind: str) -> float:
    """Storage per weight element, its share of the block's scale included: what `pack` stores a block in."""
    return words_per_block(kind) * jnp.dtype(WORD).itemsize / BLOCK


def round_trip_error_bound(kind: str) -> float:
    """The largest |w - dequantize(quantize(w))| in a block, as a multiple of its stored scale: half the
    largest gap between neighbouring code-book values (int8: half a step, 0.5 / 127)."""
    if kind == "int8":
        return 0.5 / INT8_LEVELS  # exactly; the float32 book's gaps differ from 1 / 127 in the last bit
    return float(np.max(np.diff(code_book(kind)))) / 2


def words_per_block(kind: str) -> int:
    """The uint16 words `pack` stores a block of BLOCK elements in: its codes, then its scale (17 or 33)."""
    _check_kind(kind)
    return BLOCK // CODES_PER_WORD[kind] + 1


def pack(w: jax.Array, kind: str, axis: int) -> jax.Array:
    """`quantize`'s codes and scales in one uint16 array of w's rank: along `axis` each block becomes its codes
    (nf4: four to a word, the first in the low bits; int8: two, as their bytes) followed by its scale's
    bfloat16 bits. Only that axis changes length (BLOCK -> words_per_block(kind) per block)."""
    codes, scales = quantize(w, kind, axis)
    axis = _blocked_axis(w.shape, axis)
    per, width = CODES_PER_WORD[kind], 16 // CODES_PER_WORD[kind]
    if kind == "int8":
        codes = jax.lax.bitcast_convert_type(codes, jnp.uint8)
    codes = _split_blocks(codes.astype(WORD), axis)  # (..., n_blocks, BLOCK, ...)
    codes = codes.reshape(codes.shape[:axis + 1] + (BLOCK // per, per) + codes.shape[axis + 2:])
    words = jnp.zeros(codes.shape[:axis + 2] + codes.shape[axis + 3:], WORD)
    for j in range(per):
        words = words | (jax.lax.index_in_dim(codes, j, axis + 2, keepdims=False) << (width * j))
    scale_bits = jnp.expand_dims(jax.lax.bitcast_convert_type(scales, WORD), axis + 1)
    blocks = jnp.concatenate([words, scale_bits], axis=axis + 1)  # (..., n_blocks, words_per_block, ...)
    return blocks.reshape(packed_shape(w.shape, kind, axis))


def unpack(packed: jax.Array, kind: str, axis: int, dtype) -> jax.Array:
    """The weight `pack` stored, in `dtype`: exactly `dequantize` of its codes and scales. Elementwise after
    reshapes that only split `axis`, so a weight whose packed axis is split into whole blocks unpacks shard
    by shard."""
    shape = unpacked_shape(packed.shape, kind, axis)
    axis %= packed.ndim
    per, width, size = CODES_PER_WORD[kind], 16 // CODES_PER_WORD[kind], words_per_block(kind)
    blocks = packed.reshape(packed.shape[:axis] + (packed.shape[axis] // size, size) + packed.shape[axis + 1:])
    words = jax.lax.slice_in_dim(blocks, 0, size - 1, axis=axis + 1)
    scales = jax.lax.bitcast_convert_type(jax.lax.index_in_dim(blocks, size - 1, axis + 1, keepdims=False),
                                          SCALE_DTYPE)
    mask = (1 << width) - 1
    codes = jnp.stack([(words >> (width * j)) & mask for j in range(per)], axis=axis + 2).reshape(shape)
    if kind == "int8":
        codes = jax.lax.bitcast_convert_type(codes.astype(jnp.uint8), jnp.int8)
    return dequantize(codes, scales, kind, axis, dtype)


def packed_shape(shape, kind: str, axis: int) -> tuple[int, ...]:
    """The shape `pack` gives a weight of `shape`."""
    shape = tuple(shape)
    axis = _blocked_axis(shape, axis)
    return shape[:axis] + (shape[axis] // BLOCK * words_per_block(kind),) + shape[axis + 1:]


def unpacked_shape(shape, kind: str, axis: int) -> tuple[int, ...]:
    """The weight's shape from the shape `pack` gave it."""
    shape, size = tuple(shape), words_per_block(kind)
    if not -len(shape) <= axis < len(shape) or shape[axis] % size:
        raise ValueError(f"a packed {kind} weight of shape {shape} has no whole blocks of {size} words along "
                         f"axis {axis}")
    axis %= len(shape)
    return shape[:axis] + (shape[axis] // size * BLOCK,) + shape[axis + 1:]


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"quantization kind must be one of {KINDS}, not {kind!r}")


def _blocked_axis(shape, axis: int) -> int:
    """`axis` as a non-negative index, checked to split into whole blocks."""
    if not -len(shape) <= axis < len(shape):
        raise ValueError(f"axis {axis} is out of range for a weight of shape {tuple(shape)}")
    axis %= len(shape)
    if shape[axis] % BLOCK:
        raise ValueError(f"the quantized axis {axis} of shape {tuple(shape)} has length {shape[axis]}, "
                         f"not a multiple of the block size {BLOCK}")
    return axis


def _split_blocks(x: jax.Array, axis: int) -> jax.Array:
    """x with `axis` split into (n_blocks, BLOCK): each block's elements along the new axis + 1."""
    return x.reshape(x.shape[:axis] + (x.shape[axis] // BLOCK, BLOCK) + x.shape[axis + 1:])


def _round_up_to_bf16(absmax: jax.Array) -> jax.Array:
    """The smallest bfloat16 at or above each absmax, so that no element exceeds its stored scale."""
    scale = absmax.astype(SCALE_DTYPE)
    above = jnp.nextafter(scale, jnp.asarray(jnp.inf, SCALE_DTYPE))
    return jnp.where(scale.astype(jnp.float32) < absmax, above, scale)

