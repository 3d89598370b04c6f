"""Training: the pure step, the sharded trainer, the loop and layout verification."""

from jaxpar.laid_out.forward import token_loss
from jaxpar.train.state import TrainState
from jaxpar.train.step import make_train_step
from jaxpar.train.trainer import Trainer

__all__ = ["TrainState", "Trainer", "make_train_step", "token_loss"]
