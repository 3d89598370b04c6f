"""A catalog of injected faults: realistic bugs in layout-specific code, each applied to the layout side of a
verify only, which verify must catch in every precision where the faulty code runs.

A fault replaces one function, looked up by the module that calls it, with a broken version that is used only
while the layout's step is traced (the multi-device trainer's step and drain are armed); the single-device
reference runs the original. A target is 'module:function', or 'module:Class.method' (a property: its getter)
for code reached through an object. Each entry names the layout that runs the code it breaks, the precisions
it is judged in, and the area of layout-specific code it belongs to (AREAS: those the issue names; the other
areas are the second set's). A bug is written as a wrapper of the original where it can be (its inputs or its
result corrupted), so that it stays what a real slip would be: a block one place off, a sum lost or doubled.
tests/test_verify_faults.py runs them; benchmarks/verify_faults.py prints the table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import json
import math
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

ALL_PRECISIONS = ("fp32", "bf16", "fp8")
# A model small enough that a verify compiles in seconds: 2 layers of 4 heads of 8, 16 positions, 16 rows.
MODEL = ("model.d_model=32", "model.n_heads=4", "model.d_ff=64", "model.seq_len=16", "train.batch_size=16",
         "model.n_layers=2", "train.steps=3")
QUICK_LAYOUT = ("mesh.data=4", "mesh.tensor=2", "parallel.zero=3")
EXPERT_LAYOUT = ("mesh.data=2", "mesh.tensor=2", "mesh.expert=2", "model.moe.experts=4", "model.moe.every=1")

_armed = [False]  # whether the function calls being traced now are the layout's


def layout_only(original: Callable, faulty: Callable) -> Callable:
    """`original`, except while the layout's step is traced: `faulty`."""

    @functools.wraps(original)
    def either(*args, **kwargs):
        return (faulty if _armed[0] else original)(*args, **kwargs)

    return either


class _Armed:
    """A trainer's jitted step (or 2BW's window step), armed while it is called: a first call traces it."""

    def __init__(self, step):
        self._step = step

    def _armed_call(self, fn, *args, **kwargs):
        _armed[0] = True
        try:
            return fn(*args, **kwargs)
        finally:
            _armed[0] = False

    def __call__(self, *args, **kwargs):
        return self._armed_call(self._step, *args, **kwargs)

    def drain(self, state):
        return self._armed_call(self._step.drain, state)

    def __getattr__(self, name):
        return getattr(self._step, name)


@dataclasses.dataclass(frozen=True)
class Fault:
    """One bug: `target` ('module:function' or 'module:Class.method', as the calling code looks it up) replaced
    by `breaks(original)` on the layout side of a verify of `layout`, judged in `precisions`; `data` writes
    the data an objective needs (preference pairs, prompts, short documents) and gives the overrides naming it."""

    name: str
    what: str  # the bug, in a few words
    target: str
    breaks: Callable[[Callable], Callable]
    layout: tuple[str, ...] = QUICK_LAYOUT
    precisions: tuple[str, ...] = ALL_PRECISIONS
    quick: bool = False  # in the quick tier (fp32)
    area: str = "gradients"  # the layout-specific code it breaks (AREAS)
    # the data its objective trains on: data(folder) -> overrides, writing what they name into folder
    data: Callable[[Path], tuple[str, ...]] | None = None


@contextlib.contextmanager
def injected(fault: Fault):
    """The fault in place for the verifies run inside, on their layout side."""
    from jaxpar.train.trainer import Trainer

    module_name, attribute = fault.target.split(":")
    owner = importlib.import_module(module_name)
    *classes, attribute = attribute.split(".")  # 'module:Class.method' replaces a method on its class
    for name in classes:
        owner = getattr(owner, name)
    original, compile_steps = owner.__dict__[attribute], Trainer._compile_steps

    def armed_steps(self):
        step, eval_loss = compile_steps(self)
        return (_Armed(step) if self.mesh.size > 1 else step), eval_loss

    if isinstance(original, property):  # a property: its getter replaced
        replacement = property(layout_only(original.fget, fault.breaks(original.fget)))
    else:
        replacement = layout_only(original, fault.breaks(original))
    setattr(owner, attribute, replacement)
    Trainer._compile_steps = armed_steps
    try:
        yield
    finally:
        setattr(owner, attribute, original)
        Trainer._compile_steps = compile_steps


def overrides(fault: Fault, precision: str) -> list[str]:
    return [*MODEL, *fault.layout, f"train.precision={precision}"]


def run(fault: Fault, precision: str, run_dir) -> dict:
    """verify's result for the fault's layout in `precision`, with the fault injected on the layout side."""
    from jaxpar.config.presets import load_config
    from jaxpar.train.run_session import prepare
    from jaxpar.verify.run import verify

    data = () if fault.data is None else fault.data(Path(run_dir) / "data")
    session = prepare(load_config(None, [f"run.dir={run_dir}", *overrides(fault, precision), *data]))
    with injected(fault):
        result = verify(session, log=lambda line: None)
    return result


# ---------------------------------------------------------------- the ways a fault breaks a function


def _map_paths(tree, fn):
    """tree with fn(path string, leaf) on every array leaf (None leaves kept)."""
    from jaxpar.model.axes import path_names

    return jax.tree_util.tree_map_with_path(
        lambda p, x: x if x is None or not hasattr(x, "dtype") else fn("/".join(path_names(p)), x), tree)


