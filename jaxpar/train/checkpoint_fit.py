"""Whether a checkpoint fits a config, and the path-keyed view of a state that checkpoints are saved in:
what must match (the model's shape, optimizer, seed, the arrays), and what may come and go with the
layout (the state's optional parts, jaxpar.train.state.OPTIONAL_PARTS)."""

from __future__ import annotations

from jaxpar.config import Config
from jaxpar.errors import UserError
from jaxpar.interop.checkpoint_files import flat_by_path
from jaxpar.train.state import OPTIONAL_PARTS


class CheckpointMismatch(UserError):
    """A checkpoint that cannot be restored into this config (another model shape, optimizer or seed)."""




def state_spec(state) -> dict[str, list]:
    """Shape and dtype of every array of a (possibly abstract) state, keyed by path."""
    return {key: [list(leaf.shape), str(leaf.dtype)] for key, leaf in flat_by_path(state).items()}


def _must_match(config: dict) -> list[str]:
    """Config keys that fix a checkpoint's contents (array shapes, optimizer state) or its data order.

    Where the weights first came from (model.from_hf) may move; the shape it gave must match. The
    routing settings of a mixture of experts (group size, capacity, loss weights) change no array, and the
    automatic group size follows the tokens per device, so they may change with the layout on resume;
    whether there are experts, how many and where, and the router (top-k alone has a noise weight) must
    match."""
    model = [f"model.{key}" for key in config["model"] if key not in ("moe", "from_hf")]
    muon = ["train.muon_weights"] if config["train"]["optimizer"] == "muon" else []  # (Muon's state: which weights)
    return model + ["model.moe.experts", "model.moe.every", "model.moe.router", "train.optimizer", *muon, "train.seed"]


def _config_value(config: dict, dotted: str):
    node = config
    for key in dotted.split("."):
        node = node.get(key, {}) if isinstance(node, dict) else None
    return None if node == {} else node


def check_compatible(meta: dict, cfg: Config, abstract_state, where: str) -> None:
    """Raise CheckpointMismatch (one sentence) unless the checkpoint fits this config."""
    saved, now = meta["config"], cfg.to_dict()
    differ = [k for k in _must_match(now) if _config_value(saved, k) != _config_value(now, k)]
    if differ:
        then = ", ".join(f"{k}={_config_value(saved, k)}" for k in differ)
        here = ", ".join(f"{k}={_config_value(now, k)}" for k in differ)
        raise CheckpointMismatch(f"the checkpoint at step {meta['step']} in {where} was written with {then} but this "
                                 f"config has {here}; resume with the same values or use another run.dir.")
    # the state's optional parts may come and go with the layout (where they may not, the strategy that
    # keeps them says so when restoring); everything else must be there
    expected = {k: v for k, v in state_spec(abstract_state).items() if not k.startswith(OPTIONAL_PARTS)}
    saved_spec = {k: v for k, v in meta["spec"].items() if not k.startswith(OPTIONAL_PARTS)}
    if saved_spec != expected:
        key = next(k for k in sorted(set(expected) | set(saved_spec)) if saved_spec.get(k) != expected.get(k))
        raise CheckpointMismatch(f"the checkpoint at step {meta['step']} in {where} holds a different training state "
                                 f"than this config builds (first difference: {key} is {saved_spec.get(key)} "
                                 f"there and {expected.get(key)} here); use another run.dir.")
