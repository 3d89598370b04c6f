"""A matmul with a wider result than its operands (bf16 in, fp32 out: the logits, attention
scores), whose result's gradient re-enters backward in a narrower dtype.

Forward, jnp.einsum(..., preferred_element_type=out_dtype): accumulated and returned in fp32, as
the softmax after it needs. Backward, left to autodiff, the fp32 gradient would meet the bf16
operands in the transposed matmuls, which then run in fp32 (XLA converts the bf16 operand up):
on the output projection that is two thirds of the largest matmul of a small model's step. Here
the gradient is cast to `grad_dtype` first (the precision policy's `output_grad`: the compute
dtype), and the backward matmuls are those of a plain bf16 einsum, like every other matmul's of
the step; MaxText's bf16 logits give its backward the same dtypes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def wide_einsum(equation: str, a: jax.Array, b: jax.Array, out_dtype, grad_dtype) -> jax.Array:
    """einsum(equation, a, b) accumulated in out_dtype (None: the operands' dtype); its gradient enters
    backward in grad_dtype. Where either is None or they are the same dtype (fp32 training), the plain
    einsum, autodiff as usual."""
    if out_dtype is None or grad_dtype is None or jnp.dtype(grad_dtype) == jnp.dtype(out_dtype):
        return jnp.einsum(equation, a, b, preferred_element_type=out_dtype)
    return _narrow_grad_einsum(equation, a, b, jnp.dtype(out_dtype), jnp.dtype(grad_dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3, 4))
def _narrow_grad_einsum(equation, a, b, out_dtype, grad_dtype):
    return jnp.einsum(equation, a, b, preferred_element_type=out_dtype)


def _narrow_grad_fwd(equation, a, b, out_dtype, grad_dtype):
    return _narrow_grad_einsum(equation, a, b, out_dtype, grad_dtype), (a, b)


def _narrow_grad_bwd(equation, out_dtype, grad_dtype, residuals, grad):
    """The transpose of the einsum computed in grad_dtype (its matmuls: grad_dtype in and out, as the
    backward of a plain compute-dtype einsum), the gradients in the operands' dtypes."""
    a, b = residuals
    _, pullback = jax.vjp(lambda x, y: jnp.einsum(equation, x, y, preferred_element_type=grad_dtype), a, b)
    grad_a, grad_b = pullback(grad.astype(grad_dtype))
    return grad_a.astype(a.dtype), grad_b.astype(b.dtype)


_narrow_grad_einsum.defvjp(_narrow_grad_fwd, _narrow_grad_bwd)
