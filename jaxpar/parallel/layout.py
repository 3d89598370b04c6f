"""A parallel layout: one frozen plan of where every part of the training state lives, built
from the mesh, the rules table, the ZeRO stage and the abstract parameters before anything is
traced. `jaxpar.parallel.gradients` differentiates a step on it; `jaxpar.parallel.hooks` is what
it does inside the traced step.

ZeRO is named by what it shards (`ZeroStage`): the optimizer state from stage 1, the gradients
from 2, the parameters from 3. The rest of jaxpar asks those questions, never the stage number.
"""
from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.config.parallel import ParallelConfig, ZeroStage
from jaxpar.config.precision import POLICIES, PrecisionPolicy
from jaxpar.model.axes import Gemm, constrain, holds_array, is_stacked, is_variable, logical_names, path_names
from jaxpar.model.fp8 import GEMMS
from jaxpar.parallel.rules import RULES, axis_names, data_parallel_axes, logical_to_spec
from jaxpar.parallel.zero import zero_dim, zero_spec

_SYNCHRONOUS = ParallelConfig()  # the defaults: ZeRO-0, ring context attention in balanced chunks



@dataclasses.dataclass(frozen=True)
class WeightPlan:
    """Where one parameter lives: its logical names, rules-table spec, the spec with ZeRO's
    data-parallel sharding added, the (dimension, axes) ZeRO shards it over (None when no
    dimension can take it), whether it is stacked over layers, and the mesh axes its spec uses."""

    names: tuple
    spec: PartitionSpec
    zero_spec: PartitionSpec
    zero_dim: tuple | None
    stacked: bool
    used_axes: frozenset


