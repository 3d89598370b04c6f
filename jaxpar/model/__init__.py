"""Flax NNX transformer modules; they name logical axes only, never mesh axes.

Shape legend, for every tensor name and einsum in jaxpar (`x_BLD`): B batch (b: a
microbatch's), L sequence (query positions), P key positions, T tokens of a training row
(L + 1), D model width, H heads, K head dim, Q the q/k/v slot of the fused projection, F ffn
width, V vocabulary, E experts, G routing groups, N tokens per group, C expert capacity,
S pipeline stages, M microbatches. Latent attention (model/mla.py) gives some letters its widths
instead (R, Q, N, E, V, M: its docstring).
"""

from jaxpar.model.attention import Attention
from jaxpar.model.axes import LOGICAL_AXES, ModelHooks, constrain, layout_hooks
from jaxpar.model.layers import RMSNorm, rotary
from jaxpar.model.mlp import MLP
from jaxpar.model.protocol import BlockModel, is_block_model
from jaxpar.model.transformer import Block, LayerScan, Transformer, plain_scan

__all__ = ["Attention", "Block", "BlockModel", "LayerScan", "MLP", "RMSNorm", "Transformer", "LOGICAL_AXES",
           "ModelHooks", "constrain", "is_block_model", "layout_hooks", "plain_scan", "rotary"]
