"""Mixed precision: the dtype the forward pass computes in; master weights stay fp32."""

from __future__ import annotations

import jax
import jax.numpy as jnp

COMPUTE_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}


def cast_for_compute(params, precision: str):
    """Cast floating parameters to the compute dtype; gradients flow back to fp32 through the cast."""
    dtype = COMPUTE_DTYPES[precision]
    if dtype == jnp.float32:
        return params
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
