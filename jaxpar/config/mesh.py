"""The mesh section's derived values: each axis's size on a number of devices (`resolve_mesh`, -1
filled in), and how many processes each axis spans (`host_split`, the inter-host part of a hybrid
mesh). Pure Python (no jax)."""

from __future__ import annotations

import math

from jaxpar.config import MESH_AXES, ConfigError, MeshConfig


def resolve_mesh(mesh: MeshConfig, n_devices: int) -> dict[str, int]:
    """Axis sizes with -1 filled in; raises ConfigError unless they multiply to n_devices."""
    sizes = {a: getattr(mesh, a) for a in MESH_AXES}
    for axis, size in sizes.items():
        if size == 0 or size < -1:
            raise ConfigError(f"mesh.{axis} must be a positive size or -1, got {size}.")
    free = [a for a, s in sizes.items() if s == -1]
    if len(free) > 1:
        raise ConfigError(f"only one mesh axis may be -1, but {', '.join('mesh.' + a for a in free)} all are.")
    fixed = math.prod(s for s in sizes.values() if s != -1)
    if free:
        if n_devices % fixed:
            named = ", ".join(f"mesh.{a}={s}" for a, s in sizes.items() if s > 1)
            raise ConfigError(f"the fixed mesh axes ({named}) multiply to {fixed}, which does not divide "
                              f"the {n_devices} devices.")
        sizes[free[0]] = n_devices // fixed
    elif fixed != n_devices:
        raise ConfigError(f"the mesh axes multiply to {fixed} but there are {n_devices} devices.")
    return sizes


def host_axes(mesh: MeshConfig) -> list[str]:
    """The axes named by mesh.hosts, checked."""
    names = [a.strip() for a in mesh.hosts.split(",") if a.strip()]
    unknown = [a for a in names if a not in MESH_AXES]
    if unknown or len(set(names)) != len(names):
        raise ConfigError(f"mesh.hosts must list distinct mesh axes from {', '.join(MESH_AXES)}, got {mesh.hosts!r}.")
    return names


def host_split(sizes: dict[str, int], mesh: MeshConfig, processes: int) -> dict[str, int]:
    """How many processes each mesh axis spans (the outer, inter-host part of a hybrid mesh).

    The processes are handed to the axes of mesh.hosts in order, each taking as many as its
    size allows; every other axis stays inside one process. Raises ConfigError when they
    cannot all be placed, e.g. when only a tensor axis could span them.
    """
    names = host_axes(mesh)
    split = {a: 1 for a in MESH_AXES}
    left = processes
    for axis in names:
        share = math.gcd(left, sizes[axis])
        split[axis], left = share, left // share
    if left > 1:
        inside = [a for a in MESH_AXES if a not in names and sizes[a] > 1]
        spanning = ", ".join(f"mesh.{a}={sizes[a]}" for a in names) or "no axis"
        kept = f"; {', '.join(inside)} must stay inside a process unless mesh.hosts names it" if inside else ""
        raise ConfigError(f"the {processes} processes cannot be laid out over the axes that may span hosts "
                          f"(mesh.hosts={mesh.hosts}: {spanning}){kept}.")
    return split
