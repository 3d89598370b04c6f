"""Every check of a config (against the device count, and run.devices against the devices found),
before anything is compiled; the flags of `jaxpar schedule` and `jaxpar launch` are checked in
jaxpar.config.command_flags.

Every failure is a ConfigError with one sentence saying what to change. Pure Python (no jax).
"""

from __future__ import annotations

import math

from jaxpar.config import MESH_AXES, Config, ConfigError, MeshConfig, loss_chunks, precision
from jaxpar.config.switches import ZeroStage, not_with_local_sgd
from jaxpar.data.sources import parse_mixture

MAX_SEED = 2 ** 63 - 1  # numpy wants a non-negative seed, jax one that fits in 64 bits
MAX_HEARTBEAT_S = 86_400  # the distributed runtime takes whole seconds in a C int


def requested_devices(cfg: Config) -> int | None:
    """The device count asked for by run.devices, or None for 'auto'."""
    value = cfg.run.devices
    if value == "auto":
        return None
    if isinstance(value, int) and value > 0:
        return value
    raise ConfigError(f"run.devices must be 'auto' or a positive number, got {value!r}.")


def check_device_count(wanted: int | None, available: int, platform: str, processes: int) -> None:
    """Raise ConfigError unless run.devices (`wanted`, None for auto) fits the devices found: a
    multi-process run uses all of them, a single process at most as many as exist."""
    if processes > 1:
        if wanted is not None and wanted != available:
            raise ConfigError(f"run.devices={wanted} but a multi-process run uses all {available} devices of its "
                              f"{processes} processes; leave run.devices=auto.")
    elif wanted is not None and wanted > available:
        raise ConfigError(f"run.devices={wanted} but only {available} {platform} devices exist.")


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


