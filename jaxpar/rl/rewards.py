"""The reward functions of rl.reward: what each sampled completion of a prompt scores (GRPO's advantages
are these, normalised within the prompt's group, jaxpar.rl.grpo.group_advantages).

A built-in (exact_match, regex, length) reads its settings from the rl section; `module:function` is a
function of the user's, imported once and called per completion as fn(prompt, completion, **fields),
fields being the prompt record's fields that its parameters name (all of them if it takes **kwargs).
Every mistake, at loading or at scoring, is a UserError of one sentence that names the prompt.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import math
import os
import re
import sys
from collections.abc import Callable

import numpy as np

from jaxpar.config.rl import RLConfig
from jaxpar.errors import UserError
from jaxpar.sampling.prompts import shortened

BUILTINS = ("exact_match", "regex", "length")
SHORT_VALUE = 60  # characters of a returned value an error message quotes
_NAME = r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*"
_SPEC = re.compile(f"{_NAME}:{_NAME}")
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_KEYWORD = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def _cut(text: str, limit: int = SHORT_VALUE) -> str:
    """`text` cut to `limit` characters (the last three '...'), for an error message."""
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _described(error: BaseException) -> str:
    """'Type: message' on one line (the type alone when the message is empty)."""
    message = " ".join(str(error).split())
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def _finite(value) -> float | None:
    """`value` as a float if it is a real, finite number (int, float or a NumPy one, not a bool), else None."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        return None
    try:
        number = float(value)
    except OverflowError:  # an int past float's range
        return None
    return number if math.isfinite(number) else None


@dataclasses.dataclass(frozen=True)
class Reward:
    """A loaded rl.reward: `name` (the spec) and `fn`, (prompt, completion, record) -> its value."""

    name: str
    fn: Callable[[str, str, dict], object]

    def score(self, prompt: str, completion: str, record: dict) -> float:
        """The completion's reward, checked: a function that raises or returns anything but a real finite
        number is a UserError naming the prompt."""
        try:
            value = self.fn(prompt, completion, record)
        except UserError:
            raise
        except Exception as error:  # the user's code: any mistake in it is theirs to fix
            raise UserError(f"rl.reward={self.name!r} raised an exception ({_described(error)}) on the prompt "
                            f"{shortened(prompt)}.") from error
        number = _finite(value)
        if number is None:
            raise UserError(f"rl.reward={self.name!r} returned {_cut(repr(value))} ({type(value).__name__}), "
                            f"not a finite number, on the prompt {shortened(prompt)}.")
        return number


# ---- the built-ins, their settings bound first -------------------------------------------------------------

def _exact_match(field: str, prompt: str, completion: str, record: dict) -> float:
    """1 where the completion's first line, stripped, is the record's answer (as a string, stripped)."""
    if field not in record:
        raise UserError(f"the record of the prompt {shortened(prompt)} has no field {field!r} (rl.answer_field), "
                        "which rl.reward=exact_match compares the completion with.")
    lines = completion.splitlines()
    first = lines[0].strip() if lines else ""
    return 1.0 if first == str(record[field]).strip() else 0.0


def _regex(pattern: re.Pattern, prompt: str, completion: str, record: dict) -> float:
    """1 where the pattern matches anywhere in the completion."""
    return 1.0 if pattern.search(completion) else 0.0


def _length(target: int, prompt: str, completion: str, record: dict) -> float:
    """1 at `target` characters, falling linearly to 0 at 0 and 2 * target characters (and 0 past)."""
    return max(0.0, 1.0 - abs(len(completion) - target) / target)


def _compiled(pattern: str) -> re.Pattern:
    """rl.pattern compiled; an empty one (which matches everything) or one that does not compile is a UserError."""
    if not pattern:
        raise UserError("rl.reward=regex needs rl.pattern, a regular expression the completion should match, "
                        "but it is empty.")
    try:
        return re.compile(pattern)
    except re.error as error:
        raise UserError(f"rl.pattern={pattern!r} is not a regular expression ({error}).") from error


# ---- a function of the user's ------------------------------------------------------------------------------

def _parameters(fn: Callable, spec: str) -> tuple[frozenset | None, frozenset]:
    """(the record fields to pass: those the function's parameters name, None for all of them when it takes
    **kwargs; the names of the two parameters that take the prompt and the completion, never passed as
    fields). A function with no signature to read (some built-ins) gets no fields."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return frozenset(), frozenset()
    positional = [p for p in params if p.kind in _POSITIONAL]
    if len(positional) < 2 and not any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        raise UserError(f"rl.reward={spec!r} must take the prompt and the completion as its first two arguments.")
    bound = frozenset(p.name for p in positional[:2])
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None, bound
    return frozenset(p.name for p in params if p.kind in _KEYWORD) - bound, bound


def _call(fn: Callable, names: frozenset | None, bound: frozenset, prompt: str, completion: str,
          record: dict) -> object:
    """fn(prompt, completion, **the record's fields it takes)."""
    fields = {key: value for key, value in record.items()
              if key not in bound and (names is None or key in names)}
    return fn(prompt, completion, **fields)


def _user_function(spec: str) -> Callable:
    """The callable `module:function` names (function may be dotted: Class.method), imported with the
    current directory on sys.path, as pytest and `python -m` have it, so a module beside the config is
    found. Appended, not put first, so that a file there cannot shadow an installed module."""
    module_name, _, attribute = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    importlib.invalidate_caches()  # a module written since the last import (beside the config, say) is found
    try:
        target = importlib.import_module(module_name)
    except Exception as error:  # the user's module: a missing one, or one whose code fails on import
        raise UserError(f"rl.reward={spec!r}: the module {module_name!r} cannot be imported "
                        f"({_described(error)}).") from error
    for part in attribute.split("."):
        missing = object()
        target = getattr(target, part, missing)
        if target is missing:
            raise UserError(f"rl.reward={spec!r}: the module {module_name!r} has no {attribute!r}.")
    if not callable(target):
        raise UserError(f"rl.reward={spec!r} names an object of type {type(target).__name__}, not a function.")
    return target


def load_reward(cfg: RLConfig) -> Reward:
    """rl.reward loaded and checked: a built-in with its settings, or the user's `module:function`."""
    spec = cfg.reward
    if spec == "exact_match":
        return Reward(spec, functools.partial(_exact_match, cfg.answer_field))
    if spec == "regex":
        return Reward(spec, functools.partial(_regex, _compiled(cfg.pattern)))
    if spec == "length":
        if cfg.target_length < 1:
            raise UserError(f"rl.reward=length needs rl.target_length, the completion's best length in characters, "
                            f"of at least 1, not {cfg.target_length}.")
        return Reward(spec, functools.partial(_length, cfg.target_length))
    if not _SPEC.fullmatch(spec):
        raise UserError(f"rl.reward={spec!r} is neither a built-in reward ({', '.join(BUILTINS)}) nor a "
                        "module:function of your own.")
    fn = _user_function(spec)
    names, bound = _parameters(fn, spec)
    return Reward(spec, functools.partial(_call, fn, names, bound))


def score_all(reward: Reward, prompts: list[str], completions: list[str], records: list[dict]) -> np.ndarray:
    """Each completion's reward (float32, one per completion), completion i of prompts[i] and records[i]."""
    if not len(prompts) == len(completions) == len(records):
        raise ValueError(f"{len(prompts)} prompts, {len(completions)} completions and {len(records)} records")
    return np.asarray([reward.score(prompt, completion, record)
                       for prompt, completion, record in zip(prompts, completions, records)], np.float32)
