"""Hardware profiles for the planner's roofline: peak matmul rate by compute dtype, memory per
device, link bandwidths inside a host and across hosts, and per-collective latency.

The GPU profiles are documented constants (vendor datasheets; dense figures, no sparsity):
  * H100 SXM5 80 GB: 989 TFLOP/s bf16/fp16, 495 TF32 (fp32 matmuls run as TF32), HBM3 at
    3.35 TB/s. NVLink 4 is
    900 GB/s per GPU in both directions, 450 GB/s each way; a DGX/HGX H100 node has 8 GPUs and
    one 400 Gb/s ConnectX-7 NIC per GPU (50 GB/s each way).
    (nvidia.com/en-us/data-center/h100, "H100 SXM" column; DGX H100 user guide, networking.)
  * H200 SXM 141 GB: the H100's compute and NVLink 4 with 141 GB of HBM3e at 4.8 TB/s; HGX H200 nodes have
    the same 8 GPUs and 400 Gb/s per GPU. (nvidia.com/en-us/data-center/h200.)
  * B200 (HGX/DGX B200, 1,000 W): 2,250 TFLOP/s bf16/fp16 dense, 1,100 TF32, 180 GB of HBM3e at 8 TB/s.
    NVLink 5 is 1.8 TB/s per GPU in both directions, 900 GB/s each way; a DGX B200 has 8 GPUs and one
    400 Gb/s ConnectX-7 NIC per GPU. (NVIDIA HGX B200 datasheet's dense figures, half its sparse ones;
    DGX B200 user guide.)
  * A100 SXM4 80 GB: 312 TFLOP/s bf16/fp16, 156 TF32, HBM2e at 2.04 TB/s. NVLink 3 is 600 GB/s per GPU both ways
    (300 each way); a DGX A100 has 8 GPUs and one 200 Gb/s HDR NIC per GPU (25 GB/s).
    (nvidia.com/en-us/data-center/a100, "A100 80GB SXM"; DGX A100 user guide.)
  Latencies are per step of a ring (a collective over n devices takes n-1 of them): NCCL's order
  of magnitude, about 5 us over NVLink and 10 us across nodes; they matter only for small messages.

The `cpu` profile is measured on the machine it runs on and cached; `jaxpar.plan.calibrate.profile`
looks any profile up by name.
"""

from __future__ import annotations

import dataclasses

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Hardware:
    """What the roofline needs of one kind of device.

    peak_flops: matmul FLOP/s of one device by compute dtype (jaxpar.config.precision's names: float32,
    bfloat16, float16; a run looks its policy's `compute` up); intra/inter_host_bandwidth:
    bytes per second one device sends over a link inside its host / to another host;
    intra/inter_host_latency_s: seconds per step of a ring (n-1 steps for n devices);
    collective_overhead_s: a fixed cost of every collective, besides its steps; write_bandwidth:
    bytes per second written by elementwise work that reads about as much (GPUs: half the HBM
    bandwidth);
    overlaps_collectives: whether collectives over the data axes run while compute runs (GPUs:
    XLA's latency-hiding scheduler makes them asynchronous; XLA:CPU runs them in line);
    machine: a measured profile's machine record (jaxpar.runtime.machine.describe), None for a datasheet.
    """

    name: str
    peak_flops: dict[str, float]
    memory_bytes: float
    devices_per_host: int
    intra_host_bandwidth: float
    inter_host_bandwidth: float
    intra_host_latency_s: float
    inter_host_latency_s: float
    overlaps_collectives: bool
    source: str
    write_bandwidth: float  # bytes per second one device's elementwise work writes (reading as much)
    collective_overhead_s: float = 0.0  # what every collective costs besides its ring steps (GPUs: in the steps)
    machine: dict | None = None
    memory_bandwidth: float = 0.0  # the datasheet's HBM bytes per second (GPUs; 0 where not given)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _gpu(name: str, bf16_tflops: float, tf32_tflops: float, memory_gb: float, hbm_tbs: float, nvlink_gbs: float,
         nic_gbs: float, source: str) -> Hardware:
    peak = {"bfloat16": bf16_tflops * 1e12, "float16": bf16_tflops * 1e12, "float32": tf32_tflops * 1e12}
    return Hardware(name, peak, memory_gb * GB, 8, nvlink_gbs * GB, nic_gbs * GB, 5e-6, 10e-6, True, source,
                    hbm_tbs * 1e12 / 2, memory_bandwidth=hbm_tbs * 1e12)


GPU_PROFILES = {
    "h100": _gpu("h100", 989, 495, 80, 3.35, 450, 50,
                 "NVIDIA H100 SXM5 datasheet; DGX H100 (8 GPUs, 400 Gb/s per GPU)"),
    "h200": _gpu("h200", 989, 495, 141, 4.8, 450, 50,
                 "NVIDIA H200 SXM datasheet; HGX H200 (8 GPUs, 400 Gb/s per GPU)"),
    "b200": _gpu("b200", 2250, 1100, 180, 8.0, 900, 50,
                 "NVIDIA HGX B200 datasheet (dense); DGX B200 (8 GPUs, 400 Gb/s per GPU)"),
    "a100": _gpu("a100", 312, 156, 80, 2.039, 300, 25,
                 "NVIDIA A100 80GB SXM4 datasheet; DGX A100 (8 GPUs, 200 Gb/s per GPU)"),
}
PROFILES = (*GPU_PROFILES, "cpu")
# device_kind substrings of the GPUs that have a profile, most specific first ("H100 PCIe" has less)
_KINDS = (("H200", "h200"), ("H100 PCIe", None), ("H100", "h100"), ("B200", "b200"), ("A100", "a100"))


def for_device_kind(kind: str) -> str | None:
    """The profile of a device_kind such as 'NVIDIA H100 80GB HBM3', or None without one."""
    return next((name for sub, name in _KINDS if sub in kind), None)
