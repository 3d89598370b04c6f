"""GPUs to compile for without one: XLA:GPU's target configs for H100, H200 and B200, and their devices.

The CUDA plugin's compiler runs on a machine with no GPU and no CUDA driver: with jax limited to the
CPU (JAX_PLATFORMS=cpu skips the plugin's driver check), `jax.experimental.topologies` makes abstract
GPU devices from a target config (stream_executor's GpuTargetConfigProto in text form) and a topology
"<slices>x<hosts>x<GPUs per host>" (the plugin's; here 1 x hosts x 8, each host a process of its own),
and a jit sharded over them lowers and compiles to XLA:GPU's program, whose memory_analysis() and HLO
the plan reads. Nothing runs. The plugin (jax-cuda12-plugin and jax-cuda12-pjrt, about 470 MB) is the
optional extra `jaxpar[gpu-plan]`; it needs none of the nvidia-* wheels to compile.

Each target's figures come from NVIDIA's documents, cited beside them; the memory size and bandwidth are
the datasheet profiles' of jaxpar.runtime.hardware (the roofline's, so the two never disagree):
  * the NVIDIA H100 Tensor Core GPU Architecture whitepaper (GH100, both GPUs' chip): 132 SMs in the
    SXM5 product, 128 FP32 cores per SM, 50 MB of L2, 1,980 MHz maximum SM clock;
  * B200: the DGX B200 user guide (docs.nvidia.com/dgx/dgxb200-user-guide: 8 B200 GPUs with 1,440 GB
    in all, 180 GB each) and NVIDIA's Blackwell datasheet (8 TB/s of HBM3e per GPU); compute capability
    10.0 (CUDA programming guide), 148 SMs of 128 FP32 cores, a 1,965 MHz SM clock and 132,644,864 bytes
    (126.5 MiB) of L2 as the CUDA driver reports them on a B200 (XLA's own spec of the GPU,
    openxla/xla xla/backends/gpu/target_config/specs/b200.txtpb);
  * the CUDA C++ Programming Guide's tables of compute capabilities 9.0 and 10.0 (alike here): 228 KB of
    shared memory per SM, at most 227 KB per block (48 KB without opting in), 64K 32-bit registers per
    SM and per block, 2,048 threads per SM, 1,024 per block, block dimensions (1024, 1024, 64), grid
    (2^31 - 1, 65535, 65535);
  * the CUDA runtime, toolkit and cuDNN versions: those jax-cuda12-plugin 0.12.0.1 was built with
    (jax_cuda12_plugin._versions: cuda_runtime_build_version() 12090, cudnn_build_version() 91002); a GPU
    host reports its installed libraries', these or newer. XLA:GPU reads them: without a runtime version
    it assumes none and gives up cuBLASLt's fp8 GEMMs (an f8 dot is converted to f16 first).
The field names and layout follow XLA's own specs (openxla/xla, xla/backends/gpu/target_config/specs/).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os

import jax
from jax.experimental import topologies

from jaxpar.config import MESH_AXES, Config, ConfigError
from jaxpar.runtime.hardware import GPU_PROFILES

PLUGIN_MODULE = "jax_plugins.xla_cuda12"
INSTALL = ("pip install 'jaxpar[gpu-plan]' (or: pip install --no-deps jax-cuda12-plugin==0.12.0.1 "
           "jax-cuda12-pjrt==0.12.0.1)")
DEVICES_PER_HOST = 8  # an HGX/DGX H100, H200 or B200 node
MAX_HOSTS = 32  # the XLA:CPU plan beside it emulates every GPU as a CPU device in one process
CUDA_RUNTIME = (12, 9, 0)
CUDNN_VERSION = (9, 10, 2)


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """One kind of GPU as XLA:GPU's compiler sees it (figures and sources: the module's docstring)."""

    name: str  # also its datasheet profile's (jaxpar.runtime.hardware.GPU_PROFILES): memory size and bandwidth
    device_kind: str  # what the device calls itself (nvidia-smi's name), and jax's device_kind
    sms: int = 132
    fp32_cores_per_sm: int = 128
    clock_ghz: float = 1.98
    l2_bytes: int = 50 * 2 ** 20
    compute_capability: tuple[int, int] = (9, 0)
    source: str = ""

    @property
    def memory_bytes(self) -> int:
        return round(GPU_PROFILES[self.name].memory_bytes)

    @property
    def memory_bandwidth(self) -> int:
        """HBM bytes per second."""
        return round(GPU_PROFILES[self.name].memory_bandwidth)

    def config_text(self) -> str:
        """The GpuTargetConfigProto, in text form, that the CUDA plugin compiles for."""
        major, minor = self.compute_capability
        runtime, dnn = ".".join(map(str, CUDA_RUNTIME)), ".".join(map(str, CUDNN_VERSION))
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
  runtime_version: "{runtime}"
  compile_time_toolkit_version: "{runtime}"
  dnn_version: "{dnn}"
}}
platform_name: "CUDA"
dnn_version_info {{ major: {CUDNN_VERSION[0]} minor: {CUDNN_VERSION[1]} patch: {CUDNN_VERSION[2]} }}
device_description_str: "{self.device_kind}"
"""


