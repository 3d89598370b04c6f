"""Blockwise NF4 / int8 quantization of frozen weights (QLoRA): the paper's code book, nearest codes, the
round-trip error bound, the bytes XLA counts, dequantizing under a sharding, and codes and scales packed
into one array (what a frozen weight stores)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.model import quantize as q

# Written out here from the QLoRA paper's appendix (bitsandbytes' NF4 table), not read from the module.
PAPER_NF4 = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
], dtype=np.float32)
INT8_BOOK = np.arange(-127, 128, dtype=np.float32) / 127
BOOKS = {"nf4": PAPER_NF4, "int8": INT8_BOOK}

# (shape, blocked axis): the blocked axis first, last, in the middle, negative
CASES = [((128, 96), 0), ((96, 128), -1), ((3, 64, 5), 1), ((4, 2, 192), 2)]


@functools.partial(jax.jit, static_argnames=("kind", "axis"))
def round_trip(w, kind, axis):
    codes, scales = q.quantize(w, kind, axis)
    return codes, scales, q.dequantize(codes, scales, kind, axis, jnp.float32)


def weights(shape, tails: str, seed=0) -> np.ndarray:
    """Normal or heavy-tailed (Student t, 2 degrees of freedom: outliers of tens of sigmas) weights."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape) if tails == "normal" else rng.standard_t(2, shape)
    return w.astype(np.float32)


