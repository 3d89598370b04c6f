"""GPUs to compile for without one: XLA:GPU's target configs for H100 and H200, and their devices.

The CUDA plugin's compiler runs on a machine with no GPU and no CUDA driver: with jax limited to the
CPU (JAX_PLATFORMS=cpu skips the plugin's driver check), `jax.experimental.topologies` makes abstract
GPU devices from a target config (stream_executor's GpuTargetConfigProto in text form), and a jit
sharded over them lowers and compiles to XLA:GPU's program, whose memory_analysis() and HLO the plan
reads. Nothing runs. The plugin (jax-cuda12-plugin and jax-cuda12-pjrt, about 470 MB) is the optional
extra `jaxpar[gpu-plan]`; it needs none of the nvidia-* wheels to compile.

Each target's figures come from NVIDIA's documents, cited beside them:
  * H100 SXM5 80 GB and H200 SXM 141 GB datasheets (nvidia.com/en-us/data-center/h100, /h200): the
    memory size and bandwidth;
  * the NVIDIA H100 Tensor Core GPU Architecture whitepaper (GH100, both GPUs' chip): 132 SMs in the
    SXM5 product, 128 FP32 cores per SM, 50 MB of L2, 1,980 MHz maximum SM clock;
  * the CUDA C++ Programming Guide's table of compute capability 9.0: 228 KB of shared memory per SM, at
    most 227 KB per block (48 KB without opting in), 64K 32-bit registers per SM and per block, 2,048
    threads per SM, 1,024 per block, block dimensions (1024, 1024, 64), grid (2^31 - 1, 65535, 65535);
  * the cuDNN version: the least that jax-cuda12-plugin 0.12.0.1 accepts (its with-cuda extra asks for
    nvidia-cudnn-cu12>=9.10.2.21).
The field names and layout follow XLA's own specs (openxla/xla, xla/backends/gpu/target_config/specs/).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import jax
from jax.experimental import topologies

from jaxpar.config import ConfigError

PLUGIN_MODULE = "jax_plugins.xla_cuda12"
INSTALL = ("pip install 'jaxpar[gpu-plan]' (or: pip install --no-deps jax-cuda12-plugin==0.12.0.1 "
           "jax-cuda12-pjrt==0.12.0.1)")
DEVICES_PER_HOST = 8  # an HGX/DGX H100 or H200 node
CUDNN_VERSION = (9, 10, 2)


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """One kind of GPU as XLA:GPU's compiler sees it (figures and sources: the module's docstring)."""

    name: str
    device_kind: str  # what the device calls itself (nvidia-smi's name), and jax's device_kind
    memory_bytes: int
    memory_bandwidth: int  # bytes per second
    sms: int = 132
    fp32_cores_per_sm: int = 128
    clock_ghz: float = 1.98
    l2_bytes: int = 50 * 2 ** 20
    compute_capability: tuple[int, int] = (9, 0)
    source: str = ""

    def config_text(self) -> str:
        """The GpuTargetConfigProto, in text form, that the CUDA plugin compiles for."""
        major, minor = self.compute_capability
        return f"""gpu_device_info {{
  cuda_compute_capability {{ major: {major} minor: {minor} feature_extension: ACCELERATED_FEATURES }}
  core_count: {self.sms}
  fpus_per_core: {self.fp32_cores_per_sm}
  clock_rate_ghz: {self.clock_ghz}
  device_memory_size: {self.memory_bytes}
  memory_bandwidth: {self.memory_bandwidth}
  l2_cache_size: {self.l2_bytes}
  shared_memory_per_core: {228 * 1024}
  shared_memory_per_block: {48 * 1024}
  shared_memory_per_block_optin: {227 * 1024}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  threads_per_core_limit: 2048
  threads_per_block_limit: 1024
  threads_per_warp: 32
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
}}
platform_name: "CUDA"
dnn_version_info {{ major: {CUDNN_VERSION[0]} minor: {CUDNN_VERSION[1]} patch: {CUDNN_VERSION[2]} }}
device_description_str: "{self.device_kind}"
"""


TARGETS = {
    "h100": GpuTarget("h100", "NVIDIA H100 80GB HBM3", 80 * 10 ** 9, 3_350 * 10 ** 9,
                      source="H100 SXM5 80 GB: 3.35 TB/s HBM3 (datasheet); GH100 whitepaper"),
    "h200": GpuTarget("h200", "NVIDIA H200", 141 * 10 ** 9, 4_800 * 10 ** 9,
                      source="H200 SXM 141 GB: 4.8 TB/s HBM3e (datasheet); GH100 whitepaper"),
}


def add_target_flag(parser) -> None:
    """`plan --target NAME`."""
    parser.add_argument("--target", choices=TARGETS,
                        help="also compile the step with XLA:GPU for one host of these GPUs, here, without a GPU "
                             "(needs jaxpar[gpu-plan]), and report its memory and collectives beside XLA:CPU's")


def use_cpu_only() -> None:
    """Keep jax on the CPU (before its backends start): the plugin's compiler needs no driver there, and the
    XLA:CPU plan beside it runs on emulated devices."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    jax.config.update("jax_platforms", "cpu")


def check_plugin() -> None:
    """Raise ConfigError, naming the pip command, unless the CUDA plugin is installed."""
    try:
        found = importlib.util.find_spec(PLUGIN_MODULE) is not None
    except ModuleNotFoundError:  # no jax_plugins package at all
        found = False
    if not found:
        raise ConfigError(f"plan --target compiles with XLA:GPU, which needs the CUDA plugin (no GPU or CUDA "
                          f"libraries): {INSTALL}.")


def gpu_devices(name: str, count: int = DEVICES_PER_HOST) -> list:
    """`count` abstract GPUs of target `name` on one host, to compile for (nothing can run on them)."""
    check_plugin()
    if not 1 <= count <= DEVICES_PER_HOST:
        raise ConfigError(f"plan --target compiles for one host of at most {DEVICES_PER_HOST} GPUs for now, but "
                          f"the layout needs {count}; set run.devices (or the mesh) to {DEVICES_PER_HOST} or fewer.")
    target = TARGETS[name]
    try:
        topology = topologies.get_topology_desc(name, "cuda", target_config=target.config_text(),
                                                topology=f"1x1x{count}")
    except (RuntimeError, ValueError) as e:  # jaxlib's errors are RuntimeErrors (XlaRuntimeError)
        raise ConfigError(f"the CUDA plugin could not describe {count} {target.device_kind} devices: "
                          f"{str(e).splitlines()[0]}") from e
    return list(topology.devices)
