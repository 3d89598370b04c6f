"""jaxpar: train transformer language models across many accelerators with JAX/XLA.

The public API: configuration, the Flax NNX model, the logical-axis rules table and the
training pieces, for use in your own code as well as through the `jaxpar` CLI.
Importing jaxpar does not import jax; the submodules below do.
"""

from jaxpar.config import Config, ConfigError, DataConfig, MeshConfig, ModelConfig, RunConfig, TrainConfig
from jaxpar.config.presets import load_config
from jaxpar.errors import UserError

__version__ = "0.1.0"

__all__ = ["Config", "ConfigError", "DataConfig", "MeshConfig", "ModelConfig", "RunConfig", "TrainConfig",
           "UserError", "load_config", "__version__"]