def _validate_pipeline(cfg: Config, sizes: dict[str, int]) -> None:
    p, S, L = cfg.parallel.pipeline, sizes["stage"], cfg.model.n_layers
    if p.microbatches <= 0 or p.virtual <= 0:
        raise ConfigError("parallel.pipeline.microbatches and parallel.pipeline.virtual must be positive.")
    if p.virtual > 1 and p.schedule != "interleaved":
        raise ConfigError(f"parallel.pipeline.virtual={p.virtual} needs parallel.pipeline.schedule=interleaved.")
    if S == 1:
        return
    v = p.virtual if p.schedule == "interleaved" else 2 if p.schedule == "zbv" else 1
    if p.schedule == "zbv" and L % (2 * S):
        raise ConfigError(f"the zbv schedule runs two chunks of layers on each stage: model.n_layers={L} is not "
                          f"divisible by 2 x mesh.stage = {2 * S}.")
    if L % (S * v):
        raise ConfigError(f"model.n_layers={L} is not divisible by mesh.stage x virtual stages = {S} x {v}.")
    moe = cfg.model.moe
    if moe.experts and moe.every > 0 and (L // moe.every) % (S * v):
        raise ConfigError(f"the {L // moe.every} units of model.moe.every={moe.every} layers are not divisible by "
                          f"mesh.stage x virtual stages = {S} x {v}.")
    if p.schedule in ("zb-h1", "zbv") and p.recompute:
        raise ConfigError(f"parallel.pipeline.recompute=true is for 1F1B-type schedules; {p.schedule} keeps the "
                          "forward's residuals for its split backward (train.remat keeps fewer).")
    if p.schedule in ("1f1b", "2bw", "interleaved", "zb-h1", "zbv") and p.microbatches < S:
        raise ConfigError(f"the {p.schedule} schedule needs at least as many microbatches as stages, "
                          f"got parallel.pipeline.microbatches={p.microbatches} < mesh.stage={S}.")
    if p.schedule == "interleaved" and p.microbatches % S:
        raise ConfigError(f"interleaved 1F1B needs parallel.pipeline.microbatches={p.microbatches} to be a "
                          f"multiple of mesh.stage={S}.")
    if cfg.train.grad_accum > 1:
        raise ConfigError("with mesh.stage > 1, use parallel.pipeline.microbatches instead of train.grad_accum.")
    ways = sizes["data"] * sizes["expert"] * p.microbatches
    if cfg.train.batch_size % ways:
        raise ConfigError(f"train.batch_size={cfg.train.batch_size} is not divisible by mesh.data x mesh.expert x "
                          f"parallel.pipeline.microbatches = {sizes['data']} x {sizes['expert']} x {p.microbatches}.")
    if ZeroStage(cfg.parallel.zero).slices_replicated_weights and v > 1:
        raise ConfigError(f"parallel.zero=2 with {'interleaved stages' if p.schedule == 'interleaved' else 'zbv'} "
                          f"is not supported; use zero 1 or 3.")


def _validate_rope(m) -> None:
    if m.rope_scaling == "none":
        return
    if m.positions != "rope":
        raise ConfigError(f"model.rope_scaling={m.rope_scaling} needs model.positions=rope.")
    if m.rope_factor <= 0:
        raise ConfigError(f"model.rope_factor must be positive, got {m.rope_factor}.")
    if m.rope_scaling == "llama3" and not (0 < m.rope_low_freq_factor < m.rope_high_freq_factor
                                           and m.rope_original_context > 0):
        raise ConfigError("llama3 rope scaling needs 0 < model.rope_low_freq_factor < model.rope_high_freq_factor "
                          "and a positive model.rope_original_context.")


def _validate_attention(cfg: Config, sizes: dict[str, int]) -> None:
    m, tensor = cfg.model, sizes["tensor"]
    if m.n_kv_heads < 0 or m.n_kv_heads > m.n_heads or (m.n_kv_heads and m.n_heads % m.n_kv_heads):
        raise ConfigError(f"model.n_kv_heads={m.n_kv_heads} must divide model.n_heads={m.n_heads} "
                          f"(0: as many as n_heads).")
    if m.rope_theta <= 0 or m.norm_eps <= 0:
        raise ConfigError("model.rope_theta and model.norm_eps must be positive.")
    if m.flash_block_q <= 0 or m.flash_block_kv <= 0:
        raise ConfigError("model.flash_block_q and model.flash_block_kv must be positive.")
    if m.attention in ("flash", "auto"):
        for key, block in zip(("flash_block_q", "flash_block_kv"), m.flash_blocks()):
            if m.seq_len % block:
                raise ConfigError(f"model.{key}={block} does not divide model.seq_len={m.seq_len}.")
    if m.attention == "cudnn" and not precision.of(cfg).reduced:
        raise ConfigError("model.attention=cudnn needs train.precision=bf16 or fp16 (cuDNN's fused attention "
                          "has no fp32 kernel); use flash or dot for fp32.")
    if cfg.parallel.sequence and tensor > 1 and m.kv_heads % tensor:
        raise ConfigError(f"parallel.sequence=true needs the {m.kv_heads} key/value heads (model.n_kv_heads) to be "
                          f"divisible by mesh.tensor={tensor}.")
    if cfg.parallel.sequence and m.seq_len % (tensor * sizes["context"]):
        across = f" x mesh.context={sizes['context']}" if sizes["context"] > 1 else ""
        raise ConfigError(f"parallel.sequence=true splits model.seq_len={m.seq_len} over mesh.tensor={tensor}{across}, "
                          f"which does not divide it.")
    _validate_context(cfg, sizes)


def _validate_context(cfg: Config, sizes: dict[str, int]) -> None:
    m, p, context = cfg.model, cfg.parallel, sizes["context"]
    chunks = 2 * context if p.context_balance else context
    if context > 1 and sizes["stage"] > 1 and (p.context_attention == "ring" or not p.context_balance
                                               or sizes["tensor"] > 1):  # in a stage's branch: XLA hangs or aborts
        raise ConfigError("mesh.context with pipeline stages runs only with parallel.context_attention=allgather, "
                          "parallel.context_balance=true and mesh.tensor=1.")
    if context > 1 and m.moe.experts and p.context_balance:
        raise ConfigError("MoE routing groups take consecutive tokens, which balanced context parallelism reorders; "
                          "set parallel.context_balance=false with model.moe.experts.")
    if context > 1 and m.seq_len % chunks:
        raise ConfigError(f"mesh.context={context} cuts model.seq_len={m.seq_len} into {chunks} chunks"
                          f"{' (balanced: 2 x context)' if p.context_balance else ''}, which do not divide it.")
    if context > 1 and m.attention == "cudnn":
        raise ConfigError(f"model.attention=cudnn cannot run across mesh.context={context}: cuDNN's kernel takes "
                          f"whole sequences; use flash or dot, which jaxpar's context attention runs per block.")


def _validate_offload_and_local_sgd(cfg: Config, sizes: dict[str, int]) -> None:
    t, p = cfg.train, cfg.parallel
    if t.offloads_activations and t.remat == "sqrt":
        raise ConfigError("train.offload=activations offloads each layer's input, but train.remat=sqrt keeps segment "
                          "inputs instead; use train.remat none, full or dots with it.")
    if t.offloads_activations and sizes["stage"] > 1:
        raise ConfigError("train.offload=activations does not combine with mesh.stage > 1 yet (a pipeline keeps its "
                          "microbatches' activations itself; see parallel.pipeline.recompute); use "
                          "train.offload=optimizer there.")
    if p.sync_every < 1:
        raise ConfigError(f"parallel.sync_every must be 1 (synchronous) or more, got {p.sync_every}.")
    if p.outer_lr <= 0 or not 0 <= p.outer_momentum < 1:
        raise ConfigError("parallel.outer_lr must be positive and parallel.outer_momentum in [0, 1).")
    if p.sync_every == 1:
        return
    if sizes["data"] == 1:
        raise ConfigError(f"parallel.sync_every={p.sync_every} (local SGD) needs data-parallel replicas: "
                          "mesh.data > 1.")
    clash = not_with_local_sgd(cfg, sizes) + (["model.moe.experts"] if cfg.model.moe.experts > 0 else [])
    if clash:
        raise ConfigError(f"parallel.sync_every={p.sync_every} (local SGD: whole replicas over mesh.data, tensor "
                          f"parallelism inside each) does not combine with {', '.join(clash)}; leave "
                          f"{'it' if len(clash) == 1 else 'them'} at the default.")


def check_model_fits(block_model: bool, model_name: str, cfg: Config, sizes: dict[str, int]) -> None:
    """What a model without the block protocol (jaxpar.model.protocol: embed, run_blocks and logits
    around stacked layers) cannot do: anything that needs its layers one by one, or its logits from
    its last hidden states (train.loss_chunks)."""
    if block_model:
        return
    per_layer = {"mesh.stage > 1": sizes["stage"] > 1, f"train.remat={cfg.train.remat}": cfg.train.remat != "none",
                 f"train.offload={cfg.train.offload}": cfg.train.offloads_activations,
                 f"train.loss_chunks={cfg.train.loss_chunks}": cfg.train.loss_chunks != 1}
    asked = [key for key, on in per_layer.items() if on]
    if asked:
        raise ConfigError(f"{' and '.join(asked)} need{'s' if len(asked) == 1 else ''} the model's layers one by one "
                          f"and its logits apart, but {model_name} does not implement jaxpar's block protocol "
                          f"(STACKED_AT, embed, run_blocks, logits, stacked_layers: jaxpar.model.protocol).")


def check_attention_platform(cfg: Config, platform: str) -> None:
    """model.attention=cudnn runs on NVIDIA GPUs only."""
    if cfg.model.attention == "cudnn" and platform != "gpu":
        raise ConfigError(f"model.attention=cudnn needs an NVIDIA GPU, but the devices are {platform}; "
                          f"use flash (or auto, which picks cudnn where it runs).")


def _validate_moe(cfg: Config, sizes: dict[str, int]) -> None:
    moe, m = cfg.model.moe, cfg.model
    if moe.experts < 0:
        raise ConfigError(f"model.moe.experts must be 0 (dense) or positive, got {moe.experts}.")
    if moe.experts == 0:
        return  # a dense model uses the expert axis as extra data parallelism
    if moe.experts % sizes["expert"]:
        raise ConfigError(f"model.moe.experts={moe.experts} is not divisible by mesh.expert={sizes['expert']}.")
    if moe.every <= 0 or m.n_layers % moe.every:
        raise ConfigError(f"model.n_layers={m.n_layers} is not divisible by model.moe.every={moe.every}.")
    if moe.chooses_top_k and not 0 < moe.top_k <= moe.experts:
        raise ConfigError(f"model.moe.top_k={moe.top_k} must be between 1 and model.moe.experts={moe.experts}.")
    if moe.capacity_factor <= 0:
        raise ConfigError(f"model.moe.capacity_factor must be positive, got {moe.capacity_factor}.")
    _validate_expert_shape(moe, m, sizes["tensor"])
    tokens = routed_tokens_per_device(cfg, sizes)
    if moe.group_size < 0 or (moe.group_size and tokens % moe.group_size):
        raise ConfigError(f"model.moe.group_size={moe.group_size} does not divide the {tokens} tokens per device "
                          "(train.batch_size / (data x expert x microbatches) x model.seq_len, microbatches being "
                          "train.grad_accum or parallel.pipeline.microbatches); leave it 0 to fit.")


def _validate_expert_shape(moe, m, tensor: int) -> None:
    """Expert widths and the router options that only top-k takes."""
    for key in ("d_ff", "shared"):
        if getattr(moe, key) < 0:
            raise ConfigError(f"model.moe.{key} must be 0 or positive, got {getattr(moe, key)}.")
    for key in ("routed_scale", "bias_rate"):
        if not getattr(moe, key) > 0:
            raise ConfigError(f"model.moe.{key} must be positive, got {getattr(moe, key)}.")
    if m.expert_d_ff % tensor:
        raise ConfigError(f"the experts' width {m.expert_d_ff} (model.moe.d_ff, or model.d_ff when 0) is not "
                          f"divisible by mesh.tensor={tensor}.")
    topk_only = {"score": moe.score != "softmax", "renormalize": not moe.renormalize, "balance": moe.balance != "aux"}
    chosen = [f"model.moe.{key}={getattr(moe, key)}" for key, set_ in topk_only.items() if set_]
    if chosen and not moe.chooses_top_k:
        raise ConfigError(f"{chosen[0]} needs model.moe.router=topk or dropless, but the router is {moe.router} "
                          f"(Switch picks one expert by softmax, and Expert Choice fills every expert exactly).")


MAX_AUTO_GROUP = 256


def routed_tokens_per_device(cfg: Config, sizes: dict[str, int]) -> int:
    """Tokens one device routes at a time: its share of the batch (of one accumulation or pipeline
    microbatch)."""
    t = cfg.train
    microbatches = cfg.parallel.pipeline.microbatches if sizes["stage"] > 1 else t.grad_accum
    return t.batch_size // (sizes["data"] * sizes["expert"] * microbatches) * cfg.model.seq_len


def _validate_loss_chunks(cfg: Config, sizes: dict[str, int]) -> None:
    chunks, seq_len, split = cfg.train.loss_chunks, cfg.model.seq_len, loss_chunks.sequence_split(cfg, sizes)
    if chunks < 0 or (chunks and not loss_chunks.fits(chunks, seq_len, split)):
        tensor = f" into chunks divisible by mesh.tensor={split} (sequence parallelism)" if split > 1 else ""
        raise ConfigError(f"train.loss_chunks={chunks} must be 0 (automatic) or divide model.seq_len={seq_len}"
                          f"{tensor}.")


def with_derived(cfg: Config, sizes: dict[str, int]) -> Config:
    """The config with its automatic values filled in for this mesh: train.loss_chunks=0 becomes
    jaxpar.config.loss_chunks.automatic's count; model.moe.group_size=0 becomes the largest divisor of the
    tokens per device up to 256. Routing groups are then consecutive tokens of the global batch,
    the same on every layout that shares the value (verify's single-device reference takes it from
    the layout)."""
    if not cfg.train.loss_chunks:
        chunks = loss_chunks.automatic(cfg, sizes, routed_tokens_per_device(cfg, sizes))
        cfg = cfg.replace(**{"train.loss_chunks": chunks})
    moe = cfg.model.moe
    if not moe.experts or moe.group_size:
        return cfg
    tokens = routed_tokens_per_device(cfg, sizes)
    size = max(d for d in range(1, min(tokens, MAX_AUTO_GROUP) + 1) if tokens % d == 0)
    return cfg.replace(**{"model.moe.group_size": size})


def _validate_model_shape(m, tensor: int) -> None:
    for key in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "seq_len", "vocab_multiple"):
        if getattr(m, key) <= 0:
            raise ConfigError(f"model.{key} must be positive, got {getattr(m, key)}.")
    if m.head_dim < 0:
        raise ConfigError(f"model.head_dim must be 0 (d_model / n_heads) or positive, got {m.head_dim}.")
    if not m.head_dim and m.d_model % m.n_heads:
        raise ConfigError(f"model.d_model={m.d_model} is not divisible by model.n_heads={m.n_heads}; "
                          f"set model.head_dim to give the heads their own width.")
    if m.positions == "rope" and m.head_size % 2:
        raise ConfigError(f"rotary positions need an even head size, but it is {m.head_size} "
                          f"(model.head_dim, or model.d_model / model.n_heads).")
    for key in ("n_heads", "d_ff"):
        if getattr(m, key) % tensor:
            raise ConfigError(f"model.{key}={getattr(m, key)} is not divisible by mesh.tensor={tensor}.")
    if m.padded_vocab % tensor:
        padded = ("" if m.vocab_multiple == 1
                  else f" (padded to {m.padded_vocab} by model.vocab_multiple={m.vocab_multiple})")
        raise ConfigError(f"model.vocab_size={m.vocab_size}{padded} is not divisible by mesh.tensor={tensor}; pad it "
                          f"with model.vocab_multiple={tensor} (the padded rows never win, and export drops them).")
    _validate_rope(m)


