"""Every check of a config against the device count, before anything is compiled: the mesh's
sizes resolved and laid over the processes (jaxpar.config.mesh), then each feature's checks
(jaxpar.features). The flags of `jaxpar schedule` and `jaxpar launch` are checked in
jaxpar.config.command_flags, and run.devices against the devices found in jaxpar.runtime.devices.

Every failure is a ConfigError with one sentence saying what to change. Pure Python (no jax).
"""

from __future__ import annotations

from jaxpar.config import Config, ConfigError
from jaxpar.config.mesh import host_split, resolve_mesh
from jaxpar.features import problem


def validate(cfg: Config, n_devices: int, processes: int = 1) -> tuple[dict[str, int], dict[str, int]]:
    """Check every cross-field constraint before anything is compiled; return the mesh sizes
    and how many processes each axis spans (host_split)."""
    sizes = resolve_mesh(cfg.mesh, n_devices)
    split = host_split(sizes, cfg.mesh, processes)
    sentence = problem(cfg, sizes)
    if sentence is not None:
        raise ConfigError(sentence)
    return sizes, split
