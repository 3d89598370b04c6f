"""Flax NNX transformer modules; they name logical axes only, never mesh axes."""

from jaxpar.model.attention import Attention
from jaxpar.model.axes import LOGICAL_AXES, LayoutHooks, constrain, layer_weights, layout_hooks, model_weights
from jaxpar.model.layers import RMSNorm, rotary
from jaxpar.model.mlp import MLP
from jaxpar.model.transformer import Block, Transformer

__all__ = ["Attention", "Block", "MLP", "RMSNorm", "Transformer", "LOGICAL_AXES", "LayoutHooks", "constrain",
           "layer_weights", "layout_hooks", "model_weights", "rotary"]