def _validate_train_numbers(t, sizes: dict[str, int]) -> None:
    for key in ("steps", "batch_size", "grad_accum", "log_every", "eval_batches"):
        if getattr(t, key) <= 0:
            raise ConfigError(f"train.{key} must be positive, got {getattr(t, key)}.")
    if t.eval_every < 0:
        raise ConfigError(f"train.eval_every must be 0 (at the end only) or positive, got {t.eval_every}.")
    if t.sample_tokens < 0:
        raise ConfigError(f"train.sample_tokens must be 0 (no sample) or more, got {t.sample_tokens}.")
    if t.lr <= 0 or t.warmup < 0 or t.clip_norm <= 0 or t.weight_decay < 0:
        raise ConfigError("train.lr and train.clip_norm must be positive, train.warmup and train.weight_decay "
                          "non-negative.")
    batch_ways = sizes["data"] * sizes["expert"] * t.grad_accum
    if t.batch_size % batch_ways:
        raise ConfigError(
            f"train.batch_size={t.batch_size} is not divisible by mesh.data x mesh.expert x train.grad_accum"
            f" = {sizes['data']} x {sizes['expert']} x {t.grad_accum}.")


def _validate_run_numbers(cfg: Config) -> None:
    t = cfg.train
    if not 0 <= t.seed <= MAX_SEED:
        raise ConfigError(f"train.seed must be between 0 and 2**63 - 1, got {t.seed}.")
    if t.lr_schedule_steps < 0:
        raise ConfigError(f"train.lr_schedule_steps must be 0 (follow train.steps) or positive, "
                          f"got {t.lr_schedule_steps}.")
    if min(cfg.checkpoint.every, cfg.checkpoint.local_every) < 0 or cfg.checkpoint.keep <= 0:
        raise ConfigError("checkpoint.every and checkpoint.local_every must be 0 (off) or positive, and "
                          "checkpoint.keep positive.")
    if t.loss_scale_window <= 0:
        raise ConfigError(f"train.loss_scale_window must be positive, got {t.loss_scale_window}.")
    if not 0 < cfg.data.val_fraction < 1:
        raise ConfigError(f"data.val_fraction must be between 0 and 1, got {cfg.data.val_fraction}.")
    _validate_mixture(cfg.data)


