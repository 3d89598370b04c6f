"""Predicted step time of a compiled layout on a hardware profile: a roofline over what the
compiled program does (jaxpar.plan.measure_step), not over a formula of the model.

    compute  = matmul FLOPs a device executes per step / the profile's peak in the compute dtype
               (a pipeline: the busiest stage's executed FLOPs);
    comm     = sum over collectives of executions x (latency + bytes the device sends / bandwidth),
               the link being the inter-host one when the op's groups span a mesh axis that
               crosses hosts (mesh.hosts, `jaxpar.validation.host_split`), else the intra-host one;
    bubble   = compute x f / (1 - f), f the schedule's idle fraction: the stage-ticks a pipeline
               waits, each tick as long as the work ticks around it.

Overlap: on profiles that overlap collectives (GPUs), collectives over the data axis only (ZeRO
gathers, gradient reductions: independent of the next matmul) run under compute, so they cost
only what exceeds it; every other collective (tensor, expert, stage) feeds the next op and adds.
On the `cpu` profile nothing overlaps and all terms add. Matmuls are the only compute counted:
elementwise work, the optimizer update and host transfers are not in the model.
"""

from __future__ import annotations

import dataclasses
import math

from jaxpar.hardware import Hardware

TERMS = ("compute", "communication", "bubble")


@dataclasses.dataclass(frozen=True)
class Prediction:
    """Seconds per step by term; `seconds` is the predicted step time after overlap."""

    compute: float
    communication: float
    exposed_communication: float
    bubble: float
    seconds: float

    @property
    def limiting(self) -> str:
        """The largest of compute, communication and bubble."""
        return max(TERMS, key=lambda term: getattr(self, term))

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "limiting": self.limiting}


def host_spanning_axes(sizes: dict[str, int], process_split: dict[str, int]) -> set[str]:
    """The mesh axes whose groups cross hosts."""
    return {axis for axis, split in process_split.items() if split > 1 and sizes[axis] > 1}


def collective_seconds(op: dict, hardware: Hardware, across_hosts: set[str]) -> float:
    """One collective's seconds per step: its executions x (latency + sent bytes / bandwidth)."""
    inter = bool(across_hosts.intersection(op["mesh_axes"]))
    bandwidth = hardware.inter_host_bandwidth if inter else hardware.intra_host_bandwidth
    latency = hardware.inter_host_latency_s if inter else hardware.intra_host_latency_s
    return op["count"] * (latency + op["wire_bytes"] / bandwidth)


def predict(plan: dict, hardware: Hardware, precision: str, idle_fraction: float,
            across_hosts: set[str]) -> Prediction:
    """The roofline of one compiled step (`plan` from measure_step)."""
    compute = max(plan["executed_flops_per_stage"]) / hardware.peak_flops[precision]
    overlappable = exposed = 0.0
    for op in plan["collective_ops"]:
        seconds = collective_seconds(op, hardware, across_hosts)
        if hardware.overlaps_collectives and op["mesh_axes"] and set(op["mesh_axes"]) <= {"data"}:
            overlappable += seconds
        else:
            exposed += seconds
    bubble = compute * idle_fraction / (1 - idle_fraction) if idle_fraction < 1 else math.inf
    exposed_total = exposed + max(overlappable - compute, 0.0)
    return Prediction(compute, overlappable + exposed, exposed_total, bubble, compute + exposed_total + bubble)