TARGETS = {
    "h100": GpuTarget("h100", "NVIDIA H100 80GB HBM3",
                      source="H100 SXM5 80 GB: 3.35 TB/s HBM3 (datasheet); GH100 whitepaper"),
    "h200": GpuTarget("h200", "NVIDIA H200",
                      source="H200 SXM 141 GB: 4.8 TB/s HBM3e (datasheet); GH100 whitepaper"),
    "b200": GpuTarget("b200", "NVIDIA B200", sms=148, clock_ghz=1.965,
                      l2_bytes=132_644_864, compute_capability=(10, 0),
                      source="B200 180 GB: 8 TB/s HBM3e (DGX B200 user guide, Blackwell datasheet); "
                             "148 SMs, 126.5 MiB L2 (XLA's b200 spec)"),
}


def add_target_flags(parser) -> None:
    """`plan --target NAME [--hosts N]`."""
    parser.add_argument("--target", metavar="{" + ",".join(TARGETS) + "}",
                        help="also compile the step with XLA:GPU for these GPUs, here, without a GPU (needs "
                             "jaxpar[gpu-plan]), and report its memory, collectives and GEMMs beside XLA:CPU's; "
                             "with --search, rank the layouts on XLA:GPU's programs")
    parser.add_argument("--hosts", type=int, default=1,
                        help=f"with --target: compile for this many hosts of {DEVICES_PER_HOST} GPUs (default 1; "
                             f"the XLA:CPU plan beside it emulates as many devices)")


def check_target(name: str) -> None:
    """Raise ConfigError unless `name` is a target of TARGETS (checked before anything compiles)."""
    if name not in TARGETS:
        raise ConfigError(f"plan --target {name!r} is not a GPU jaxpar compiles for; choose one of "
                          f"{', '.join(TARGETS)}.")


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


def check_hosts(hosts: int) -> None:
    """Raise ConfigError unless `--hosts` is a count this plan can emulate."""
    if not 1 <= hosts <= MAX_HOSTS:
        raise ConfigError(f"--hosts must be 1 to {MAX_HOSTS} (hosts of {DEVICES_PER_HOST} GPUs; the XLA:CPU plan "
                          f"beside it emulates each GPU), got {hosts}.")


def devices_for(cfg: Config, hosts: int, mesh: bool = True) -> int | None:
    """The GPUs `hosts` hosts give cfg's layout: all 8 of each of several hosts (None for one host: as many as
    run.devices asks, 8 at most). Raises ConfigError, saying how to fix it, when run.devices or (with `mesh`;
    a search enumerates its own) the mesh axes ask for another count."""
    check_hosts(hosts)
    count = hosts * DEVICES_PER_HOST
    gpus = f"plan --target compiles for {count} GPUs ({hosts} host{'s' * (hosts > 1)} x {DEVICES_PER_HOST})"
    if hosts > 1 and cfg.run.devices not in ("auto", count):
        raise ConfigError(f"{gpus}, but run.devices={cfg.run.devices}; leave run.devices=auto.")
    sizes = {a: getattr(cfg.mesh, a) for a in MESH_AXES}
    fixed = math.prod(s for s in sizes.values() if s > 0)
    free = -1 in sizes.values()
    if not mesh:
        return count if hosts > 1 else None
    if (hosts > 1 and (count % fixed if free else fixed != count)) or (hosts == 1 and not free and fixed > count):
        named = ", ".join(f"mesh.{a}={s}" for a, s in sizes.items() if s > 1)
        fix = (f"add --hosts {-(-fixed // DEVICES_PER_HOST)}" if hosts == 1 and fixed % DEVICES_PER_HOST == 0
               else f"make them multiply to {count} (or set one to -1), or change --hosts")
        raise ConfigError(f"{gpus}, but the mesh axes ({named}) multiply to {fixed}; {fix}.")
    return count if hosts > 1 else None


def gpu_devices(name: str, count: int = DEVICES_PER_HOST, hosts: int = 1) -> list:
    """`count` abstract GPUs of target `name`: on one host (at most 8), or all 8 of each of `hosts` hosts
    (each host one process, as in a multi-host run). Nothing can run on them."""
    check_plugin()
    check_hosts(hosts)
    if hosts > 1 and count != hosts * DEVICES_PER_HOST:
        raise ConfigError(f"--hosts {hosts} compiles for {hosts * DEVICES_PER_HOST} GPUs, but the layout asks for "
                          f"{count}; leave run.devices=auto.")
    if not 1 <= count <= DEVICES_PER_HOST * hosts:
        raise ConfigError(f"one host has {DEVICES_PER_HOST} GPUs, but the layout needs {count}; add --hosts "
                          f"{-(-count // DEVICES_PER_HOST)} (and use all of their GPUs) or set run.devices to "
                          f"{DEVICES_PER_HOST} or fewer.")
    target = TARGETS[name]
    per_host = count if hosts == 1 else DEVICES_PER_HOST
    try:
        topology = topologies.get_topology_desc(name, "cuda", target_config=target.config_text(),
                                                topology=f"1x{hosts}x{per_host}")
    except (RuntimeError, ValueError) as e:  # jaxlib's errors are RuntimeErrors (XlaRuntimeError)
        raise ConfigError(f"the CUDA plugin could not describe {count} {target.device_kind} devices: "
                          f"{str(e).splitlines()[0]}") from e
    return list(topology.devices)