def scaled_gradients(factor: float, where: Callable[[str], bool] = lambda path: True):
    """`gradients` (jaxpar.parallel.gradients) whose gradients of the tensors `where` selects are times factor."""

    def breaks(original):
        def faulty(*args, **kwargs):
            stats, grads = original(*args, **kwargs)
            return stats, _map_paths(grads, lambda path, g: g * factor if where(path) else g)
        return faulty

    return breaks


def summed_not_averaged(original):
    """_reduce (jaxpar.parallel.gradients) without its division by the batch shards: a sum where a mean belongs."""

    def faulty(layout, grad, path):
        reduced = original(layout, grad, path)
        value = reduced.get_value()
        return reduced if value is None else reduced.replace(value * layout.manual_batch_ways)

    return faulty


def reversed_near_ties(original):
    """The optimizer's update (jaxpar.train.step._updated) moved the other way for the elements whose Adam
    second moment is tiny for their tensor (2^-12 of its RMS root and below): a sign lost for small gradients."""

    def faulty(optimizer, state, grads, finite, layout, offloads):
        params, opt_state = original(optimizer, state, grads, finite, layout, offloads)
        nus = [nu for _, nu in optax.tree_utils.tree_get_all_with_path(opt_state, "nu")]
        if not nus:
            return params, opt_state

        def reverse(old, new, nu):
            if nu is None or old is None:
                return new
            tiny = (nu > 0) & (jnp.sqrt(nu) < 2.0 ** -12 * jnp.sqrt(jnp.mean(nu)))
            return jnp.where(tiny, 2 * old - new, new)

        return jax.tree.map(reverse, state.params, params, nus[0], is_leaf=lambda x: x is None), opt_state

    return faulty


def _is_norm(path: str) -> bool:
    return path.endswith("scale/value") and "norm" in path


def _is_qkv(path: str) -> bool:
    return "w_qkv" in path or "w_q/" in path or "w_kv" in path


# ---------------------------------------------------------------- layouts that run the code the faults break


def _pipeline(schedule: str, *extra: str) -> tuple[str, ...]:
    """Two stages of the schedule over data x tensor, 4 microbatches."""
    return ("mesh.data=2", "mesh.tensor=2", "mesh.stage=2", f"parallel.pipeline.schedule={schedule}",
            "parallel.pipeline.microbatches=4", *extra)


PIPELINE_LAYOUT = _pipeline("1f1b")
CONTEXT_LAYOUT = ("mesh.data=4", "mesh.context=2")  # ring attention, balanced chunks (the defaults)
SEQUENCE_LAYOUT = (*QUICK_LAYOUT, "parallel.sequence=true")
DROPLESS_LAYOUT = (*EXPERT_LAYOUT, "model.moe.router=dropless")


def _preference_data(folder: Path) -> tuple[str, ...]:
    """DPO's pairs (prompt + chosen, prompt + rejected) tokenized into `folder` once; the overrides that train on
    them (tests/test_preference_step.py's settings)."""
    from jaxpar.tokenize.document_readers import DocumentSpec
    from jaxpar.tokenize.folder import tokenize

    tokens = folder / "pairs"
    if not (tokens / "meta.json").exists():
        folder.mkdir(parents=True, exist_ok=True)
        words = ["".join(chr(97 + (7 * i + 3 * j) % 26) for j in range(3 + i % 5)) for i in range(96)]
        records = [{"prompt": f"key {words[i]} ->", "chosen": f" {words[32 + i]}.", "rejected": f" {words[64 + i]}!"}
                   for i in range(32)]
        (folder / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        tokenize([str(folder / "pairs.jsonl")], str(tokens), vocab_size=300, progress=False,
                 spec=DocumentSpec(preference=True, prompt="prompt", chosen="chosen", rejected="rejected"))
    return (f"data.source={tokens}", "data.packing=pack", "data.val_fraction=0.2", "model.vocab_size=300",
            "model.seq_len=48", "train.objective=dpo", "model.lora.rank=4", "model.mlp=swiglu")


def _short_documents(folder: Path) -> tuple[str, ...]:
    """Documents of a few words each (a .txt file per document), tokenized into `folder` once and packed
    several to a row: the rows hold document boundaries for segment masks to get wrong."""
    from jaxpar.tokenize.folder import tokenize

    tokens = folder / "short"
    if not (tokens / "meta.json").exists():
        texts = folder / "texts"
        texts.mkdir(parents=True, exist_ok=True)
        for i in range(400):
            words = ("".join(chr(97 + (5 * i + 3 * j + k) % 26) for k in range(3 + (i + j) % 4))
                     for j in range(2 + i % 3))
            (texts / f"{i:03d}.txt").write_text(" ".join(words) + ".")
        tokenize([str(texts)], str(tokens), vocab_size=300, progress=False)
    return (f"data.source={tokens}", "data.packing=pack", "data.val_fraction=0.1", "model.vocab_size=300")


def _grpo_prompts(folder: Path) -> tuple[str, ...]:
    """GRPO's prompts (tests/test_grpo_step.py's): completions of 8 tokens scored by length."""
    folder.mkdir(parents=True, exist_ok=True)
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"item {i} costs ", "answer": str(i)}) + "\n" for i in range(32)))
    return ("train.objective=grpo", f"data.source={prompts}", "model.seq_len=32", "rl.max_new_tokens=8",
            "rl.reward=length", "rl.target_length=5", "train.warmup=0", "train.sample_tokens=0")


# ---------------------------------------------------------------- the bugs, each wrapping the original


