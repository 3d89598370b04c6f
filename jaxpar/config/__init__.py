"""Typed, frozen configuration: dataclass defaults, YAML presets and dotted overrides.

This module must not import jax: the CLI reads the config first and only then sets
XLA_FLAGS (host-device emulation) and starts jax.

The dataclass defaults below are the single source of truth for default values; YAML
presets in configs/ hold only what differs from them (and may name a preset to extend).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
from pathlib import Path
from typing import Literal, Union

import yaml

from jaxpar.config.adapters import LoRAConfig as LoRAConfig  # the sections of their own modules, re-exported
from jaxpar.config.mla import MLAConfig as MLAConfig
from jaxpar.config.model import ModelConfig as ModelConfig
from jaxpar.config.moe import MoEConfig as MoEConfig
from jaxpar.config.mtp import MTPConfig as MTPConfig
from jaxpar.config.parallel import ParallelConfig as ParallelConfig
from jaxpar.config.parallel import PipelineConfig as PipelineConfig
from jaxpar.config.preference import PreferenceConfig
from jaxpar.config.rl import RLConfig
from jaxpar.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh axis sizes; -1 on one axis means "all remaining devices".

    `hosts` names the axes that may span processes (hosts), in the order they take them:
    in a multi-process run the processes are split over these axes and every other axis
    stays inside one process, on the fast intra-host links. Naming tensor or expert here
    forces them across processes.
    """

    data: int = -1
    context: int = 1  # the sequence split across devices through the whole block (jaxpar.parallel.context)
    tensor: int = 1
    expert: int = 1
    stage: int = 1
    hosts: str = "data,stage"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimization: steps, batch, schedule and numerics."""

    steps: int = 300
    batch_size: int = 32
    grad_accum: int = 1
    lr: float = 3e-3
    warmup: int = 20
    precision: Literal["fp32", "bf16", "fp16", "fp8"] = "fp32"
    seed: int = 0
    log_every: int = 10
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    eval_batches: int = 8
    eval_every: int = 0  # a validation loss every N steps as well (`val_loss` in its metrics line); 0: at the end only
    # lm-eval tasks run during training (task YAMLs, configs/evals names or lm-eval's), 'T1,T2'; '' runs none
    eval_tasks: str = ""
    eval_tasks_every: int = 0  # run them every N steps (`eval/<task>/<metric>` in that step's row); 0: at the end only
    eval_tasks_limit: int = 0  # documents a task at most; 0: all
    sample_tokens: int = 160  # greedy sample at the end of a run; 0 writes none
    optimizer: Literal["adamw", "adafactor", "muon"] = "adamw"
    # muon: the hidden matrices it takes, `all` or a comma list of weight names or path ends (w_qkv, mlp/w_down)
    muon_weights: str = "all"
    remat: Literal["none", "dots", "full", "sqrt"] = "none"  # in the order of what each recomputes
    loss_scale_window: int = 2000
    # auto: the precision policy's own (dynamic loss scaling for fp16 only); dynamic: forced (bf16 and fp16)
    loss_scaling: Literal["auto", "dynamic"] = "auto"
    lr_schedule_steps: int = 0  # horizon of the warmup+cosine schedule; 0 means train.steps
    on_nonfinite: Literal["stop", "skip"] = "stop"
    # pinned host memory for the optimizer state (brought to the device for the update), full remat's layer inputs
    offload: Literal["none", "optimizer", "activations", "both"] = "none"
    loss_chunks: int = 1  # logits + loss in N strided chunks of the sequence (model/chunked_loss.py); 0: automatic
    # what training minimizes: next-token cross-entropy (sft), a preference loss on chosen/rejected pairs, or
    # GRPO's clipped policy objective on completions sampled every step and scored by rl.reward
    objective: Literal["sft", "dpo", "simpo", "orpo", "grpo"] = "sft"
    preference: PreferenceConfig = PreferenceConfig()

    @property
    def offloads_optimizer(self) -> bool:
        return self.offload in ("optimizer", "both")

    @property
    def offloads_activations(self) -> bool:
        return self.offload in ("activations", "both")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints under <run.dir>/checkpoints: every N steps (0 = off), keep the newest K."""

    every: int = 0
    final: bool = True  # a run that completes saves its last step (what export-hf, generate and a resume read)
    keep: int = 3
    async_: bool = dataclasses.field(default=True, metadata={"key": "async"})
    local_every: int = 0  # every N steps also a copy in host memory (and one peer's), restored first; 0 = off


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where tokens come from: 'builtin', a .txt file or folder of them, a uint16 .bin file, or a tokenized
    folder; and how rows are cut from them. packing: 'none' cuts windows anywhere in the token stream; 'concat'
    cuts them too but keeps each document to itself (attention, positions, loss); 'pack' places whole documents
    into rows, padding the rest (jaxpar.data.packing). Both need documents ('builtin', or `jaxpar tokenize`'s)."""

    source: str = "builtin"
    val_fraction: float = 0.05
    packing: Literal["none", "concat", "pack"] = "none"
    # tokenized folders mixed by weight, 'FOLDER:WEIGHT,FOLDER:WEIGHT' (jaxpar.data.mixture); in place of source
    mixture: str = ""


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Output folder, devices ('auto' or a count), how long a silent peer process may go (s), elastic layouts."""

    dir: str = "runs/default"
    devices: int | str = "auto"
    heartbeat_timeout: float = 30.0
    tensorboard: bool = False  # also write the metrics as TensorBoard event files under <dir>/tensorboard
    wandb: bool = False  # also log the metrics, config and summary to Weights & Biases (under <dir>/wandb)
    wandb_project: str = "jaxpar"
    wandb_mode: Literal["online", "offline"] = "online"  # offline: a run folder that `wandb sync` uploads later
    elastic: bool = False  # on another device count than before: re-plan the layout, keep the global batch


@dataclasses.dataclass(frozen=True)
class Config:
    """The whole run configuration."""

    model: ModelConfig = ModelConfig()
    mesh: MeshConfig = MeshConfig()
    train: TrainConfig = TrainConfig()
    parallel: ParallelConfig = ParallelConfig()
    data: DataConfig = DataConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    run: RunConfig = RunConfig()
    rl: RLConfig = RLConfig()

    def replace(self, **sections) -> Config:
        """Return a copy with whole sections or dotted keys ('train.steps') replaced."""
        return apply_overrides(self, sections)

    def to_dict(self) -> dict:
        """Plain nested dict keyed by config keys, for JSON summaries and checkpoints."""
        return _as_dict(self)


def _key(field: dataclasses.Field) -> str:
    """The config key of a dataclass field: its name, unless it names another (`async_` is the key `async`)."""
    return field.metadata.get("key", field.name)


def _as_dict(obj) -> dict:
    return {_key(f): _as_dict(v) if dataclasses.is_dataclass(v := getattr(obj, f.name)) else v
            for f in dataclasses.fields(obj)}


MESH_AXES = ("data", "tensor", "expert", "stage", "context")  # context last: its shard_map nests in one over stage
CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


@functools.cache  # resolving the annotations is slow, and the planner's search replaces thousands of configs
def _fields(cls) -> dict[str, type]:
    """Config key -> resolved type annotation, in declaration order (read only: the dict is shared)."""
    hints = typing.get_type_hints(cls)
    return {_key(f): hints[f.name] for f in dataclasses.fields(cls)}


def _field_name(cls, key: str) -> str:
    """The dataclass field behind a config key."""
    return next(f.name for f in dataclasses.fields(cls) if _key(f) == key)


@functools.cache
def _leaf_types(cls, prefix: str = "") -> dict[str, type]:
    """Every dotted key under a config dataclass with its type, nested sections flattened (read only)."""
    out = {}
    for name, typ in _fields(cls).items():
        out.update(_leaf_types(typ, f"{prefix}{name}.") if dataclasses.is_dataclass(typ) else {prefix + name: typ})
    return out


def all_keys() -> list[str]:
    """Every dotted key the config accepts, e.g. 'model.d_model'."""
    return list(_leaf_types(Config))


def _unknown_key(key: str) -> ConfigError:
    close = difflib.get_close_matches(key, all_keys(), n=1, cutoff=0.6)
    hint = f"; did you mean '{close[0]}'?" if close else f"; known sections are {', '.join(_fields(Config))}."
    return ConfigError(f"unknown config key {quoted(key)}{hint}")


def quoted(text) -> str:
    """A user's text in quotes for a one-line message: 'like this', with control characters escaped."""
    return repr(str(text))


def _coerce(key: str, value, typ):
    """Check (and for command-line strings, convert) a value against a field type."""
    origin = typing.get_origin(typ)
    if origin is Literal:
        choices = typing.get_args(typ)
        if value not in choices or not any(type(value) is type(c) for c in choices):  # 1.0 and True are not 1
            raise ConfigError(f"{key} must be one of {', '.join(map(str, choices))}, got {value!r}.")
        return value
    if origin in (Union, types.UnionType):  # Union[a, b] or a | b
        for option in typing.get_args(typ):
            try:
                return _coerce(key, value, option)
            except ConfigError:
                pass
        names = " or ".join(t.__name__ for t in typing.get_args(typ))
        raise ConfigError(f"{key} expects {names}, got {value!r}.")
    if typ is bool:
        if isinstance(value, bool):
            return value
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if not -2 ** 63 <= value < 2 ** 63:  # numpy and XLA take 64-bit integers at most
                shown = value if value.bit_length() <= 256 else f"a {value.bit_length()}-bit number"
                raise ConfigError(f"{key} must fit in 64 bits (between -2**63 and 2**63 - 1), got {shown}.")
            return value
    elif typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:  # an int too large for a float
                number = math.inf
            if not math.isfinite(number):
                raise ConfigError(f"{key} must be a finite number, got {value!r}.")
            return number
    elif typ is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    kind = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[typ]
    raise ConfigError(f"{key} expects {kind}, got {value!r}.")


def _parse_scalar(text: str):
    """Turn a command-line value into a Python scalar: int, float (1e-3 too), else as YAML reads it."""
    for number in (int, float):
        try:
            return number(text)
        except ValueError:
            pass
    try:
        return yaml.safe_load(text) if text.strip() else ""
    except (yaml.YAMLError, ValueError, OverflowError):  # e.g. '2020-13-45' or '!!float abc': keep the text
        return text


def flatten_dict(tree: dict, sep: str = ".", prefix: str = "") -> dict[str, object]:
    """{'a': {'b': 1}} -> {'a.b': 1} (with `sep` between the keys)."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten_dict(value, sep, f"{prefix}{key}{sep}"))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _set_path(obj, parts: list[str], value):
    name = _field_name(type(obj), parts[0])
    if len(parts) == 1:
        return dataclasses.replace(obj, **{name: value})
    return dataclasses.replace(obj, **{name: _set_path(getattr(obj, name), parts[1:], value)})


def apply_overrides(cfg: Config, overrides: dict) -> Config:
    """Apply {'section.key': value} (or nested {'section': {key: value}}) overrides, with type checks."""
    types = _leaf_types(Config)
    for key, value in flatten_dict(overrides).items():
        if key not in types:
            raise _unknown_key(key)
        typ = types[key]
        if isinstance(value, str) and typ is not str and not _is_str_literal(typ):
            value = _parse_scalar(value)
        cfg = _set_path(cfg, key.split("."), _coerce(key, value, typ))
    return cfg


def _is_str_literal(typ) -> bool:
    return typing.get_origin(typ) is Literal and all(isinstance(a, str) for a in typing.get_args(typ))
