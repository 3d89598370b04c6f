"""A run read back from its folder: the config and the weights of one of its checkpoints, for
`jaxpar export-hf` and `jaxpar generate`.

Only the parameters are read (Orbax's partial restore), onto the sharding the caller gives; the
optimizer state stays on disk. The config is the resolved one the run saved, so a run started
from a Hugging Face folder reads back even after that folder is gone.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from flax import nnx

from jaxpar.config import Config, apply_overrides, flatten_dict
from jaxpar.config.adapters import LoRAConfig
from jaxpar.errors import UserError
from jaxpar.interop.checkpoint_files import PARAMS, brief_error, flat_by_path, is_damage, nest_by_path
from jaxpar.model.axes import is_variable, path_names
from jaxpar.model.transformer import Transformer


class SavedRun:
    """The checkpoints under <run_dir>/checkpoints, read only."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        folder = self.run_dir / "checkpoints"
        if not folder.is_dir():
            raise UserError(f"{self.run_dir} holds no checkpoints folder: no run there has completed (one saves "
                            f"its final state unless checkpoint.final=false), saved every checkpoint.every steps, "
                            f"or been stopped with Ctrl-C.")
        # Only restore is ever called on it, so nothing is written or removed (a temporary folder left by a
        # killed save included: cleanup_tmp_directories is off).
        options = ocp.CheckpointManagerOptions(create=False)
        handlers = {"state": ocp.PyTreeCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
        self._manager = ocp.CheckpointManager(folder.absolute(), options=options, item_handlers=handlers)
        self.steps = sorted(self._manager.all_steps())
        if not self.steps:
            raise UserError(f"{folder} holds no complete checkpoint.")

    def step(self, wanted: int | None) -> int:
        """`wanted`, or the newest step when it is None; raises UserError for a step that was not saved."""
        if wanted is None:
            return self.steps[-1]
        if wanted not in self.steps:
            raise UserError(f"{self.run_dir} has no checkpoint at step {wanted}; it has steps "
                            f"{', '.join(map(str, self.steps))}.")
        return wanted

    def _restore(self, step: int, **items):
        try:
            return self._manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:  # noqa: BLE001 - damage is the user's to know about; anything else is raised
            if is_damage(e):
                raise UserError(f"the checkpoint at step {step} in {self.run_dir} is damaged ({brief_error(e)}); pick "
                                f"another with --step.") from None
            raise

    def config(self, step: int) -> Config:
        """The resolved config the run saved with that checkpoint."""
        meta = self._restore(step, meta=ocp.args.JsonRestore()).meta
        return apply_overrides(Config(), flatten_dict(meta["config"]))

    def params(self, step: int, cfg: Config, shardings) -> nnx.State:
        """The model's fp32 parameters at `step` (model order), each read straight onto its sharding:
        `shardings` is one jax Sharding for every array, or an nnx.State of them."""
        abstract = nnx.state(nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0))))
        if isinstance(shardings, jax.sharding.Sharding):
            shardings = jax.tree.map(lambda _: shardings, abstract)
        placed = flat_by_path(shardings)
        targets = {PARAMS + key: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=placed[key])
                   for key, leaf in flat_by_path(abstract).items()}
        nested = nest_by_path(targets)
        restore_args = jax.tree.map(lambda t: ocp.ArrayRestoreArgs(sharding=t.sharding), nested)
        tree = self._restore(step, state=ocp.args.PyTreeRestore(nested, restore_args=restore_args,
                                                                partial_restore=True)).state
        flat = flatten_dict(tree, sep="/")
        leaves = [flat[PARAMS + key] for key in flat_by_path(abstract)]
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(abstract), leaves)

    def close(self) -> None:
        self._manager.close()


def read_run_weights(folder: str, cfg: Config, shardings) -> nnx.State:
    """model.from_run's starting weights: the newest checkpoint's parameters of the run in `folder`, onto
    `shardings` (the weights' own, without adapters; the run trained none: jaxpar.config.from_run)."""
    run = SavedRun(folder)
    try:
        bare = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, lora=LoRAConfig()))
        params = run.params(run.step(None), bare, shardings)
    finally:
        run.close()
    # as the variables of `shardings` (the frozen ones, for a run with adapters) hold them
    values = {path_names(p): v.get_value() for p, v in jax.tree_util.tree_flatten_with_path(
        params, is_leaf=is_variable)[0]}
    return jax.tree_util.tree_map_with_path(lambda p, v: v.replace(values[path_names(p)]), shardings,
                                            is_leaf=is_variable)