def _devices(axes) -> int:
    return math.prod(jax.lax.axis_size(a) for a in ((axes,) if isinstance(axes, str) else axes))


def _own_block(x: jax.Array, axes, dim: int) -> jax.Array:
    """This device's block of x along dim, split over `axes` (no communication)."""
    size = x.shape[dim] // _devices(axes)
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(axes) * size, size, axis=dim)


def stage_sum(times: int):
    """_reduce (jaxpar.parallel.gradients) whose sum over `stage` of a weight every stage shares (embedding, head,
    final norm) runs `times` times: 0, each stage keeps its own part; 2, the sum summed again (S x)."""

    def breaks(original):
        from jaxpar.parallel.reductions import summed

        def faulty(layout, grad, path):
            plan, value = layout.weights[path], grad.get_value()
            if value is None or not layout.pipelined or plan.stacked:
                return original(layout, grad, path)
            if layout.manual_data and not (layout.zero.shards_gradients and plan.zero_dim is not None):
                axes = tuple(a for a in layout.manual_data if a not in plan.used_axes)
                value = summed(value, axes, layout.reduce_dtype).astype(value.dtype) if axes else value
            for _ in range(times):
                value = jax.lax.psum(value, "stage")
            return grad.replace(value / layout.manual_batch_ways)

        return faulty

    return breaks


def rotated_gather(original):
    """ZeRO-3's all-gather of a weight shard (jaxpar.parallel.hooks._gathered_in) with the shards in the wrong
    order: device i's shard lands where device i + 1's belongs."""

    def faulty(shard, dtype, dim, axes, payload):
        return jnp.roll(original(shard, dtype, dim, axes, payload), shard.shape[dim], axis=dim)

    return faulty


def neighbours_block(original):
    """ZeRO-2/3's gradient reduce-scatter (jaxpar.parallel.reductions.scattered, as hooks calls it) that hands
    each device the sum of the next device's block: an offset off by one block."""

    def faulty(grad, axes, dim, payload):
        block = grad.shape[dim] // _devices(axes)
        return original(jnp.roll(grad, -block, axis=dim), axes, dim, payload)

    return faulty


def unsummed_scatter(original):
    """ZeRO-2/3's gradient reduce-scatter without its sum: each device keeps its own batch shard's part of its
    block."""

    def faulty(grad, axes, dim, payload):
        return _own_block(grad, axes, dim).astype(jnp.float32)

    return faulty


def previous_layer_replica(original):
    """ZeRO-2's layer weights (jaxpar.parallel.hooks._Hooks.layer_weights) read from the replica one layer back
    (clamped at 0): the scan's index off by one."""

    def faulty(self, layer_state, index):
        return original(self, layer_state, jnp.maximum(index - 1, 0))

    return faulty