def blocks(x: np.ndarray, axis: int) -> np.ndarray:
    """x with the blocked axis moved last and split: (..., n_blocks, 64)."""
    x = np.moveaxis(x, axis, -1)
    return x.reshape(x.shape[:-1] + (x.shape[-1] // 64, 64))


def check_round_trip(w, codes, scales, deq, kind, axis, book):
    """Assert what quantize / dequantize promise, against an independently written code book: each code is
    the nearest value of `book` to w / scale, each value decodes to book[code] * scale exactly, and each
    block's error is within half the book's largest gap times the stored (bf16) scale."""
    codes, deq = np.asarray(codes), np.asarray(deq)
    scales = np.asarray(scales).astype(np.float32)
    axis %= w.ndim
    assert (codes.shape, codes.dtype) == (w.shape, {"nf4": jnp.uint4, "int8": jnp.int8}[kind])
    assert scales.shape == w.shape[:axis] + (w.shape[axis] // 64,) + w.shape[axis + 1:]
    offset = 127 if kind == "int8" else 0  # int8 codes are signed: code c is book[c + 127]
    w_b, codes_b, deq_b = blocks(w, axis), blocks(codes, axis).astype(np.int64) + offset, blocks(deq, axis)
    scale_b = np.moveaxis(scales, axis, -1)[..., None]  # (..., n_blocks, 1)
    absmax_b = np.abs(w_b).max(-1, keepdims=True)
    assert np.all(scale_b >= absmax_b) and np.all(scale_b <= absmax_b * (1 + 2**-7))  # rounded up to bf16
    normalized = w_b / np.where(scale_b == 0, 1, scale_b)
    distance = np.abs(normalized[..., None] - book)  # (..., n_blocks, 64, len(book))
    chosen = np.take_along_axis(distance, codes_b[..., None], -1)[..., 0]
    assert np.all(chosen <= distance.min(-1) + 1e-6), "a code is not the nearest value of the code book"
    # nf4: bit for bit. int8: to two float32 roundings (XLA divides the codes by 127 as a multiplication)
    np.testing.assert_allclose(deq_b, book[codes_b] * scale_b, rtol=0 if kind == "nf4" else 2**-22, atol=0)
    bound = np.max(np.diff(book)) / 2
    assert np.all(np.abs(deq_b - w_b) <= (bound + 1e-6) * scale_b)


def test_nf4_code_book_is_the_papers():
    np.testing.assert_array_equal(q.NF4_CODE_BOOK, PAPER_NF4)
    assert q.NF4_CODE_BOOK.shape == (16,) and np.all(np.diff(q.NF4_CODE_BOOK) > 0)
    np.testing.assert_array_equal(q.code_book("int8"), INT8_BOOK)


@pytest.mark.parametrize("kind", ["nf4", "int8"])
@pytest.mark.parametrize("shape, axis", CASES)
def test_round_trip_within_the_bound_on_nearest_codes(kind, shape, axis):
    for tails in ("normal", "heavy"):  # one compile for both
        w = weights(shape, tails)
        np.moveaxis(w, axis, -1)[..., :64] = 0  # an all-zero block in every row: no division by zero
        codes, scales, deq = round_trip(w, kind, axis)
        assert np.all(np.isfinite(deq))
        assert np.all(blocks(np.asarray(deq), axis % w.ndim)[..., 0, :] == 0)
        check_round_trip(w, codes, scales, deq, kind, axis, BOOKS[kind])


def test_error_bounds_and_bytes_come_from_the_books_and_dtypes():
    assert q.round_trip_error_bound("nf4") == pytest.approx((-0.6961928009986877 + 1.0) / 2)  # the widest gap
    assert q.round_trip_error_bound("int8") == pytest.approx(0.5 / 127)
    assert q.bytes_per_parameter("nf4") == 0.5 + 2 / 64
    assert q.bytes_per_parameter("int8") == 1 + 2 / 64


@pytest.mark.parametrize("book", ["uniform", "perturbed"])
def test_the_check_catches_a_wrong_code_book(monkeypatch, book):
    """A quantizer built on another code book passes the check against its own book but fails it against
    the paper's: the check tests the code book, not only the size of the error."""
    wrong = np.linspace(-1, 1, 16, dtype=np.float32) if book == "uniform" else PAPER_NF4.copy()
    if book == "perturbed":
        wrong[10] += 0.02
    monkeypatch.setattr(q, "NF4_CODE_BOOK", wrong)
    w = weights((128, 64), "normal", seed=1)
    codes, scales = q.quantize(w, "nf4", 1)  # not through the jitted round_trip: its trace holds the paper's
    deq = q.dequantize(codes, scales, "nf4", 1, jnp.float32)
    check_round_trip(w, codes, scales, deq, "nf4", 1, wrong)
    with pytest.raises(AssertionError):
        check_round_trip(w, codes, scales, deq, "nf4", 1, PAPER_NF4)
    with pytest.raises(AssertionError):
        np.testing.assert_array_equal(q.NF4_CODE_BOOK, PAPER_NF4)


def test_bad_axis_or_kind_is_refused():
    with pytest.raises(ValueError, match="multiple of the block size"):
        q.quantize(jnp.ones((96, 100)), "nf4", 1)
    with pytest.raises(ValueError, match="multiple of the block size"):
        q.packed_shape((96, 100), "int8", -1)
    with pytest.raises(ValueError, match="out of range"):
        q.packed_shape((64, 64), "nf4", 2)
    with pytest.raises(ValueError, match="kind"):
        q.quantize(jnp.ones((64, 64)), "fp8", 0)


@pytest.mark.parametrize("kind", ["nf4", "int8"])
@pytest.mark.parametrize("axis, spec", [(0, P(None, "tensor")), (1, P("tensor", None)), (0, P("data", "tensor"))])
def test_dequantize_under_a_sharding(kind, axis, spec):
    """Codes and scales sharded like the weight (the blocked axis too, in the last case) dequantize inside
    jit to the unsharded values, shard by shard: no all-gather, the result sharded like the weight."""
    mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)  # as jaxpar's meshes
    w = weights((256, 128), "heavy", seed=2)
    codes, scales = q.quantize(w, kind, axis)
    expected = q.dequantize(codes, scales, kind, axis, jnp.bfloat16)
    sharding = NamedSharding(mesh, spec)
    dequantize = jax.jit(functools.partial(q.dequantize, kind=kind, axis=axis, dtype=jnp.bfloat16))
    args = jax.device_put(codes, sharding), jax.device_put(scales, sharding)
    result = dequantize(*args)
    np.testing.assert_array_equal(np.asarray(result, np.float32), np.asarray(expected, np.float32))
    assert result.sharding.is_equivalent_to(sharding, 2)
    assert "all-gather" not in dequantize.lower(*args).compile().as_text()


@pytest.mark.parametrize("kind", ["nf4", "int8"])
@pytest.mark.parametrize("shape, axis", CASES)
def test_pack_holds_codes_and_scales_in_one_array(kind, shape, axis):
    """One uint16 array of the weight's rank, only the blocked axis changed: each block's codes packed into
    words, the first code in the low bits, then its scale's bf16 bits; unpack gives dequantize's values."""
    w = weights(shape, "heavy", seed=4)
    codes, scales, deq = round_trip(w, kind, axis)
    packed = jax.jit(q.pack, static_argnames=("kind", "axis"))(w, kind, axis)
    assert packed.dtype == jnp.uint16 and packed.shape == q.packed_shape(shape, kind, axis)
    assert q.unpacked_shape(packed.shape, kind, axis) == shape
    unpack = jax.jit(q.unpack, static_argnames=("kind", "axis", "dtype"))
    np.testing.assert_array_equal(np.asarray(unpack(packed, kind, axis, jnp.float32)), np.asarray(deq))
    size = q.words_per_block(kind)
    block_words = np.moveaxis(np.asarray(packed), axis, -1)
    block_words = block_words.reshape(block_words.shape[:-1] + (-1, size))  # (..., n_blocks, words)
    scale_bits = np.moveaxis(np.asarray(scales), axis, -1).view(np.uint16)
    np.testing.assert_array_equal(block_words[..., -1], scale_bits)
    first = blocks(np.asarray(codes), axis % w.ndim)[..., 0].astype(np.int64) & 0xFF  # an int8 code's byte
    np.testing.assert_array_equal(block_words[..., 0] & (0xF if kind == "nf4" else 0xFF), first)


@pytest.mark.parametrize("kind, words, limit", [("nf4", 17, 0.55), ("int8", 33, 1.05)])
def test_xla_counts_the_packed_bytes(kind, words, limit):
    """34 bytes a block of 64 for nf4, 66 for int8: the bytes of codes and scales apart, counted exactly."""
    assert q.words_per_block(kind) == words
    packed = jax.ShapeDtypeStruct(q.packed_shape((1024, 4096), kind, 1), jnp.uint16)
    total = jax.jit(lambda p: q.unpack(p, kind, 1, jnp.float32).sum())
    argument_bytes = total.lower(packed).compile().memory_analysis().argument_size_in_bytes
    assert argument_bytes / (1024 * 4096) == q.bytes_per_parameter(kind) <= limit


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_unpack_under_a_split_of_whole_blocks(kind):
    """The packed axis split 8 ways, one block a device (ZeRO's split of 'embed'), unpacks shard by shard: no
    all-gather, the result split like the packed weight, at the same blocks."""
    mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
    w = weights((512, 96), "heavy", seed=5)
    packed = q.pack(w, kind, 0)
    expected = q.unpack(packed, kind, 0, jnp.float32)
    sharding = NamedSharding(mesh, P(("data", "tensor"), None))
    unpack = jax.jit(functools.partial(q.unpack, kind=kind, axis=0, dtype=jnp.float32))
    placed = jax.device_put(packed, sharding)
    result = unpack(placed)
    np.testing.assert_array_equal(np.asarray(result), np.asarray(expected))
    assert result.sharding.is_equivalent_to(sharding, 2)
    assert "all-gather" not in unpack.lower(placed).compile().as_text()


def test_a_packed_shape_without_whole_blocks_is_refused():
    with pytest.raises(ValueError, match="no whole blocks"):
        q.unpacked_shape((100, 64), "nf4", 0)
