"""The ragged all-to-all (`jax.lax.ragged_all_to_all`), and an emulation of it where the backend has none.

Each device sends slices of its operand's rows to the devices of an axis: with K slices and n devices,
slice i (rows input_offsets[i] : + send_sizes[i]) goes to device i // (K / n), which writes it at
output_offsets[i] of its own output (offsets in the receiver's buffer). A receiver's recv_sizes[i] is
the size of the (i mod K / n)-th slice that device i // (K / n) sends it, and the rows of its output
that no slice writes keep the output's values.

XLA:CPU does not implement the op (jax 0.12: "HLO opcode ragged-all-to-all is not supported by
XLA:CPU"), so on the CPU `emulated` computes the same result from dense collectives: each device packs
what it sends each device into a block of `cap` rows (the most any in-bounds slices can fill: K / n
operand-sized slices, or the receiver's whole output), an all-to-all moves the blocks, and each
device takes its output's rows from the blocks it received. It moves n x cap rows where the op moves
the routed rows, so `jaxpar plan` reads the block all-to-all (named ROWS_SCOPE) as the op: cap rows per
device (jaxpar.plan.collectives), and leaves out the emulation's small all-to-all of the receivers'
offsets (OFFSETS_SCOPE), which the op does not need. Its gradient is autodiff's, the reverse exchange:
each operand row gets the cotangent of the rows it was written to, and the output the cotangent of
its rows that no slice wrote, as the op's transpose rule gives.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from jaxpar.parallel.reductions import moved_as_bits

if TYPE_CHECKING:  # annotations only
    from jaxpar.parallel.layout import Layout

ROWS_SCOPE = "jaxpar_ragged_all_to_all_rows"
OFFSETS_SCOPE = "jaxpar_ragged_all_to_all_offsets"
NATIVE_PLATFORMS = frozenset({"gpu", "cuda", "rocm", "tpu"})  # where XLA implements the op


def native(platform: str) -> bool:
    """Whether devices of this platform run jax.lax.ragged_all_to_all itself (else: the emulation)."""
    return platform in NATIVE_PLATFORMS


@dataclasses.dataclass(frozen=True)
class Exchange:
    """Dropless routing's ragged dispatch over a mesh axis of `shards` devices (jaxpar.model.axes.ExpertExchange),
    by the op itself (`real`) or its emulation."""

    axis: str
    shards: int
    real: bool

    def shard(self) -> jax.Array:
        return jax.lax.axis_index(self.axis)

    def gathered(self, x: jax.Array) -> jax.Array:
        return jax.lax.all_gather(x, self.axis)

    def ragged_all_to_all(self, operand, output, input_offsets, send_sizes, output_offsets, recv_sizes) -> jax.Array:
        return ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                 axis_name=self.axis, real=self.real)


def over_experts(layout: Layout) -> Exchange | None:
    """parallel.expert_dispatch=ragged under expert parallelism: the exchange over `expert`, by the op itself
    where the devices' backend has it, else by its emulation (XLA:CPU); None otherwise."""
    shards = layout.sizes.get("expert", 1)
    if shards == 1 or layout.parallel.expert_dispatch != "ragged":
        return None
    return Exchange("expert", shards, native(layout.mesh.devices.flat[0].platform))


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name: str,
                      real: bool) -> jax.Array:
    """jax.lax.ragged_all_to_all over `axis_name` (real) or its emulation, with the same arguments and result."""
    if real:
        return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                         axis_name=axis_name)
    return emulated(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name)


