"""A mixture-of-experts MLP: route tokens in fixed-size groups, run E GeLU experts, combine.

Routing groups are `group_size` consecutive tokens, independent of the mesh, so a token is
routed the same way on one device and on many. Expert weights have a leading expert
dimension (logical 'expert'); under expert parallelism each device holds E / mesh.expert
experts and the layout's `expert_all_to_all` hook moves each expert's tokens to it and back.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.config import ModelConfig
from jaxpar.model import routers
from jaxpar.model.axes import batch_shard_index, constrain, expert_all_to_all, param


class MoE(nnx.Module):
    """Router + E experts. Returns the combined output and routing statistics."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        moe, D, F = cfg.moe, cfg.d_model, cfg.d_ff
        E = moe.experts
        self.router, self.top_k, self.noise = moe.router, moe.top_k, moe.noise
        self.group_size, self.capacity_factor = moe.group_size, moe.capacity_factor
        self.w_router = param(rngs.params(), (D, E), ("embed", None), D ** -0.5)
        self.w_noise = (nnx.Param(jnp.zeros((D, E), jnp.float32), out_sharding=("embed", None), eager_sharding=False)
                        if moe.router == "topk" else None)
        self.w_up = param(rngs.params(), (E, D, F), ("expert", "embed", "mlp"), D ** -0.5)
        self.w_down = param(rngs.params(), (E, F, D), ("expert", "mlp", "embed"), F ** -0.5 / math.sqrt(2 * cfg.n_layers))

    def __call__(self, x_BLD: jax.Array, noise_key: jax.Array | None = None):
        if self.group_size <= 0:
            raise ValueError("model.moe.group_size=0 (automatic) must be resolved for the mesh before the model "
                             "runs: see jaxpar.validation.with_derived")
        B, L, D = x_BLD.shape
        # Training batches hold whole groups (validated); a shorter input (generating one
        # sequence) is routed as one group per sequence.
        S = self.group_size if (B * L) % self.group_size == 0 else L
        x_GSD = x_BLD.reshape(B * L // S, S, D)
        G = x_GSD.shape[0]
        x32_GSD = x_GSD.astype(jnp.float32)
        logits_GSE = jnp.einsum("GSD,DE->GSE", x32_GSD, self.w_router[...].astype(jnp.float32))
        E = logits_GSE.shape[-1]
        C = routers.capacity(self.router, S, E, self.top_k, self.capacity_factor)
        if self.router == "switch":
            dispatch, combine, balance, dropped = routers.switch(logits_GSE, C)
        elif self.router == "expert_choice":
            dispatch, combine, balance, dropped = routers.expert_choice(logits_GSE, C)
        else:
            noise_GSE = noise_scale_GSE = None
            if self.noise and noise_key is not None:
                # Noise keyed by the group's index in the whole batch: the same on any mesh.
                groups = batch_shard_index() * G + jnp.arange(G)
                noise_GSE = jax.vmap(lambda g: jax.random.normal(jax.random.fold_in(noise_key, g), (S, E)))(groups)
                noise_scale_GSE = jnp.einsum("GSD,DE->GSE", x32_GSD, self.w_noise[...].astype(jnp.float32))
            dispatch, combine, balance, dropped = routers.noisy_topk(logits_GSE, noise_scale_GSE, noise_GSE,
                                                                     self.top_k, C)
        dtype = x_BLD.dtype
        x_EGCD = jnp.einsum("GSEC,GSD->EGCD", dispatch.astype(dtype), x_GSD)
        x_EGCD = expert_all_to_all(x_EGCD, inverse=False)  # local experts, every shard's groups
        h_EGCF = jax.nn.gelu(jnp.einsum("EGCD,EDF->EGCF", x_EGCD, self.w_up[...]))
        y_EGCD = jnp.einsum("EGCF,EFD->EGCD", h_EGCF, self.w_down[...])
        y_EGCD = expert_all_to_all(y_EGCD, inverse=True)  # back to the shard that owns the groups
        y_GSD = jnp.einsum("GSEC,EGCD->GSD", combine.astype(dtype), y_EGCD)
        tokens_E = jnp.sum(dispatch, axis=(0, 1, 3))
        # The share of tokens no expert took (the residual alone carries them), from the dispatch itself.
        unrouted = jnp.mean((jnp.sum(dispatch, axis=(2, 3)) == 0).astype(jnp.float32))
        stats = {"aux": balance, "z": routers.z_loss(logits_GSE), "unrouted": unrouted, "expert_tokens": tokens_E}
        if dropped is not None:
            stats["dropped"] = dropped
        return constrain(y_GSD.reshape(B, L, D), ("batch", "seq", "embed")), stats
