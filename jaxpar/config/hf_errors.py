"""The one error of reading and writing Hugging Face checkpoints (its own module, so that the config
readers of every family raise it without importing one another)."""

from jaxpar.errors import UserError


class CheckpointError(UserError):
    """A Hugging Face checkpoint folder that jaxpar cannot read or cannot represent."""
