"""Orbax checkpoints of the training state under <run.dir>/checkpoints: save, find, restore.

A checkpoint has two items. `state` is the TrainState (step, parameters, optimizer and
loss-scale state) as a nested dict of arrays keyed by pytree path. `meta` is JSON: the
step (also the data position: batches are a pure function of seed and step), the seed,
the resolved config and the shape of every array.

Keying by path instead of by pytree type makes a checkpoint independent of the mesh, the
ZeRO stage and the pipeline schedule. Stacked layers are saved in model order (interleaved
pipelines store them permuted), and PipeDream-2BW's one-step-old weights are optional: a
layout without them drops them, and a layout that needs them starts them as the weights. What
2BW has in flight between steps is each device's own: only the layout that saved it restores a
step in flight; a finished run's (nothing in flight) is dropped or started empty like the stale
weights (jaxpar.train.checkpoint_fit).
A restore builds its targets from the new layout's `eval_shape(init)` and
`state_shardings`, so Orbax reads each shard straight onto its device, and nothing is
gathered whole on one host.

Orbax writes a step into a temporary folder and renames it when complete, so a save that
was killed is never listed; leftover temporary folders are removed when the manager opens.

A checkpoint whose files are missing, cut short or garbled is damaged: it is set aside and the
previous one restored. Any other error while restoring (a bug, out of memory, a sharding error)
ends the run and leaves every checkpoint where it is.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jaxpar.config import flatten_dict
from jaxpar.errors import RunFailed
from jaxpar.interop.checkpoint_files import PARAMS, brief_error, flat_by_path, is_damage, nest_by_path
from jaxpar.runtime import distributed
from jaxpar.train.checkpoint_fit import CheckpointMismatch, check_compatible, state_spec
from jaxpar.train.loss_scale import LossScale
from jaxpar.train.pacing import drop_idle_flight, in_flight_fits
from jaxpar.train.state import IN_FLIGHT, STALE, TrainState


class RestoreFailed(RunFailed):
    """Restoring a checkpoint failed for a reason other than damage; every checkpoint is left in place."""


class _Damaged(Exception):
    """The checkpoint at one step is damaged (on some process); `cause` says how, on one line."""

    def __init__(self, cause: str):
        super().__init__(cause)
        self.cause = cause


@dataclasses.dataclass
class Restored:
    """A restored training state and the step it was saved at."""

    state: TrainState
    step: int



def _unnest(tree: dict) -> dict[str, object]:
    return flatten_dict(tree, sep="/")


def _check_meta(meta) -> dict:
    """`meta` if it holds the fields every checkpoint's meta has, else _Damaged (valid JSON, but not ours)."""
    if not (isinstance(meta, dict) and isinstance(meta.get("step"), int) and isinstance(meta.get("spec"), dict)
            and isinstance(meta.get("config"), dict)):
        raise _Damaged("its meta item lacks the step, spec or config")
    return meta


# Orbax names its barriers "<prefix>_<name>"; without a prefix of ours, its async and sync checkpointers differ.
_BARRIER_PREFIX = "jaxpar"


def _rejoin_restore_barrier() -> None:
    """After a failed Orbax restore, meet the other processes where a successful one would have ended.

    Orbax 0.12.8 ends every restore with a barrier across processes ("Checkpointer:restore", a
    collective). A process whose read failed never got there, so the processes whose read worked
    would wait there for ever; each read is shared among the processes right after (see `_read`).
    """
    if jax.process_count() > 1:
        ocp.multihost.sync_global_processes(ocp.multihost.unique_barrier_key("Checkpointer:restore",
                                                                             prefix=_BARRIER_PREFIX))


