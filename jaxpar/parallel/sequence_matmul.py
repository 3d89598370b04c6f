"""Sequence parallelism's column- and row-parallel matmuls written per tensor rank (jaxpar.parallel.hooks):
a shard_map manual over tensor and the batch axes, with the sequence collective by hand (all-gather before
the column form, reduce-scatter after the row form) and a custom VJP. XLA's CPU partitioner lowers a
constrained reduction as all-reduce + slice, never as the reduce-scatter Megatron's sequence parallelism
is made of.

Each rank's matmul is the layout's GEMM (jaxpar.model.fp8): in fp8 it quantizes its own shard with the
shard's amax, which gives the values the whole tensor's amax gives (power-of-two scales). Backward takes
the local matmul's VJP from the kept bf16 input, quantizing it again (the same values).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxpar.model.axes import Gemm
from jaxpar.parallel.rules import logical_to_spec
from jaxpar.parallel.zero import without_axes

if TYPE_CHECKING:  # annotations only: hooks.py, which calls this, holds the layout
    from jaxpar.parallel.layout import Layout


def sequence_matmul(layout: Layout, gemm: Gemm, equation: str, x, w, names: tuple, out_dtype, scatter: bool):
    """`equation` on x and the tensor-split weight w (logical names `names`: x's, w's, the result's) as `gemm`
    runs it, per tensor rank: the column form (scatter=False) all-gathers x along the sequence first, the
    row form reduce-scatters its fp32 partial sums after (returned in x's dtype)."""
    data = tuple(layout.data_axes)
    others = tuple(a for a in layout.sizes if a not in (*data, "tensor"))
    x_spec, w_spec, out_spec = (without_axes(logical_to_spec(n, layout.rules), others) for n in names)
    seq_dim = (names[2] if scatter else names[0]).index("residual_seq")
    op = _SequenceMatmul(equation, layout.mesh, data, x_spec, w_spec, out_spec, seq_dim, scatter, out_dtype, gemm)
    out = _sequence_matmul(op, x, w)
    return out.astype(x.dtype) if scatter else out


@dataclasses.dataclass(frozen=True)
class _SequenceMatmul:
    """One sequence-parallel matmul: `equation` on x and a tensor-split weight w, per rank.
    Column (scatter=False): x arrives split along the sequence (dimension seq_dim) and is
    all-gathered first. Row (scatter=True): the partial sums are reduce-scattered along it, in fp32."""

    equation: str
    mesh: jax.sharding.Mesh
    data: tuple[str, ...]  # the batch axes (size > 1), manual here too
    x_spec: PartitionSpec
    w_spec: PartitionSpec
    out_spec: PartitionSpec
    seq_dim: int
    scatter: bool
    out_dtype: object
    gemm: Gemm

    def per_rank(self, fn, in_specs, out_specs):
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                             axis_names={*self.data, "tensor"}, check_vma=False)

    def gather(self, x):
        return jax.lax.all_gather(x, "tensor", axis=self.seq_dim, tiled=True)

    @property
    def input_spec(self) -> PartitionSpec:
        """The spec of what the matmul multiplies with: the column form's gathered (whole-sequence)
        input, the row form's own."""
        return self.x_spec if self.scatter else _without_dim(self.x_spec, self.seq_dim)

    def scatter_sum(self, x):
        return jax.lax.psum_scatter(x.astype(jnp.float32), "tensor", scatter_dimension=self.seq_dim, tiled=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _sequence_matmul(op: _SequenceMatmul, x, w):
    """A sequence-parallel matmul (the row form returns fp32 sums)."""
    return _sequence_matmul_fwd(op, x, w)[0]


def _sequence_matmul_fwd(op, x, w):
    """Forward; keeps what backward multiplies with: the column form's gathered input (so
    backward needs no second all-gather and moves the bytes of the all-reduces it replaces; a
    remat policy that drops a layer's residuals recomputes it), the row form's own input."""
    def forward(x, w):
        if op.scatter:
            return op.scatter_sum(op.gemm.einsum(op.equation, x, w, jnp.float32)), x
        x_in = op.gather(x)
        return op.gemm.einsum(op.equation, x_in, w, op.out_dtype), x_in

    out, x_in = op.per_rank(forward, (op.x_spec, op.w_spec), (op.out_spec, op.input_spec))(x, w)
    return out, (x_in, w)


def _sequence_matmul_bwd(op, residuals, grad):
    """Backward by hand, in the compute dtype with fp32 sums: the column form reduce-scatters dx,
    the row form all-gathers the incoming gradient. Each batch shard's partial weight gradient
    is returned on a leading axis and summed in fp32 outside, where the partitioner reduces it
    like any other weight gradient (a bf16 sum inside would abort XLA:CPU)."""
    x_in, w = residuals

    def backward(x_in, w, grad):
        grad = grad.astype(x_in.dtype)
        grad_in = op.gather(grad) if op.scatter else grad
        _, pullback = jax.vjp(lambda a, b: op.gemm.einsum(op.equation, a, b), x_in, w)
        dx_in, dw = pullback(grad_in)
        dx = dx_in if op.scatter else op.scatter_sum(dx_in).astype(x_in.dtype)
        return dx, dw[None].astype(jnp.float32)

    dw_spec = PartitionSpec(op.data or None, *op.w_spec)
    dx, dw_parts = op.per_rank(backward, (op.input_spec, op.w_spec, op.out_spec), (op.x_spec, dw_spec))(x_in, w, grad)
    return dx, dw_parts.sum(0).astype(w.dtype)


def _without_dim(spec: PartitionSpec, dim: int) -> PartitionSpec:
    """`spec` with dimension `dim` whole (the sequence after the all-gather)."""
    return PartitionSpec(*(None if i == dim else e for i, e in enumerate(spec)))


_sequence_matmul.defvjp(_sequence_matmul_fwd, _sequence_matmul_bwd)
