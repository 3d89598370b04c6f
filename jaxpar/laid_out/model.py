"""A model laid out on a session's mesh, with where its weights live and where they come from: what
`jaxpar generate`, `jaxpar eval`, RL's rollouts and export need, and what training builds on
(jaxpar.train.trainer.Trainer is this plus an optimizer, a strategy and its compiled steps).

The model is never materialized unsharded: its shapes come from `eval_shape`, its shardings from the
layout (rules table + ZeRO stage). Stacked layers are stored in the pipeline plan's order;
`to_model_order` is what checkpoints, evaluation and verification see. Building one traces no step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.config import Config, ConfigError
from jaxpar.features import layout_rules
from jaxpar.interop.hf_weights import load_params
from jaxpar.interop.peft import read_adapter
from jaxpar.interop.saved_run import read_run_weights
from jaxpar.model.adapters import Frozen, freeze_state
from jaxpar.model.axes import is_variable, path_names
from jaxpar.model.protocol import is_block_model
from jaxpar.model.transformer import Transformer
from jaxpar.parallel.layout import Layout
from jaxpar.parallel.pipeline_plan import PipelinePlan
from jaxpar.parallel.rules import RULES
from jaxpar.session import Session


class LaidOutModel:
    """A session's model on its mesh. `model` (a builder from nnx.Rngs; None: jaxpar's Transformer) and
    `rules` (its own logical names) are kept as given, for another layout of the same model.

    layout: where the synchronous weights live (evaluation, samples and imported weights use it);
    param_shardings: the parameters on `layout`, in model order; batch_sharding: a batch's rows over the
    mesh; pipeline: the order the stacked layers are stored in."""

    def __init__(self, session: Session, model: Callable[[nnx.Rngs], nnx.Module] | None = None,
                 rules: Mapping | None = None):
        self.session, self.model, self.rules = session, model, rules
        self.cfg, self.mesh, self.precision = session.cfg, session.mesh, session.precision
        cfg = self.cfg
        if model is not None and cfg.model.from_hf:
            raise ConfigError("model.from_hf loads a checkpoint into jaxpar's Transformer; a module of your own "
                              "(model=...) cannot take it.")
        self.build_model = model or (lambda rngs: Transformer(cfg.model, rngs=rngs))
        abstract_model = nnx.eval_shape(lambda: self.build_model(model_rngs(cfg)))
        block_model = is_block_model(abstract_model)
        check_model_fits(block_model, type(abstract_model).__name__, cfg, session.mesh_sizes)
        self.graphdef, self.abstract_params = nnx.split(abstract_model)
        self.stacked_at = abstract_model.STACKED_AT if block_model else ()
        self.layout_rules = {**layout_rules(RULES, cfg, session.mesh_sizes), **(rules or {})}
        self.layout = self.relayout(self.layout_rules)
        self.pipeline = PipelinePlan.build(cfg.parallel.pipeline, self.layout.sizes["stage"],
                                           abstract_model.stacked_layers() if self.stacked_at else 0)
        self.param_shardings = self.layout.named(self.layout.param_specs(self.abstract_params))
        self.batch_sharding = self.layout.batch_sharding()
        self.replicated = NamedSharding(self.mesh, PartitionSpec())

    def relayout(self, rules: dict) -> Layout:
        """The model's parameters laid out on the mesh by `rules` (a strategy's own layout: local SGD's)."""
        return Layout.build(self.mesh, self.abstract_params, self.stacked_at, self.cfg.parallel, self.precision,
                            rules)

    def weights(self, params):
        """The one set of weights the model runs with (evaluation, samples): the stored parameters (a
        trainer's strategy may keep others: jaxpar.train.trainer)."""
        return params

    def to_model_order(self, tree):
        """Stacked leaves (in params or optimizer state) as the model orders its layers."""
        return self.pipeline.to_model_order(tree)

    def from_model_order(self, tree):
        """Stacked leaves from the model's layer order to the order this layout stores them in."""
        return self.pipeline.from_model_order(tree)

    def put_batch(self, tokens_BT):
        """Place a host batch (the whole batch, on every process: a token array or packed rows) onto the
        mesh with the batch sharding."""
        return jax.device_put(tokens_BT, self.batch_sharding)

    # ---------------------------------------------------------------- where the weights come from

    def fresh_params(self) -> nnx.State:
        """Newly initialized parameters (traced: jit it with the shardings they go to)."""
        return nnx.state(self.build_model(model_rngs(self.cfg)))

    @property
    def starts_fresh(self) -> bool:
        """Whether the weights start newly initialized (neither model.from_hf nor model.from_run)."""
        return self.session.hf_checkpoint is None and not self.cfg.model.from_run

    def start_params(self) -> nnx.State:
        """The weights a run starts from (model order, on the parameters' shardings): fresh, or
        model.from_hf's or model.from_run's, with model.lora's adapters (fresh, or model.lora.from_peft's)."""
        if self.starts_fresh:
            if self.cfg.model.lora.from_peft:
                raise ConfigError("model.lora.from_peft puts an adapter on the checkpoint it was made for; "
                                  "give that checkpoint as model.from_hf.")
            return jax.jit(self.fresh_params, out_shardings=self.param_shardings)()
        if not self.cfg.model.lora.enabled:
            return self._read_weights(self.param_shardings)
        # adapters on a checkpoint: its weights frozen (stored as model.lora.base_dtype), the adapters fresh
        frozen, adapter_shardings = nnx.split_state(self.param_shardings, Frozen, nnx.LoRAParam)
        base = jax.jit(freeze_state, out_shardings=frozen)(self._read_weights(frozen))
        return nnx.merge_state(base, self._first_adapters(adapter_shardings))

    def _read_weights(self, shardings) -> nnx.State:
        """The starting weights (no adapters) onto `shardings`: model.from_hf's files or model.from_run's
        newest checkpoint."""
        if self.session.hf_checkpoint is not None:
            return load_params(self.session.hf_checkpoint, self.cfg.model, shardings)[0]
        return read_run_weights(self.cfg.model.from_run, self.cfg, shardings)

    def _first_adapters(self, shardings):
        """The adapters a run starts from: model.lora.from_peft's, else fresh (A drawn, B zero)."""
        if self.cfg.model.lora.from_peft:
            values = read_adapter(self.cfg.model.lora.from_peft, self.cfg.model)
            return jax.tree_util.tree_map_with_path(
                lambda p, v: v.replace(jax.device_put(values[path_names(p)], v.get_value())), shardings,
                is_leaf=is_variable)
        return jax.jit(lambda: nnx.split_state(self.fresh_params(), Frozen, nnx.LoRAParam)[1],
                       out_shardings=shardings)()


def model_rngs(cfg: Config) -> nnx.Rngs:
    """The model's random streams: the weights' from train.seed, and the adapters' (model.lora) apart,
    so that the base weights are the same with adapters or without."""
    return nnx.Rngs(cfg.train.seed, lora=cfg.train.seed + 1)


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