def _validate_mixture(data) -> None:
    if not parse_mixture(data.mixture):
        return
    if data.packing == "none":
        raise ConfigError("data.mixture mixes documents from tokenized folders; set data.packing=pack (or concat).")
    if data.source != "builtin":
        raise ConfigError(f"data.mixture takes the place of data.source; leave data.source unset, not "
                          f"{data.source!r}.")


def validate(cfg: Config, n_devices: int, processes: int = 1) -> tuple[dict[str, int], dict[str, int]]:
    """Check every cross-field constraint before anything is compiled; return the mesh sizes
    and how many processes each axis spans (host_split)."""
    sizes = resolve_mesh(cfg.mesh, n_devices)
    split = host_split(sizes, cfg.mesh, processes)
    if not 0 < cfg.run.heartbeat_timeout <= MAX_HEARTBEAT_S:
        raise ConfigError(f"run.heartbeat_timeout must be positive and at most {MAX_HEARTBEAT_S} seconds, "
                          f"got {cfg.run.heartbeat_timeout}.")
    for key, path in (("data.source", cfg.data.source), ("run.dir", cfg.run.dir)):
        if not path.strip() or not path.isprintable():
            raise ConfigError(f"{key} must be a non-empty path without control characters, got {path!r}.")
    _validate_model_shape(cfg.model, sizes["tensor"])
    _validate_attention(cfg, sizes)
    _validate_train_numbers(cfg.train, sizes)
    _validate_loss_chunks(cfg, sizes)
    _validate_pipeline(cfg, sizes)
    _validate_moe(cfg, sizes)
    _validate_offload_and_local_sgd(cfg, sizes)
    _validate_run_numbers(cfg)
    return sizes, split
