"""Predicted step time of a compiled layout on a hardware profile: a roofline over what the
compiled program does (jaxpar.plan.measure_step), not over a formula of the model.

    compute  = matmul FLOPs a device executes per step / the profile's peak in the compute dtype
               (the precision policy's; a pipeline: the busiest stage's executed FLOPs);
    comm     = sum over collectives of executions x (overhead + (n - 1) x latency + bytes the
               device sends / bandwidth), n the devices in each of its groups (a permute: 2),
               the link being the inter-host one when the op's groups span a mesh axis that
               crosses hosts (mesh.hosts, `jaxpar.config.mesh.host_split`), else the intra-host one;
    memory   = bytes the non-matmul work writes per step (hlo.written_bytes: every unfused
               instruction's result, loops multiplied out; the busiest stage) / the profile's
               write bandwidth: elementwise ops, norms, softmax, the optimizer update;
    bubble   = (compute + memory) x f / (1 - f), f the schedule's idle fraction: the stage-ticks
               a pipeline waits, each tick as long as the work ticks around it.

Overlap: on profiles that overlap collectives (GPUs), collectives over the data axis only (ZeRO
gathers, gradient reductions: independent of the next matmul) run under compute and memory
work, so they cost only what exceeds it; every other collective (tensor, expert, stage) feeds
the next op and adds. Compute and memory work add (one stream of kernels). On the `cpu` profile
nothing overlaps and all terms add. Host transfers (train.offload) are not in the model.
"""

from __future__ import annotations

import dataclasses
import math

from jaxpar.config import precision
from jaxpar.config.mesh import host_split
from jaxpar.runtime.hardware import Hardware

TERMS = ("compute", "memory", "communication", "bubble")


@dataclasses.dataclass(frozen=True)
class Prediction:
    """Seconds per step by term; `seconds` is the predicted step time after overlap."""

    compute: float
    memory: float
    communication: float
    exposed_communication: float
    bubble: float
    seconds: float

    @property
    def limiting(self) -> str:
        """The largest of compute, memory, communication and bubble."""
        return max(TERMS, key=lambda term: getattr(self, term))

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "limiting": self.limiting}


def host_spanning_axes(sizes: dict[str, int], process_split: dict[str, int]) -> set[str]:
    """The mesh axes whose groups cross hosts."""
    return {axis for axis, split in process_split.items() if split > 1 and sizes[axis] > 1}


def collective_seconds(op: dict, hardware: Hardware, across_hosts: set[str], sizes: dict[str, int]) -> float:
    """One collective's seconds per step: executions x (the fixed overhead + (n - 1) ring steps of
    latency + sent bytes / bandwidth), n the devices in each group (a permute sends to one other)."""
    inter = bool(across_hosts.intersection(op["mesh_axes"]))
    bandwidth = hardware.inter_host_bandwidth if inter else hardware.intra_host_bandwidth
    latency = hardware.inter_host_latency_s if inter else hardware.intra_host_latency_s
    group = 2 if op["op"] == "collective-permute" else math.prod(sizes[a] for a in op["mesh_axes"])
    return op["count"] * (hardware.collective_overhead_s + max(group - 1, 1) * latency + op["wire_bytes"] / bandwidth)


def predict(plan: dict, hardware: Hardware, compute_dtype: str, idle_fraction: float, across_hosts: set[str],
            sizes: dict[str, int]) -> Prediction:
    """The roofline of one compiled step (`plan` from measure_step) on a mesh of axis `sizes`, its
    matmuls in `compute_dtype` (a jax.numpy name: the precision policy's `compute`)."""
    compute = max(plan["executed_flops_per_stage"]) / hardware.peak_flops[compute_dtype]
    memory = max(plan["written_bytes_per_stage"]) / hardware.write_bandwidth
    busy = compute + memory
    overlappable = exposed = 0.0
    for op in plan["collective_ops"]:
        seconds = collective_seconds(op, hardware, across_hosts, sizes)
        if hardware.overlaps_collectives and op["mesh_axes"] and set(op["mesh_axes"]) <= {"data"}:
            overlappable += seconds
        else:
            exposed += seconds
    bubble = busy * idle_fraction / (1 - idle_fraction) if idle_fraction < 1 else math.inf
    exposed_total = exposed + max(overlappable - busy, 0.0)
    return Prediction(compute, memory, overlappable + exposed, exposed_total, bubble, busy + exposed_total + bubble)


def hosts_of(hardware: Hardware, n_devices: int) -> int:
    """How many hosts n devices of this hardware take (devices_per_host each; at least one)."""
    return max(n_devices // hardware.devices_per_host, 1)


def predict_layout(plan: dict, hardware: Hardware, cfg, sizes: dict[str, int], idle_fraction: float) -> Prediction:
    """`predict` for cfg's layout (mesh axis `sizes`) laid out over the hosts of `hardware`."""
    split = host_split(sizes, cfg.mesh, hosts_of(hardware, math.prod(sizes.values())))
    return predict(plan, hardware, precision.of(cfg).compute, idle_fraction, host_spanning_axes(sizes, split), sizes)