@dataclasses.dataclass(frozen=True)
class Layout:
    """The plan of one mesh, rules table and ZeRO stage for one model's parameters.

    weights: every parameter's WeightPlan by path; layer_weights_at: the path of the module
    whose stacked state the layer scan runs over (a layer's weights are found below it).
    """

    mesh: jax.sharding.Mesh
    parallel: ParallelConfig  # the config's section: ZeRO's stage, context attention and balance
    precision: PrecisionPolicy  # compute dtype (ZeRO-3 gathers weights in it), gradient reductions' payload
    rules: Mapping
    sizes: Mapping[str, int]
    data_axes: tuple[str, ...]  # the data-parallel axes of size > 1
    batch_ways: int  # how many slices the batch is cut into
    manual_data: tuple[str, ...]  # the batch axes a shard_map makes manual (none when partitioned)
    manual: tuple[str, ...]  # every manual axis: manual_data, and `stage` for a pipeline
    traced_batch_shards: int  # batch shards the traced loss sees: 1 under manual batch axes, else all
    weights: Mapping[tuple, WeightPlan]
    layer_weights_at: tuple[str, ...]
    zero_axes: tuple[str, ...] = ("data", "expert")  # what ZeRO shards the state over (see build)

    @classmethod
    def build(cls, mesh: jax.sharding.Mesh, abstract_params, layer_weights_at: tuple[str, ...] = ("blocks",),
              parallel: ParallelConfig = _SYNCHRONOUS, precision: PrecisionPolicy = POLICIES["fp32"],
              rules: Mapping = RULES) -> Layout:
        sizes, reduce_dtype = dict(mesh.shape), precision.grad_reduce_dtype
        data_axes = tuple(a for a in data_parallel_axes(rules) if sizes.get(a, 1) > 1)
        pipelined = sizes.get("stage", 1) > 1
        # shard_map only where the step needs collectives written by hand; data, ZeRO and tensor
        # parallelism are left to XLA's SPMD partitioner as sharding constraints (the same step
        # ran 1.4-1.7x faster that way than written per shard under shard_map on emulated CPU
        # devices: benchmarks/RESULTS.md, "Where the time went"). The batch axes are manual for
        # the expert all-to-all. A pipeline is manual over `stage` and leaves the batch axes to
        # the partitioner, except with tensor > 1: there XLA's partitioner aborts on the
        # embedding gather when `data` and `tensor` are both automatic under a manual `stage`
        # (a failed check in ExpandDeviceGroups, jax 0.12.0.1), so the batch axes stay manual.
        # Only axes of size > 1 are made manual: XLA's SPMD partitioner rejects the tensor
        # all-reduces of a shard_map that is manual over size-1 axes only (where no axis of size
        # > 1 is left automatic, the size-1 ones are made manual too: _with_idle_axes).
        # Gradients reduced in another dtype than fp32 are reduced by hand too: the partitioner
        # reduces each weight gradient in the dtype its matmul produced it in.
        # 2BW carries what is in flight from step to step, each device its own: with the batch axes manual
        # too, every such value is one device's, not an array the partitioner may spread over `data`.
        manual_batch = (sizes.get("expert", 1) > 1 or (pipelined and sizes.get("tensor", 1) > 1)
                        or (pipelined and parallel.pipeline.schedule == "2bw")
                        or jnp.dtype(reduce_dtype) != jnp.float32)
        manual_data = data_axes if manual_batch else ()
        batch_ways = math.prod(sizes[a] for a in data_axes)
        # ZeRO shards the state over every axis the weights are replicated on while their gradients are summed:
        # the batch axes and `context`, as MaxText's FSDP does, where the partitioner runs its collectives (with
        # the batch axes manual, ZeRO's collectives are written by hand over them alone)
        zero_axes = data_parallel_axes(rules) + (() if manual_batch else ("context",))
        weights = {}
        for path, v in jax.tree_util.tree_flatten_with_path(abstract_params, is_leaf=is_variable)[0]:
            shape = v.get_value().shape
            names = logical_names(v, len(shape))
            spec = logical_to_spec(names, rules)
            weights[path_names(path)] = WeightPlan(
                names, spec, zero_spec(spec, shape, names, sizes, zero_axes),
                zero_dim(spec, shape, names, sizes, zero_axes), is_stacked(v),
                frozenset(a for e in spec for a in axis_names(e)))
        manual = _with_idle_axes(manual_data + (("stage",) if pipelined else ()), sizes)
        return cls(mesh=mesh, parallel=parallel, precision=precision, rules=types.MappingProxyType(dict(rules)),
                   sizes=types.MappingProxyType(sizes), data_axes=data_axes, batch_ways=batch_ways,
                   manual_data=manual_data, manual=manual,
                   traced_batch_shards=1 if manual_data else batch_ways, weights=types.MappingProxyType(weights),
                   layer_weights_at=tuple(layer_weights_at), zero_axes=zero_axes)

    @property
    def zero(self) -> ZeroStage:
        return ZeroStage(self.parallel.zero)

    @property
    def compute_dtype(self):
        return self.precision.compute_dtype

    @property
    def reduce_dtype(self):
        """The payload of the data-parallel gradient reductions (parallel.grad_reduce_dtype)."""
        return self.precision.grad_reduce_dtype

    @property
    def gemm(self) -> Gemm:
        """How the blocks' weight matmuls run, in the step, evaluation and generation alike: the precision
        policy's `gemm` (jaxpar.model.fp8)."""
        return GEMMS[self.precision.gemm]

    @property
    def output_grad_dtype(self):
        """The fp32 logits' and scores' gradient entering their matmuls' backward."""
        return self.precision.dtype("output_grad")

    @property
    def context_attention(self) -> str:
        return self.parallel.context_attention

    @property
    def balanced_context(self) -> bool:
        """Whether each context device holds two chunks of the sequence, i and 2C - 1 - i of 2C, so that
        causal attention's work is even (parallel.context_balance; jaxpar.parallel.context)."""
        return self.parallel.context_balance

    @property
    def sequence_parallel(self) -> bool:
        """Whether the residual stream is split along the sequence over a tensor axis of size > 1."""
        return "tensor" in axis_names(self.rules.get("residual_seq")) and self.sizes.get("tensor", 1) > 1

    @property
    def context(self) -> int:
        """Devices the sequence is split over through the whole block (mesh.context)."""
        return self.sizes.get("context", 1)

    @property
    def pipelined(self) -> bool:
        return self.sizes.get("stage", 1) > 1

    @property
    def manual_batch_ways(self) -> int:
        """What per-shard means are averaged over: the manual batch shards (1 when partitioned)."""
        return self.batch_ways // self.traced_batch_shards

    # ---- partition specs -------------------------------------------------------------
    def spec(self, names: tuple, shape: tuple, zero: bool) -> PartitionSpec:
        """The rules-table spec of a leaf, with ZeRO sharding added when `zero`."""
        spec = logical_to_spec(names, self.rules)
        return zero_spec(spec, shape, names, self.sizes, self.zero_axes) if zero else spec

    def _specs(self, tree, zero: bool):
        def one(x):
            if is_variable(x):
                if not holds_array(x):  # a placeholder in the optimizer state
                    return x
                shape = x.get_value().shape
                return x.replace(self.spec(logical_names(x, len(shape)), shape, zero))
            return self.spec((None,) * len(x.shape), x.shape, zero) if getattr(x, "ndim", 0) else PartitionSpec()

        return jax.tree.map(one, tree, is_leaf=is_variable)

    def param_specs(self, params):
        """Parameters: sharded over data-parallel devices only under ZeRO-3."""
        return self._specs(params, self.zero.shards_params)

    def grad_specs(self, params):
        """Gradients after reduction: reduce-scattered under ZeRO-2 and 3."""
        return self._specs(params, self.zero.shards_gradients)

    def opt_specs(self, opt_state):
        """Optimizer state: sharded over data-parallel devices from ZeRO-1 on."""
        return self._specs(opt_state, self.zero.shards_optimizer_state)

    def named(self, specs, memory_kind: str | None = None):
        """PartitionSpecs -> NamedShardings on this mesh (in `memory_kind`: 'device', 'pinned_host';
        None: the default)."""
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s, memory_kind=memory_kind), specs,
                            is_leaf=lambda x: isinstance(x, PartitionSpec))

    def batch_sharding(self) -> NamedSharding:
        """Sharding of a (batch, ...) array: rows over the data-parallel axes."""
        return NamedSharding(self.mesh, logical_to_spec(("batch",), self.rules))

    def split_microbatches(self, batch, count: int):
        """Arrays (B, ...) -> (count, B / count, ...). Microbatch i is the i-th block of consecutive
        rows of every batch shard the trace sees, so each microbatch stays spread over all devices,
        and MoE routing groups (consecutive tokens) hold the same tokens as without splitting."""
        shards = self.traced_batch_shards

        def one(a):
            B, rest = a.shape[0], a.shape[1:]
            micro = a.reshape(shards, count, B // (shards * count), *rest).swapaxes(0, 1)
            return constrain(micro.reshape(count, B // count, *rest), (None, "batch") + (None,) * len(rest))

        return jax.tree.map(one, batch)

    def stacked_mask(self, params):
        """A tree of bools: True for stacked (per-layer) weights, which pipeline stages split."""
        return jax.tree.map(lambda v: v.replace(is_stacked(v)), params, is_leaf=is_variable)


def _with_idle_axes(manual: tuple[str, ...], sizes: dict[str, int]) -> tuple[str, ...]:
    """A shard_map that leaves only size-1 axes automatic is made manual over them too: nothing is
    left to partition, and under automatic axes jax gives every op of the body an open sharding
    constraint (2,224 in a small data x expert MoE step, whose compile took 15% longer for them)."""
    if not manual or any(size > 1 for axis, size in sizes.items() if axis not in manual):
        return manual
    return manual + tuple(axis for axis in sizes if axis not in manual)
