"""A checkpoint's files as a saved run's readers see them: every array keyed by its pytree path (the
parameters under PARAMS), and which read errors say that a checkpoint is damaged.

Training writes and restores whole states (jaxpar.train.checkpoint); `jaxpar generate`, `eval`,
`export-hf` and model.from_run read the parameters alone (jaxpar.interop.saved_run). Both key arrays
by path, so a checkpoint is independent of the mesh, the ZeRO stage and the pipeline schedule.
"""

from __future__ import annotations

import errno
import json

import jax

from jaxpar.model.axes import path_names

PARAMS = "params/"


def flat_by_path(tree) -> dict[str, object]:
    """{'params/blocks/attn/w_qkv/value': leaf, ...} for any pytree (TrainState, shardings, ...)."""
    return {"/".join(path_names(path)): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def nest_by_path(flat: dict[str, object]) -> dict:
    """Turn {'a/b/c': x} into {'a': {'b': {'c': x}}}, the plain dict tree Orbax saves."""
    out: dict = {}
    for key, leaf in flat.items():
        *parents, last = key.split("/")
        node = out
        for name in parents:
            node = node.setdefault(name, {})
        node[last] = leaf
    return out



def brief_error(error: BaseException) -> str:
    """The root cause of a read error on one line, short enough for a one-sentence report."""
    while error.__cause__ is not None:  # Orbax wraps TensorStore's precise message
        error = error.__cause__
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 160 else text[:157] + "..."


# What Orbax 0.12.8 and TensorStore 0.1.86 raise for a damaged checkpoint, found by damaging one on purpose:
# - a missing file (meta/metadata) or one that cannot be read (a folder in its place): OSError;
# - a missing item folder (meta/ or state/): KeyError 'Item "state" was not found in the checkpoint ...';
# - a truncated or garbled JSON file (meta/metadata, state/_METADATA): JSONDecodeError, UnicodeDecodeError;
# - a missing, truncated or garbled array file (state/manifest.ocdbt, state/d/*, state/ocdbt.process_*/d/*):
#   TensorStore's plain ValueError whose text starts with an absl status: NOT_FOUND, DATA_LOSS, OUT_OF_RANGE
#   (a byte range past a cut-short file), or FAILED_PRECONDITION "Error reading ..." (a stream that does not
#   decompress). Orbax raises it as is, or as the cause of its own plain Exception "Encountered error while
#   reading array index". Other statuses (RESOURCE_EXHAUSTED, ...) and other ValueErrors are not damage.
_DAMAGE_STATUSES = ("NOT_FOUND:", "DATA_LOSS:", "OUT_OF_RANGE:")


def is_damage(error: BaseException | None) -> bool:
    """Whether `error`, or an error it was raised from, says that a checkpoint file is missing, cut short or
    garbled (rather than a bug, out of memory, a sharding error, ...)."""
    while error is not None:
        if _says_damage(error):
            return True
        error = error.__cause__
    return False


def _says_damage(error: BaseException) -> bool:
    if isinstance(error, OSError):
        return error.errno != errno.ENOMEM
    if isinstance(error, (json.JSONDecodeError, UnicodeDecodeError)):
        return True
    text = str(error)
    if type(error) is KeyError:
        return "was not found in the checkpoint" in text
    if type(error) is ValueError:
        undecodable = text.startswith("FAILED_PRECONDITION:") and "Error reading" in text
        return text.startswith(_DAMAGE_STATUSES) or undecodable
    return False