def misordered_bf16_all_reduce(original):
    """The bf16 all-reduce (jaxpar.parallel.reductions.summed, parallel.grad_reduce_dtype=bf16) whose
    all-gather of the summed blocks puts each block one place on: the sums land on the wrong elements."""

    def faulty(grad, axes, payload):
        whole = original(grad, axes, payload)
        if jnp.dtype(payload) == jnp.float32:
            return whole
        n, flat = _devices(axes), whole.reshape(-1)
        block = -(-flat.size // n)
        padded = jnp.pad(flat, (0, n * block - flat.size))
        return jnp.roll(padded, block)[:flat.size].reshape(grad.shape)

    return faulty


def transposed_bf16_scatter(original):
    """The bf16 reduce-scatter (jaxpar.parallel.reductions.scattered) summing the received blocks along the
    wrong axis of their reshape: neighbouring rows of one block added, not the devices' copies of a row."""
    from jaxpar.parallel.reductions import _as_bits, _from_bits

    def faulty(grad, axes, dim, payload):
        if jnp.dtype(payload) == jnp.float32:
            return original(grad, axes, dim, payload)
        n = _devices(axes)
        bits = jax.lax.all_to_all(_as_bits(jnp.moveaxis(grad.astype(payload), dim, 0)), axes, 0, 0, tiled=True)
        blocks = _from_bits(bits, payload)
        mine = blocks.reshape(blocks.shape[0] // n, n, *blocks.shape[1:]).astype(jnp.float32).sum(1)
        return jnp.moveaxis(mine, 0, dim)

    return faulty


def rotated_sequence_gather(original):
    """Sequence parallelism's all-gather along the sequence (_SequenceMatmul.gather) with the tensor ranks'
    slices in the wrong order."""

    def faulty(self, x):
        return jnp.roll(original(self, x), x.shape[self.seq_dim], axis=self.seq_dim)

    return faulty


def unsummed_sequence_scatter(original):
    """Sequence parallelism's reduce-scatter (_SequenceMatmul.scatter_sum) without its sum over tensor: each rank
    keeps its own partial sums of its slice of the sequence."""

    def faulty(self, x):
        return _own_block(x.astype(jnp.float32), "tensor", self.seq_dim)

    return faulty


def mask_one_ahead(original):
    """A context block pair's mask (jaxpar.parallel.context_pair._visible) from query positions one ahead: each
    query sees the next token too."""

    def faulty(q_pos, k_pos, q_ids, k_ids, causal, options):
        return original(q_pos + 1, k_pos, q_ids, k_ids, causal, options)

    return faulty


def window_one_wider(original):
    """A context block pair's mask with the sliding window one position wider than the model's."""

    def faulty(q_pos, k_pos, q_ids, k_ids, causal, options):
        if options.window:
            options = dataclasses.replace(options, window=options.window + 1)
        return original(q_pos, k_pos, q_ids, k_ids, causal, options)

    return faulty


def late_chunk_first(original):
    """The balance permutation the batch is put in (jaxpar.parallel.context.device_order, as the step calls it)
    with each device's two chunks swapped: the schedule's positions no longer match the tokens'."""

    def faulty(seq_len, context, balance):
        order = original(seq_len, context, balance)
        if not balance or context == 1:
            return order
        return order.reshape(context, 2, -1)[:, ::-1].reshape(-1)

    return faulty


def unrescaled_merge(original):
    """The merge of two partial softmax results (jaxpar.parallel.context_pair.merge, as context attention calls
    it) that adds the earlier output without rescaling it to the new log-sum-exp."""

    def faulty(o1, lse1, o2, lse2):
        lse = jnp.logaddexp(lse1, lse2)
        finite = jnp.isfinite(lse)
        w2 = jnp.where(finite, jnp.exp(lse2 - jnp.where(finite, lse, 0.0)), 0.0)
        return o1 + o2 * jnp.einsum("BGRL->BLGR", w2)[..., None], lse

    return faulty


def reversed_gathered_blocks(original):
    """All-gather context attention (jaxpar.parallel.context._gathered) with the ranks' key and value blocks in
    reverse order."""

    def faulty(ring, k, v, ids):
        k, v, ids_all = original(ring, k, v, ids)
        if ring:
            return k, v, ids_all
        C = jax.lax.axis_size("context")
        flip = lambda x: x.reshape(x.shape[0], C, -1, *x.shape[2:])[:, ::-1].reshape(x.shape)  # noqa: E731
        return flip(k), flip(v), ids_all

    return faulty


def shifted_document_ids(original):
    """Context attention's all-gathered document ids of packed rows (jaxpar.parallel.context._gathered) one
    position late: each document boundary masked one key off."""

    def faulty(ring, k, v, ids):
        k, v, ids_all = original(ring, k, v, ids)
        return k, v, (None if ids_all is None else jnp.concatenate([ids_all[:, :1], ids_all[:, :-1]], axis=1))

    return faulty


def reversed_ring(original):
    """The ring's step (jaxpar.parallel.context._shift) sending each block to the previous rank, where the
    schedule expects it from the previous one."""

    def faulty(x):
        C = jax.lax.axis_size("context")
        return jax.lax.ppermute(x, "context", [(r, (r - 1) % C) for r in range(C)])

    return faulty


def no_high_pairs(original):
    """The balanced ring's schedule (jaxpar.parallel.context._Schedule.high) without the pairs against blocks
    from higher ranks: the late chunk's queries never see the other devices' early chunks."""

    def faulty(self):
        return []

    return faulty


def unit_microbatch_seed(original):
    """1F1B's explicit backward (jaxpar.parallel.one_f_one_b._OneFOneB) seeded with 1 per microbatch where the
    objective's mean over M microbatches gives 1 / M."""

    def faulty(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.d_aux = jnp.ones((), jnp.float32)

    return faulty


def head_on_next_microbatch(original):
    """GPipe's head spread over the stages (jaxpar.parallel.gpipe._spread_head_losses) scoring microbatch m's
    outputs against microbatch m + 1's targets."""
    from jaxpar.parallel.pipeline import microbatch

    def faulty(fns, params, outputs, tokens_MbT, table, s, axis):
        S, M = table.stages, table.microbatches
        last = jnp.where(s == S - 1, outputs[:M], jnp.zeros_like(outputs[:M])).astype(jnp.float32)
        outputs = jax.lax.psum(last, axis).astype(outputs.dtype)
        loss_sum, stats_sum = jnp.zeros((), jnp.float32), None
        for j in range(-(-M // S)):
            m = j * S + s
            mine = jnp.minimum(m, M - 1)
            loss, stats = fns.head_loss(params, outputs[mine], microbatch(tokens_MbT, (mine + 1) % M))
            loss_sum += jnp.where(m < M, loss.astype(jnp.float32), 0.0)
            stats = jax.tree.map(lambda x, m=m: jnp.where(m < M, x, 0.0), stats)
            stats_sum = stats if stats_sum is None else jax.tree.map(jnp.add, stats_sum, stats)
        return loss_sum, stats_sum

    return faulty


def reversed_chunks(original):
    """Interleaved 1F1B's chunk weights (jaxpar.parallel.pipeline.chunk_params, as the executor calls it) taken
    in reverse: a device's first virtual stage runs its last chunk's layers."""
    from jaxpar.parallel.pipeline import local_layers

    def faulty(params, is_stacked, local_chunk, layers_per_chunk):
        chunks = local_layers(params, is_stacked) // layers_per_chunk
        return original(params, is_stacked, chunks - 1 - local_chunk, layers_per_chunk)

    return faulty


def new_weights_for_old_microbatches(original):
    """2BW (jaxpar.parallel.two_bw._SteadyWindow.weights_for) running the previous step's microbatches on the
    new weights: the weight version one step stale is lost."""

    def faulty(self, m):
        return self.compute

    return faulty


def lost_weight_half(original):
    """The zero-bubble split's W half (jaxpar.parallel.split_backward.SplitBackward.weight_half) losing the
    gradient of its first weight."""

    def faulty(self, leaves, crossing):
        parts = original(self, leaves, crossing)
        return {g: value for g, value in parts.items() if g != min(parts)} if parts else parts

    return faulty


def misplaced_slot(original):
    """The expert all-to-all (ManualHooks.expert_all_to_all) whose dispatch swaps the first two capacity slots
    of the first local expert: two tokens each get the other's output."""

    def faulty(self, x_EGCD, inverse):
        y = original(self, x_EGCD, inverse)
        return y if inverse or y.shape[2] < 2 else y.at[0, :, :2].set(y[0, :, 1::-1])

    return faulty


def dropped_ragged_row(original):
    """The ragged all-to-all (jaxpar.parallel.ragged.ragged_all_to_all) sending one row fewer of its first
    non-empty slice than the receiver expects: a token dropped, the rows after it one place off."""

    def faulty(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name, real):
        first = jnp.argmax(send_sizes > 0)
        send_sizes = send_sizes.at[first].add(-(send_sizes[first] > 0).astype(send_sizes.dtype))
        return original(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axis_name,
                        real=real)

    return faulty


def rotated_gathered_rows(original):
    """Dropless routing's all-gather of the tokens over `expert` (ManualHooks.expert_gather) one row off: each
    token's row goes to the experts another token chose."""

    def faulty(self, x, inverse):
        y = original(self, x, inverse)
        return y if inverse or not jnp.issubdtype(y.dtype, jnp.floating) else jnp.roll(y, 1, axis=0)

    return faulty


def unsummed_rows(original):
    """Dropless routing's return of the experts' rows (jaxpar.parallel.reductions.rows_summed, as hooks calls
    it) without the sum over `expert`: each shard keeps only its own experts' outputs."""

    def faulty(x, axes):
        return _own_block(x, axes, 0)

    return faulty


def filled_from_the_end(original):
    """Capacity slots (jaxpar.model.routers._positions_in_expert) filled from the group's last token back:
    the wrong tokens kept when an expert overflows."""

    def faulty(mask_GNE, already_G1E):
        from_end = jnp.flip(jnp.cumsum(jnp.flip(mask_GNE, axis=1), axis=1), axis=1)
        return from_end - mask_GNE + already_G1E

    return faulty


def first_microbatch_twice(original):
    """The microbatches of gradient accumulation and pipelines (Layout.split_microbatches) with the last one
    replaced by the first: one microbatch counted twice, one never."""

    def faulty(self, batch, count):
        micro = original(self, batch, count)
        return jax.tree.map(lambda a: a.at[count - 1].set(a[0]) if count > 1 else a, micro)

    return faulty


def outer_step_without_lookahead(original):
    """Local SGD's Nesterov outer step (jaxpar.train.local_sgd.synchronize) as plain heavy-ball momentum: the
    look-ahead term of the outer gradient lost."""
    from jaxpar.train import local_sgd

    def faulty(params_R, outer, p):
        if outer is None:
            return original(params_R, outer, p)
        replicas = jax.tree.leaves(params_R)[0].shape[0]
        mean = local_sgd.replica_mean(params_R)
        outer_grad = jax.tree.map(jnp.subtract, outer.anchor, mean)
        momentum = jax.tree.map(lambda m, g: p.outer_momentum * m + g, outer.momentum, outer_grad)
        anchor = jax.tree.map(lambda a, m: a - p.outer_lr * m, outer.anchor, momentum)
        return local_sgd.stacked(anchor, replicas), local_sgd.OuterState(anchor, momentum), local_sgd._spread(
            params_R, mean)

    return faulty


def state_not_written_back(original):
    """The offloaded optimizer update (jaxpar.train.offload.offloaded_update) that computes the update but
    stores the old moments back in host memory: Adam restarts from its first moments every step."""

    def faulty(optimizer, grads, opt_state, params, placement, finite=None):
        updates, (clip_state, _) = original(optimizer, grads, opt_state, params, placement, finite)
        return updates, (clip_state, opt_state[1])

    return faulty


def unscaled_stage_fns(original):
    """The pipeline's stage functions (jaxpar.train.step.stage_fns) built without the loss scale: fp16's
    gradients are divided by a scale they were never multiplied by."""

    def faulty(graphdef, hooks, cfg, precision, scale, experts):
        return original(graphdef, hooks, cfg, precision, jnp.ones_like(scale), experts)

    return faulty


def unrounded_fp8_scale(original):
    """fp8's quantization (jaxpar.model.fp8.quantize) with the exact scale max / amax, not its power of two: each
    shard's amax then gives its own rounding."""

    def faulty(x, dtype):
        amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
        scale = jnp.float32(jnp.finfo(dtype).max) / jnp.maximum(amax, jnp.finfo(jnp.float32).tiny)
        return (x.astype(jnp.float32) * scale).astype(dtype), 1.0 / scale

    return faulty


def adapter_per_rank(names_in: str, ranks: int = 2):
    """A projection's LoRA output (jaxpar.model.adapters.lora_output, as the block calls it) counted once per
    tensor rank where its input is split over tensor (`names_in` among the input's logical names): the row-
    parallel adapter's product added before the all-reduce on every rank."""

    def breaks(original):
        def faulty(x, slots, x_names, out_names, ins=1, keys_B=None):
            out = original(x, slots, x_names, out_names, ins, keys_B)
            return out * ranks if out is not None and names_in in x_names else out

        return faulty

    return breaks


def pairs_weighed_per_shard(original):
    """DPO's row weights (jaxpar.train.preference.weighted_pairs) counted on each of 4 data shards' rows, not
    on the whole batch: the mean over valid pairs becomes a mean of the shards' means."""

    def faulty(batch, shards=4):
        rows = batch.tokens_BT.shape[0] // shards
        parts = [original(jax.tree.map(lambda a, i=i: a[i * rows:(i + 1) * rows], batch)) for i in range(shards)]
        return dataclasses.replace(batch, pair_weights_B=jnp.concatenate([p.pair_weights_B for p in parts]))

    return faulty


def mean_over_all_positions(original):
    """GRPO's per-completion mean (jaxpar.rl.grpo.token_terms) over all positions of the row, prompt and
    padding included, not over the completion's counted tokens."""

    def faulty(logp_BL, *args, **kwargs):
        terms = original(logp_BL, *args, **kwargs)
        return {**terms, "loss": terms["loss"] * jnp.maximum(terms["tokens"], 1.0) / logp_BL.shape[1]}

    return faulty


def vocab_shard_offset(original):
    """The vocab-parallel logits (_Hooks.column_parallel with a wider out_dtype) with each vocab shard's columns
    placed one shard on."""

    def faulty(self, equation, x, w, names, out_dtype=None):
        y = original(self, equation, x, w, names, out_dtype)
        if out_dtype is None:
            return y
        return jnp.roll(y, y.shape[-1] // self.layout.sizes.get("tensor", 1), axis=-1)

    return faulty


def one_query_block_short(original):
    """Flash attention's backward over packed rows (jaxpar.model.flash._query_blocks_end) stopping one query block
    early: a key block's gradient misses the last queries of its document."""

    def faulty(ids_BL, k_last, bq):
        return original(ids_BL, k_last, bq) - 1

    return faulty


def plain_gemm(original):
    """The layout's weight matmuls (jaxpar.parallel.hooks._Hooks.gemm) in the compute dtype where the precision
    policy runs them in fp8: the fp8 GEMM lost on the layout side."""
    from jaxpar.model.axes import PLAIN

    def faulty(self):
        return PLAIN

    return faulty


FAULTS = [
    Fault("gradient x3", "every gradient three times too large", "jaxpar.train.step:gradients",
          scaled_gradients(3.0), quick=True),
    Fault("gradient x3, experts", "every gradient three times too large (manual batch axes)",
          "jaxpar.train.step:gradients", scaled_gradients(3.0), layout=EXPERT_LAYOUT),
    Fault("gradient x0.5", "every gradient half its size", "jaxpar.train.step:gradients", scaled_gradients(0.5)),
    Fault("gradient x0.5, experts", "every gradient half its size (manual batch axes)",
          "jaxpar.train.step:gradients", scaled_gradients(0.5), layout=EXPERT_LAYOUT),
    Fault("data-parallel sum", "gradients summed over the batch shards, not averaged",
          "jaxpar.parallel.gradients:_reduce", summed_not_averaged, layout=EXPERT_LAYOUT, quick=True,
          area="data-parallel mean"),
    Fault("frozen norms", "every RMSNorm scale's gradient lost", "jaxpar.train.step:gradients",
          scaled_gradients(0.0, _is_norm)),
    Fault("frozen q/k/v", "the attention input projections' gradients lost", "jaxpar.train.step:gradients",
          scaled_gradients(0.0, _is_qkv)),
    Fault("near-ties reversed", "elements with near-zero gradients moved the wrong way",
          "jaxpar.train.step:_updated", reversed_near_ties, precisions=("fp32",), area="optimizer update"),
    # ---- the areas the issue names
    Fault("stage sum lost", "a weight every stage shares keeps each stage's own gradient (no psum over stage)",
          "jaxpar.parallel.gradients:_reduce", stage_sum(0), layout=PIPELINE_LAYOUT, area="shared weights over stage"),
    Fault("stage sum doubled", "a weight every stage shares summed over stage twice",
          "jaxpar.parallel.gradients:_reduce", stage_sum(2), layout=PIPELINE_LAYOUT, area="shared weights over stage"),
    Fault("zero-3 gather rotated", "ZeRO-3's all-gather puts each shard where the next device's belongs",
          "jaxpar.parallel.hooks:_gathered_in", rotated_gather, layout=(*EXPERT_LAYOUT, "parallel.zero=3"),
          area="ZeRO-2/3"),
    Fault("zero-2 scatter off by one block", "ZeRO-2's reduce-scatter hands each device the next device's block",
          "jaxpar.parallel.hooks:scattered", neighbours_block, layout=(*EXPERT_LAYOUT, "parallel.zero=2"),
          area="ZeRO-2/3"),
    Fault("zero-3 scatter unsummed", "ZeRO-3's reduce-scatter keeps each device's own part, not the sum",
          "jaxpar.parallel.hooks:scattered", unsummed_scatter, layout=(*EXPERT_LAYOUT, "parallel.zero=3"),
          area="ZeRO-2/3"),
    Fault("zero-2 replica of the layer before", "ZeRO-2's layer scan reads the replica one layer back",
          "jaxpar.parallel.hooks:_Hooks.layer_weights", previous_layer_replica,
          layout=(*EXPERT_LAYOUT, "parallel.zero=2"), area="ZeRO-2/3"),
    Fault("bf16 all-reduce misordered", "the bf16 all-reduce's all-gather puts each summed block one place on",
          "jaxpar.parallel.gradients:summed", misordered_bf16_all_reduce,
          layout=(*EXPERT_LAYOUT, "parallel.grad_reduce_dtype=bf16"), area="bf16 reductions"),
    Fault("bf16 reduce-scatter transposed", "the bf16 reduce-scatter sums a block's rows, not the devices' copies",
          "jaxpar.parallel.hooks:scattered", transposed_bf16_scatter,
          layout=(*EXPERT_LAYOUT, "parallel.zero=3", "parallel.grad_reduce_dtype=bf16"), area="bf16 reductions"),
    Fault("sequence gather rotated", "sequence parallelism's all-gather puts the ranks' slices in the wrong order",
          "jaxpar.parallel.sequence_matmul:_SequenceMatmul.gather", rotated_sequence_gather, layout=SEQUENCE_LAYOUT,
          area="sequence parallelism"),
    Fault("sequence scatter unsummed", "sequence parallelism's reduce-scatter keeps each rank's partial sums",
          "jaxpar.parallel.sequence_matmul:_SequenceMatmul.scatter_sum", unsummed_sequence_scatter,
          layout=SEQUENCE_LAYOUT, area="sequence parallelism"),
    Fault("context mask one ahead", "a context block pair's causal mask lets each query see the next token",
          "jaxpar.parallel.context_pair:_visible", mask_one_ahead, layout=CONTEXT_LAYOUT, area="context ring"),
    Fault("balance chunks swapped", "the batch's balance permutation holds each device's late chunk first",
          "jaxpar.laid_out.forward:device_order", late_chunk_first, layout=CONTEXT_LAYOUT, area="context ring"),
    Fault("online softmax unrescaled", "the ring's merge adds the earlier output without its rescale",
          "jaxpar.parallel.context:merge", unrescaled_merge, layout=CONTEXT_LAYOUT, area="context ring"),
    Fault("1f1b microbatch weight", "1F1B seeds each microbatch's backward with 1, not 1 / M",
          "jaxpar.parallel.one_f_one_b:_OneFOneB.__init__", unit_microbatch_seed, layout=PIPELINE_LAYOUT,
          area="pipeline executors"),
    Fault("gpipe head on the next microbatch", "GPipe's head scores microbatch m's outputs on m + 1's targets",
          "jaxpar.parallel.gpipe:_spread_head_losses", head_on_next_microbatch, layout=_pipeline("gpipe"),
          area="pipeline executors"),
    Fault("interleaved chunks reversed", "interleaved 1F1B runs a device's virtual stages' layers in reverse order",
          "jaxpar.parallel.one_f_one_b:chunk_params", reversed_chunks,
          layout=_pipeline("interleaved", "parallel.pipeline.virtual=2", "model.n_layers=4"),
          area="pipeline executors"),
    Fault("2bw weight version", "2BW runs the previous step's microbatches on the new weights",
          "jaxpar.parallel.two_bw:_SteadyWindow.weights_for", new_weights_for_old_microbatches,
          layout=(*_pipeline("2bw"), "train.steps=5"), area="pipeline executors"),  # verify's own steps: see fp8
    Fault("zero-bubble W half loses a weight", "the zero-bubble split's W half drops its first weight's gradient",
          "jaxpar.parallel.split_backward:SplitBackward.weight_half", lost_weight_half, layout=_pipeline("zb-h1"),
          area="pipeline executors"),
    Fault("all-to-all slots swapped", "the expert all-to-all swaps two tokens' capacity slots",
          "jaxpar.parallel.hooks:ManualHooks.expert_all_to_all", misplaced_slot, layout=EXPERT_LAYOUT,
          area="expert dispatch"),
    Fault("ragged row dropped", "the ragged all-to-all sends one row fewer than the receiver expects",
          "jaxpar.parallel.ragged:ragged_all_to_all", dropped_ragged_row,
          layout=(*DROPLESS_LAYOUT, "parallel.expert_dispatch=ragged"), area="expert dispatch"),
    Fault("capacity filled from the end", "capacity slots go to a group's last tokens first",
          "jaxpar.model.routers:_positions_in_expert", filled_from_the_end,
          layout=(*EXPERT_LAYOUT, "model.moe.capacity_factor=1.0"), area="capacity order"),
    Fault("accumulation repeats a microbatch", "gradient accumulation runs the first microbatch twice, the last never",
          "jaxpar.parallel.layout:Layout.split_microbatches", first_microbatch_twice,
          layout=(*QUICK_LAYOUT, "train.grad_accum=2"), area="gradient accumulation"),
    Fault("local SGD outer step without look-ahead", "the Nesterov outer step loses its look-ahead term",
          "jaxpar.train.local_sgd:synchronize", outer_step_without_lookahead,
          layout=("mesh.data=4", "mesh.tensor=2", "parallel.sync_every=2", "parallel.outer=nesterov"),
          area="local SGD outer step"),
    Fault("offloaded moments not stored", "the offloaded optimizer stores its old moments back to the host",
          "jaxpar.train.step:offloaded_update", state_not_written_back,
          layout=(*QUICK_LAYOUT, "train.offload=optimizer"), area="optimizer offload"),
    Fault("pipeline without the loss scale", "the pipeline's stage functions are built without fp16's loss scale",
          "jaxpar.train.step:stage_fns", unscaled_stage_fns, layout=PIPELINE_LAYOUT, precisions=("fp16",),
          area="loss scale"),
    *[Fault(f"fp8 unrounded scale ({axis})", f"fp8 scales are max / amax, not powers of two ({axis})",
            "jaxpar.model.fp8:quantize", unrounded_fp8_scale, layout=layout, precisions=("fp8",), area="fp8 hooks")
      for axis, layout in (("data x tensor", QUICK_LAYOUT), ("sequence", SEQUENCE_LAYOUT), ("expert", EXPERT_LAYOUT),
                           ("stage", PIPELINE_LAYOUT), ("context", CONTEXT_LAYOUT))],
    *[Fault(f"fp8 GEMM lost ({axis})", f"the layout's weight matmuls run in the compute dtype, not fp8 ({axis})",
            "jaxpar.parallel.hooks:_Hooks.gemm", plain_gemm, layout=layout, precisions=("fp8",), area="fp8 hooks")
      for axis, layout in (("data x tensor", QUICK_LAYOUT), ("sequence", SEQUENCE_LAYOUT), ("expert", EXPERT_LAYOUT),
                           ("stage", PIPELINE_LAYOUT), ("context", CONTEXT_LAYOUT))],
    Fault("LoRA down adapter per rank", "the MLP's row-parallel down adapter is added once per tensor rank",
          "jaxpar.model.mlp:lora_output", adapter_per_rank("mlp"), layout=(*QUICK_LAYOUT, "model.lora.rank=4"),
          area="LoRA adapters"),
    Fault("LoRA output adapter per rank", "attention's row-parallel output adapter is added once per tensor rank",
          "jaxpar.model.attention:lora_output", adapter_per_rank("heads"), layout=(*QUICK_LAYOUT, "model.lora.rank=4"),
          area="LoRA adapters"),
    Fault("DPO pairs weighed per shard", "DPO's row weights count valid pairs per data shard, not per batch",
          "jaxpar.train.objectives:weighted_pairs", pairs_weighed_per_shard, layout=QUICK_LAYOUT, data=_preference_data,
          area="DPO per-row reductions"),
    Fault("GRPO mean over all positions", "GRPO's per-completion mean divides by the row's length, not its tokens",
          "jaxpar.rl.grpo:token_terms", mean_over_all_positions, layout=QUICK_LAYOUT, data=_grpo_prompts,
          area="GRPO per-row reductions"),
    # ---- a second set, in layout-specific code the issue does not name
    Fault("context all-gather reversed", "all-gather context attention reads the ranks' blocks in reverse",
          "jaxpar.parallel.context:_gathered", reversed_gathered_blocks,
          layout=(*CONTEXT_LAYOUT, "parallel.context_attention=allgather"), area="context attention"),
    Fault("context ring reversed", "the ring sends each block to the previous rank",
          "jaxpar.parallel.context:_shift", reversed_ring, layout=("mesh.data=2", "mesh.context=4"),
          area="context attention"),
    Fault("context high pairs skipped", "the balanced ring skips the pairs against higher ranks' blocks",
          "jaxpar.parallel.context:_Schedule.high", no_high_pairs, layout=CONTEXT_LAYOUT, area="context attention"),
    Fault("context window one wider", "the sliding window under context parallelism reaches one key further",
          "jaxpar.parallel.context_pair:_visible", window_one_wider, layout=(*CONTEXT_LAYOUT, "model.window=4"),
          area="windowed attention under context"),
    Fault("context document ids shifted", "packed rows' document ids under context are one position late",
          "jaxpar.parallel.context:_gathered", shifted_document_ids, layout=CONTEXT_LAYOUT,
          data=_short_documents, area="packed rows under context"),
    Fault("dropless rows unsummed", "dropless routing's return over expert keeps each shard's own experts' rows",
          "jaxpar.parallel.hooks:rows_summed", unsummed_rows, layout=DROPLESS_LAYOUT, area="dropless exchange"),
    Fault("dropless rows rotated", "dropless routing's all-gather of tokens is one row off",
          "jaxpar.parallel.hooks:ManualHooks.expert_gather", rotated_gathered_rows, layout=DROPLESS_LAYOUT,
          area="dropless exchange"),
    Fault("vocab shard offset", "the vocab-parallel logits' shards land one shard on",
          "jaxpar.parallel.hooks:_Hooks.column_parallel", vocab_shard_offset, layout=QUICK_LAYOUT,
          area="vocab-parallel logits"),
    Fault("flash query blocks one short", "flash attention's backward over packed rows stops one query block early",
          "jaxpar.model.flash:_query_blocks_end", one_query_block_short,
          layout=(*QUICK_LAYOUT, "model.attention=flash", "model.flash_block_q=4", "model.flash_block_kv=4"),
          data=_short_documents, area="flash attention"),
]
# The areas the issue names, each with at least one fault; the second set's areas are the others.
AREAS = ("data-parallel mean", "shared weights over stage", "ZeRO-2/3", "bf16 reductions", "sequence parallelism",
         "context ring", "pipeline executors", "expert dispatch", "capacity order", "gradient accumulation",
         "local SGD outer step", "optimizer offload", "loss scale", "fp8 hooks", "LoRA adapters",
         "DPO per-row reductions", "GRPO per-row reductions")
BY_NAME = {fault.name: fault for fault in FAULTS}
assert len(BY_NAME) == len(FAULTS), "fault names are unique"


def caught(result: dict) -> bool:
    return not result["ok"]


def first_check(result: dict) -> str:
    """The check that failed worst (or a routing flip), for the table."""
    if result.get("failures"):
        return result["failures"][0]["check"]
    return "routing" if result.get("routing_changes", {}).get("flips") else "-"