def emulated(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name: str) -> jax.Array:
    """The ragged all-to-all's result, from an all-to-all of padded blocks (see the module's docstring)."""
    n, K = jax.lax.axis_size(axis_name), input_offsets.shape[0]
    per_device = K // n  # slices for each device
    cap = min(per_device * operand.shape[0], output.shape[0])
    blocks = _packed(operand, input_offsets, send_sizes, per_device, cap)
    with jax.named_scope(ROWS_SCOPE):
        received = _exchanged(blocks.reshape(n * cap, *operand.shape[1:]), axis_name)
    with jax.named_scope(OFFSETS_SCOPE):
        landing = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # my offsets of what I receive
    written_M, source_M = _landed(landing, recv_sizes, per_device, cap, output.shape[0])
    rows = received[jnp.clip(source_M, 0, n * cap - 1)]
    return jnp.where(written_M.reshape(-1, *(1,) * (output.ndim - 1)), rows.astype(output.dtype), output)


def _packed(operand, input_offsets, send_sizes, per_device: int, cap: int) -> jax.Array:
    """(n, cap, ...): for each device, the slices this device sends it, one after the other, zeros after."""
    sizes_NK = send_sizes.reshape(-1, per_device)
    ends_NK = jnp.cumsum(sizes_NK, axis=1)
    position_C = jnp.arange(cap, dtype=ends_NK.dtype)
    slice_NC = jax.vmap(lambda ends: jnp.searchsorted(ends, position_C, side="right"))(ends_NK)  # skips empty ones
    sent_NC = slice_NC < per_device
    slice_NC = jnp.minimum(slice_NC, per_device - 1)
    start_NC = jnp.take_along_axis(ends_NK - sizes_NK, slice_NC, axis=1)
    row_NC = jnp.take_along_axis(input_offsets.reshape(-1, per_device), slice_NC, axis=1) + position_C - start_NC
    rows = operand[jnp.clip(row_NC, 0, operand.shape[0] - 1)]
    return jnp.where(sent_NC.reshape(*sent_NC.shape, *(1,) * (operand.ndim - 1)), rows, jnp.zeros_like(rows))


def _landed(landing_K, recv_sizes_K, per_device: int, cap: int, M: int) -> tuple[jax.Array, jax.Array]:
    """For each of the M output rows: whether a received slice writes it, and its row in the received blocks
    (block s holds device s's slices for this device, packed in slice order)."""
    sizes_NK = recv_sizes_K.reshape(-1, per_device)
    packed_K = (jnp.cumsum(sizes_NK, axis=1) - sizes_NK).reshape(-1)  # each slice's place in its block
    start_K = jnp.where(recv_sizes_K > 0, landing_K, M)  # empty slices out of the way
    by_start_K = jnp.argsort(start_K)
    row_M = jnp.arange(M, dtype=landing_K.dtype)
    found_M = jnp.searchsorted(start_K[by_start_K], row_M, side="right") - 1  # the last slice starting at or before
    slice_M = by_start_K[jnp.maximum(found_M, 0)]
    offset_M = row_M - landing_K[slice_M]
    written_M = (found_M >= 0) & (offset_M < recv_sizes_K[slice_M])
    return written_M, slice_M // per_device * cap + packed_K[slice_M] + offset_M


def _exchanged(x, axis_name: str) -> jax.Array:
    """The tiled all-to-all of the packed blocks; 16-bit floats moved as their bits (XLA:CPU widens them)."""
    if x.dtype.itemsize == 2 and jnp.issubdtype(x.dtype, jnp.floating):
        return _bits_exchanged(x, axis_name)
    return jax.lax.all_to_all(x, axis_name, 0, 0, tiled=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _bits_exchanged(x, axis_name: str) -> jax.Array:
    return _all_to_all_bits(x, axis_name)


def _all_to_all_bits(x, axis_name: str) -> jax.Array:
    with jax.named_scope(ROWS_SCOPE):  # the backward's exchange is the op's too
        return moved_as_bits(lambda a: jax.lax.all_to_all(a, axis_name, 0, 0, tiled=True), x)


# A tiled all-to-all over one axis, split and concatenated along axis 0, is its own transpose.
_bits_exchanged.defvjp(lambda x, axis_name: (_all_to_all_bits(x, axis_name), None),
                       lambda axis_name, _, grad: (_all_to_all_bits(grad, axis_name),))
