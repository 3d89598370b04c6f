"""Orbax checkpoints of the training state under <run.dir>/checkpoints: save, find, restore.

A checkpoint has two items. `state` is the TrainState (step, parameters, optimizer and
loss-scale state) as a nested dict of arrays keyed by pytree path. `meta` is JSON: the
step, the data position (the step: batches are a pure function of seed and step), the
seed, the resolved config and the shape of every array.

Keying by path instead of by pytree type makes a checkpoint independent of the mesh, the
ZeRO stage and the pipeline schedule. Stacked layers are saved in model order (interleaved
pipelines store them permuted), and PipeDream-2BW's one-step-old weights are optional: a
layout without them drops them, and a layout that needs them starts them as the weights.
A restore builds its targets from the new layout's `eval_shape(init)` and
`state_shardings`, so Orbax reads each shard straight onto its device, and nothing is
gathered whole on one host.

Orbax writes a step into a temporary folder and renames it when complete, so a save that
was killed is never listed; leftover temporary folders are removed when the manager opens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jaxpar.config import Config, flatten_dict
from jaxpar.errors import UserError
from jaxpar.train.precision import LossScale
from jaxpar.train.step import TrainState

# Test-only hook: JAXPAR_TEST_SLOW_SAVE=<step> holds that step's save open (its data written,
# its folder not yet renamed) so that a test can kill the process in the middle of a save.
SLOW_SAVE_ENV = "JAXPAR_TEST_SLOW_SAVE"
_SLOW_SAVE_SECONDS = 600

class CheckpointMismatch(UserError):
    """A checkpoint that cannot be restored into this config (another model shape, optimizer or seed)."""


@dataclasses.dataclass
class Restored:
    """A restored training state, the step it was saved at and its metadata."""

    state: TrainState
    step: int
    meta: dict


def _entry_name(entry) -> str:
    """The name of one pytree path entry (dict key, attribute or sequence index)."""
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    raise TypeError(f"unsupported pytree path entry {entry!r}")


def flat_by_path(tree) -> dict[str, object]:
    """{'params/blocks/attn/w_qkv/value': leaf, ...} for any pytree (TrainState, shardings, ...)."""
    return {"/".join(_entry_name(e) for e in path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _nest(flat: dict[str, object]) -> dict:
    """Turn {'a/b/c': x} into {'a': {'b': {'c': x}}}, the plain dict tree Orbax saves."""
    out: dict = {}
    for key, leaf in flat.items():
        *parents, last = key.split("/")
        node = out
        for name in parents:
            node = node.setdefault(name, {})
        node[last] = leaf
    return out


def _unnest(tree: dict) -> dict[str, object]:
    return flatten_dict(tree, sep="/")


STALE, PARAMS = "stale_params/", "params/"


def state_spec(state) -> dict[str, list]:
    """Shape and dtype of every array of a (possibly abstract) state, keyed by path."""
    return {key: [list(leaf.shape), str(leaf.dtype)] for key, leaf in flat_by_path(state).items()}


def _must_match(config: dict) -> list[str]:
    """Config keys that fix a checkpoint's contents (array shapes, optimizer state) or its data order."""
    return [f"model.{key}" for key in config["model"]] + ["train.optimizer", "train.seed"]


def _config_value(config: dict, dotted: str):
    section, key = dotted.split(".")
    return config.get(section, {}).get(key)


def check_compatible(meta: dict, cfg: Config, abstract_state, where: str) -> None:
    """Raise CheckpointMismatch (one sentence) unless the checkpoint fits this config."""
    saved, now = meta["config"], cfg.to_dict()
    differ = [k for k in _must_match(now) if _config_value(saved, k) != _config_value(now, k)]
    if differ:
        then = ", ".join(f"{k}={_config_value(saved, k)}" for k in differ)
        here = ", ".join(f"{k}={_config_value(now, k)}" for k in differ)
        raise CheckpointMismatch(f"the checkpoint at step {meta['step']} in {where} was written with {then} but this "
                                 f"config has {here}; resume with the same values or use another run.dir.")
    # 2BW's stale weights may come and go with the layout; everything else must be there.
    expected = {k: v for k, v in state_spec(abstract_state).items() if not k.startswith(STALE)}
    saved_spec = {k: v for k, v in meta["spec"].items() if not k.startswith(STALE)}
    if saved_spec != expected:
        key = next(k for k in sorted(set(expected) | set(saved_spec)) if saved_spec.get(k) != expected.get(k))
        raise CheckpointMismatch(f"the checkpoint at step {meta['step']} in {where} holds a different training state "
                                 f"than this config builds (first difference: {key} is {saved_spec.get(key)} "
                                 f"there and {expected.get(key)} here); use another run.dir.")


def _brief(error: Exception) -> str:
    """The root cause of a read error on one line, short enough for a one-sentence report."""
    while error.__cause__ is not None:  # Orbax wraps TensorStore's precise message
        error = error.__cause__
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 160 else text[:157] + "..."


class _SlowSaveForTests(ocp.path.atomicity.AtomicRenameTemporaryPath):
    """Test-only: delays the final rename of the step named by JAXPAR_TEST_SLOW_SAVE."""

    async def finalize(self, *args, **kwargs):
        if self.get_final().name == os.environ.get(SLOW_SAVE_ENV):
            await asyncio.sleep(_SLOW_SAVE_SECONDS)
        await super().finalize(*args, **kwargs)