def _handlers() -> ocp.handlers.DefaultCheckpointHandlerRegistry:
    """Orbax's handlers of the two items. On CPU the state is saved without replica-parallel writes: the
    emulated devices are threads of one process sharing one disk, so splitting a replicated array's
    write over its replicas gains nothing and compiles a slice per array and device (56 for the tiny
    model: 1.5 s of a 10-step run's first save). Elsewhere Orbax's default stands. Restoring is the same
    either way (StandardRestore reads what PyTreeSave wrote: StandardSave is PyTreeSave checked)."""
    if jax.devices()[0].platform == "cpu":
        saver = ocp.PyTreeCheckpointHandler(type_handler_registry=ocp.type_handlers.create_type_handler_registry(
            (jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False))))
    else:
        saver = ocp.PyTreeCheckpointHandler()
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    registry.add("state", ocp.args.PyTreeSave, saver)
    registry.add("state", ocp.args.StandardRestore, ocp.StandardCheckpointHandler())
    json_handler = ocp.JsonCheckpointHandler()
    registry.add("meta", ocp.args.JsonSave, json_handler)
    registry.add("meta", ocp.args.JsonRestore, json_handler)
    return registry


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
                multiprocessing_options=ocp.options.MultiprocessingOptions(barrier_sync_key_prefix=_BARRIER_PREFIX))
            self._manager = ocp.CheckpointManager(self.directory, options=options, handler_registry=_handlers())
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
        meta = {"step": step, "seed": cfg.train.seed, "config": cfg.to_dict(),
                "spec": state_spec(canonical)}
        self._open().save(step, force=True, args=ocp.args.Composite(
            state=ocp.args.PyTreeSave(nest_by_path(flat_by_path(canonical))), meta=ocp.args.JsonSave(meta)))
        self.last_step = step

    def restore_latest(self, trainer, warn: Callable[[str], None]) -> Restored | None:
        """Restore the newest readable checkpoint onto `trainer`'s layout, or None when there is none.

        A damaged checkpoint (see `is_damage`) is reported (one sentence naming its step), moved to
        <run.dir>/damaged_checkpoints/ and skipped for the previous one; in a multi-process run,
        process 0 moves it while the others wait. Raises CheckpointMismatch before anything is
        compiled or moved when the newest readable checkpoint does not fit the config, and
        RestoreFailed, moving nothing, when a restore fails for another reason.
        """
        abstract = trainer.abstract_state()
        damaged: list[tuple[int, str]] = []
        restored = None
        for step in reversed(self.steps()):
            try:
                restored = self._restore_step(step, trainer, abstract)
                break
            except _Damaged as e:
                damaged.append((step, e.cause))
        fallback = f"falling back to step {restored.step}" if restored else "training starts from step 0"
        for step, cause in damaged:
            warn(f"the checkpoint at step {step} in {self.directory} is damaged and cannot be read ({cause}); "
                 f"{fallback}, and the damaged one is moved to {self._damaged_dir(step)}.")
        if damaged:
            self._set_aside([step for step, _ in damaged])
        if restored is not None:
            self.last_step = restored.step
        return restored

    def _restore_step(self, step: int, trainer, abstract) -> Restored:
        """The checkpoint at `step` on `trainer`'s layout; _Damaged when some process finds it damaged."""
        try:
            meta = _check_meta(self._read(step, meta=ocp.args.JsonRestore()).meta)
            check_compatible(meta, trainer.cfg, abstract, str(self.directory))
            state = self._restore_state(step, trainer, abstract, meta)
            return Restored(self._adapt_loss_scale(state, meta, trainer), step)
        except (_Damaged, CheckpointMismatch, RestoreFailed):
            raise
        except Exception as e:  # noqa: BLE001 - not damage (a bug, out of memory, a sharding error): end the run
            raise RestoreFailed(self._not_damage(step, f"{type(e).__name__}: {brief_error(e)}")) from e

    def _read(self, step: int, **items):
        """Orbax's restore of `items` of `step` on every process. Raises _Damaged when some process found
        damage, and RestoreFailed (on every process) when some process failed otherwise."""
        try:
            restored, outcome = self._open().restore(step, args=ocp.args.Composite(**items)), ("ok", "", "")
        except Exception as e:  # noqa: BLE001 - sorted into damage or not here, and raised again by _settle
            restored, outcome = None, ("damaged" if is_damage(e) else "failed", type(e).__name__, brief_error(e))
            _rejoin_restore_barrier()
        self._settle(step, [json.loads(o) for o in distributed.share(json.dumps(outcome))])
        return restored

    def _settle(self, step: int, outcomes: list) -> None:
        """Raise what the worst of the processes' read outcomes calls for (a failure, then damage), if any."""
        where = [f" on process {p}" if len(outcomes) > 1 else "" for p in range(len(outcomes))]
        for process, (kind, name, text) in enumerate(outcomes):
            if kind == "failed":
                raise RestoreFailed(self._not_damage(step, f"{name}: {text}", where[process]), everywhere=True)
        for process, (kind, _, text) in enumerate(outcomes):
            if kind == "damaged":
                raise _Damaged(text + where[process])

    def _not_damage(self, step: int, cause: str, where: str = "") -> str:
        return (f"restoring the checkpoint at step {step} in {self.directory} failed{where} with {cause}, which is "
                f"not damage to the checkpoint, so every checkpoint stays where it is; fix the cause and run the "
                f"same command again.")

    def _damaged_dir(self, step: int) -> Path:
        return self.directory.parent / "damaged_checkpoints" / str(step)

    def _set_aside(self, steps: list[int]) -> None:
        # Kept for inspection, but out of Orbax's folder: they must not block a new save of their step.
        if not distributed.is_secondary():
            for step in steps:
                target = self._damaged_dir(step)
                shutil.rmtree(target, ignore_errors=True)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(self.directory / str(step), target)
        distributed.share("set aside")  # the others list the checkpoints again only once process 0 has moved them
        self._open().reload()

    def _restore_state(self, step: int, trainer, abstract, meta: dict) -> TrainState:
        shardings = flat_by_path(trainer.state_shardings)
        wanted = flat_by_path(abstract)

        flight_fits = in_flight_fits(meta["spec"], state_spec(abstract))

        def target(key: str) -> jax.ShapeDtypeStruct:
            if key.startswith(IN_FLIGHT) and not flight_fits:  # read whole, to see whether a step is in flight
                shape, dtype = meta["spec"][key]
                return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=trainer.replicated)
            like = key if key in wanted else PARAMS + key[len(STALE):]  # stale weights this layout drops
            return jax.ShapeDtypeStruct(wanted[like].shape, wanted[like].dtype, sharding=shardings[like])

        # Orbax restores the saved tree whole, so saved stale weights are read even when they are dropped.
        targets = nest_by_path({key: target(key) for key in meta["spec"]})
        tree = self._read(step, state=ocp.args.StandardRestore(targets)).state
        arrays = _unnest(tree)
        if not flight_fits:
            drop_idle_flight(arrays, step, self.directory)
        for key in wanted.keys() - arrays.keys():
            if key.startswith(IN_FLIGHT):  # 2BW on a state with nothing in flight: empty
                arrays[key] = jax.jit(lambda a=wanted[key]: jnp.zeros(a.shape, a.dtype), out_shardings=shardings[key])()
                continue
            # Only 2BW's stale weights can be missing (see check_compatible): they start as a copy of the weights.
            arrays[key] = jax.jit(jnp.copy, out_shardings=shardings[key])(arrays[PARAMS + key[len(STALE):]])
        state = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(abstract), [arrays[key] for key in wanted])
        # Saved in model order; an interleaved pipeline stores its stacked layers permuted.
        return trainer.put_state(trainer.from_model_order(state))

    @staticmethod
    def _adapt_loss_scale(state: TrainState, meta: dict, trainer) -> TrainState:
        # A new precision policy restarts the loss scale at its own initial value (fp16: 2^15, else a constant 1).
        if trainer.precision.carries_loss_scale_from(meta["config"]["train"]["precision"]):
            return state
        fresh = LossScale.initial(trainer.precision)
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