class Checkpoints:
    """The checkpoints of one run: periodic and final saves, and restoring the newest good one."""

    def __init__(self, directory: Path, keep: int, async_save: bool = True):
        self.directory = Path(directory).absolute()
        self.keep, self.async_save = keep, async_save
        self.last_step: int | None = None  # newest step saved or restored by this process
        self._manager: ocp.CheckpointManager | None = None

    def _open(self) -> ocp.CheckpointManager:
        # Opened lazily, so a run without checkpoints leaves no checkpoints folder behind.
        if self._manager is None:
            options = ocp.CheckpointManagerOptions(
                preservation_policy=ocp.checkpoint_managers.LatestN(self.keep),
                enable_async_checkpointing=self.async_save, cleanup_tmp_directories=True,
                temporary_path_class=_SlowSaveForTests if os.environ.get(SLOW_SAVE_ENV) else None)
            self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))
        return self._manager

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints on disk, oldest first."""
        if self._manager is None and not self.directory.is_dir():
            return []
        return sorted(self._open().all_steps())

    def save(self, step: int, state: TrainState, trainer) -> None:
        """Start saving `state` (laid out by `trainer`) as step `step`; returns once the arrays are copied
        to host memory, and writes them in the background when checkpoint.async is on."""
        cfg = trainer.cfg
        canonical = trainer.to_model_order(state)  # the identity unless the layout stores layers permuted
        meta = {"step": step, "data_position": step, "seed": cfg.train.seed, "config": cfg.to_dict(),
                "spec": state_spec(canonical)}
        self._open().save(step, force=True, args=ocp.args.Composite(
            state=ocp.args.StandardSave(_nest(flat_by_path(canonical))), meta=ocp.args.JsonSave(meta)))
        self.last_step = step

    def restore_latest(self, trainer, warn: Callable[[str], None]) -> Restored | None:
        """Restore the newest readable checkpoint onto `trainer`'s layout, or None when there is none.

        A checkpoint that cannot be read is reported (one sentence naming its step), moved to
        <run.dir>/damaged_checkpoints/ and skipped for the previous one. Raises CheckpointMismatch
        before anything is compiled or moved when the newest readable checkpoint does not fit the config.
        """
        abstract = jax.eval_shape(trainer.init)
        damaged: list[tuple[int, str]] = []
        restored = None
        for step in reversed(self.steps()):
            try:
                meta = self._open().restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
            except Exception as e:  # noqa: BLE001 - Orbax and TensorStore raise plain Exception for unreadable files
                damaged.append((step, _brief(e)))
                continue
            check_compatible(meta, trainer.cfg, abstract, str(self.directory))
            try:
                state = self._restore_state(step, trainer, abstract, meta)
            except Exception as e:  # noqa: BLE001 - as above
                damaged.append((step, _brief(e)))
                continue
            restored = Restored(self._adapt_loss_scale(state, meta, trainer), step, meta)
            break
        fallback = f"falling back to step {restored.step}" if restored else "training starts from step 0"
        for step, cause in damaged:
            self._set_aside(step)
            warn(f"the checkpoint at step {step} in {self.directory} is damaged and cannot be read ({cause}); "
                 f"{fallback}, and the damaged one is moved to {self._damaged_dir(step)}.")
        if restored is not None:
            self.last_step = restored.step
        return restored

    def _damaged_dir(self, step: int) -> Path:
        return self.directory.parent / "damaged_checkpoints" / str(step)

    def _set_aside(self, step: int) -> None:
        # Kept for inspection, but out of Orbax's folder: it must not block a new save of this step.
        target = self._damaged_dir(step)
        shutil.rmtree(target, ignore_errors=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(self.directory / str(step), target)
        self._open().reload()

    def _restore_state(self, step: int, trainer, abstract, meta: dict) -> TrainState:
        shardings = flat_by_path(trainer.state_shardings)
        wanted = flat_by_path(abstract)

        def target(key: str) -> jax.ShapeDtypeStruct:
            like = key if key in wanted else PARAMS + key[len(STALE):]  # stale weights this layout drops
            return jax.ShapeDtypeStruct(wanted[like].shape, wanted[like].dtype, sharding=shardings[like])

        # Orbax restores the saved tree whole, so saved stale weights are read even when they are dropped.
        tree = self._open().restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(_nest({key: target(key) for key in meta["spec"]})))).state
        arrays = _unnest(tree)
        for key in wanted.keys() - arrays.keys():
            # Only 2BW's stale weights can be missing (see check_compatible): they start as a copy of the weights.
            arrays[key] = jax.jit(jnp.copy, out_shardings=shardings[key])(arrays[PARAMS + key[len(STALE):]])
        state = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(abstract), [arrays[key] for key in wanted])
        # Saved in model order; an interleaved pipeline stores its stacked layers permuted.
        return trainer.put_state(trainer.from_model_order(state))

    @staticmethod
    def _adapt_loss_scale(state: TrainState, meta: dict, trainer) -> TrainState:
        # A new precision restarts the loss scale at its own initial value (fp16: 2^15, else a constant 1).
        precision = trainer.cfg.train.precision
        if meta["config"]["train"]["precision"] == precision:
            return state
        fresh = LossScale.initial(precision)
        scale = LossScale(fresh.scale, fresh.good_steps, state.loss_scale.skipped_steps)
        return dataclasses.replace(state, loss_scale=jax.device_put(scale, trainer.state_shardings.loss_scale))

    def wait(self) -> None:
        """Block until the last save is on disk."""
        if self._manager is not None:
            self._manager.wait_until_finished()

    def close(self) -> None:
        """Wait for the last save and release Orbax's background threads."""
        if self._manager is not None:
            self._manager.wait_until_finished()
            self._manager.close()
            self._manager = None
