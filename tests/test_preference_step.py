"""train.objective = dpo, simpo or orpo in the train step: every layout computes the single-device
reference's losses, metrics and weights on hand-made rows of pairs; the single-device step's loss is
each pair's formula on its documents run one at a time; DPO starts at log 2 (B = 0: policy = reference);
DPO without adapters is one sentence."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import SMALL_MODEL

from jaxpar.cli import main
from jaxpar.config import MESH_AXES
from jaxpar.config.preference import PreferenceConfig
from jaxpar.config.presets import load_config
from jaxpar.data.packed_rows import PackedRows
from jaxpar.features import problem
from jaxpar.interop.checkpoint_files import flat_by_path
from jaxpar.laid_out.forward import target_losses
from jaxpar.session import on_devices
from jaxpar.train.preference import batch_objective, pair_log_probs, weighted_pairs
from jaxpar.train.trainer import Trainer
from jaxpar.verify.run import reference_config

METRICS = ("rewards/chosen", "rewards/rejected", "margin", "accuracy")
# DPO on adapters on every target (the gated MLP's gate too): its runs verify LoRA on these layouts as well
OBJECTIVES = {"dpo": ("train.objective=dpo", "model.lora.rank=4", "model.mlp=swiglu"),
              "simpo": ("train.objective=simpo",),
              "orpo": ("train.objective=orpo",)}
QUICK = "data=4 x tensor=2, zero 3, 2 microbatches"
LAYOUTS = {QUICK: ("mesh.data=4", "mesh.tensor=2", "parallel.zero=3", "train.grad_accum=2"),
           "data=2 x stage=4, 1f1b": ("mesh.data=2", "mesh.stage=4", "mesh.tensor=1"),
           **{f"data=2 x stage=4, {schedule}": ("mesh.data=2", "mesh.stage=4", "mesh.tensor=1",
                                                f"parallel.pipeline.schedule={schedule}")
              for schedule in ("gpipe", "zb-h1")},
           "context=2 x tensor=2, balanced, 2 loss chunks": ("mesh.data=2", "mesh.context=2", "mesh.tensor=2",
                                                             "train.loss_chunks=2"),
           "data=2 x expert=4": ("mesh.data=2", "mesh.expert=4", "mesh.tensor=1", "model.moe.experts=4")}
# every objective on the quick layout and on 1F1B; one each on the other schedules (adapters do not run
# on zero-bubble ones yet), context parallelism (its reordered targets) and experts
CASES = [*[(objective, name) for name in list(LAYOUTS)[:2] for objective in OBJECTIVES],
         ("dpo", "data=2 x stage=4, gpipe"), ("orpo", "data=2 x stage=4, zb-h1"),
         ("dpo", "context=2 x tensor=2, balanced, 2 loss chunks"), ("simpo", "data=2 x expert=4")]
STEPS = 3


def preference_rows(rng, rows: int, T: int, vocab: int) -> PackedRows:
    """Rows of 0-3 whole pairs (every other three rows 0-1) (chosen document, rejected document: the same
    prompt of 2-4 tokens, then a response of 1-5 tokens, sometimes none, which makes the pair invalid),
    then a padding document. The mask is 1 on the responses."""
    tokens = rng.integers(1, vocab, (rows, T)).astype(np.int32)
    segments, positions, mask = (np.zeros((rows, T), np.int32) for _ in range(3))
    for b in range(rows):
        pos, doc = 0, 0
        for _ in range(int(rng.integers(0, 4 if (b // 3) % 2 else 2))):  # uneven over microbatches and shards
            prompt = int(rng.integers(2, 5))
            answers = [int(rng.integers(0, 6)) if rng.random() < 0.15 else int(rng.integers(1, 6)) for _ in range(2)]
            if pos + 2 * prompt + sum(answers) > T:
                break
            prompt_tokens = rng.integers(1, vocab, prompt)
            for answer in answers:  # chosen, then rejected
                n = prompt + answer
                tokens[b, pos:pos + prompt] = prompt_tokens
                segments[b, pos:pos + n], positions[b, pos:pos + n] = doc, np.arange(n)
                mask[b, pos + prompt:pos + n] = 1
                pos, doc = pos + n, doc + 1
        segments[b, pos:], positions[b, pos:] = doc, np.arange(T - pos)
    return PackedRows(tokens, segments, positions, mask)


def _session(*settings: str, devices: int = 8):
    """A session on the first `devices` devices without reading data.source (a preference objective's
    data is a folder of pairs: these tests make their rows by hand)."""
    return on_devices(load_config(None, list(settings)), jax.devices()[:devices])


def _trainers(*settings):
    """(the layout's trainer, the single-device reference's, both states from the layout's init)."""
    layout = Trainer(_session(*SMALL_MODEL, "model.n_layers=4", *settings))
    reference = Trainer(on_devices(reference_config(layout.cfg), jax.devices()[:1]))
    gather = jax.jit(lambda tree: tree, out_shardings=layout.replicated)
    state = layout.init()
    ref_state = reference.put_state(layout.to_model_order(jax.device_get(gather(state))))
    return layout, reference, state, ref_state, gather


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize(("objective", "layout_name"), [
    pytest.param(objective, name, marks=() if (objective, name) == ("dpo", QUICK) else pytest.mark.slow)
    for objective, name in CASES])
def test_preference_objective_matches_single_device(objective, layout_name):
    layout, reference, state, ref_state, gather = _trainers(*OBJECTIVES[objective], *LAYOUTS[layout_name])
    cfg = layout.cfg
    rng = np.random.default_rng(0)
    keys = ("loss", *METRICS, *(("nll",) if objective == "orpo" else ()))
    for step in range(STEPS):
        batch = preference_rows(rng, cfg.train.batch_size, cfg.model.seq_len + 1, cfg.model.vocab_size)
        state, metrics = layout.step(state, layout.put_batch(batch))
        ref_state, ref_metrics = reference.step(ref_state, reference.put_batch(batch))
        metrics, ref_metrics = jax.device_get((metrics, ref_metrics))
        assert set(keys) <= set(metrics), sorted(metrics)
        assert _rel(metrics["loss"], ref_metrics["loss"]) <= 1e-5, (step, metrics["loss"], ref_metrics["loss"])
        for key in keys[1:]:
            # accuracy counts strict wins: at step 0 of DPO every pair ties, so rounding may tip one
            tolerance = 0.05 if key == "accuracy" else 1e-5 * max(1.0, abs(float(ref_metrics[key])))
            assert abs(float(metrics[key]) - float(ref_metrics[key])) <= tolerance, (step, key, metrics[key],
                                                                                     ref_metrics[key])
    params, ref_params = jax.device_get((gather(layout.to_model_order(state.params)), ref_state.params))
    ref_flat = flat_by_path(ref_params)
    errors = {key: _rel(value, ref_flat[key]) for key, value in flat_by_path(params).items()}
    assert max(errors.values()) <= 1e-4, max(errors.items(), key=lambda kv: kv[1])


def _pair_log_prob_sums(trainer: Trainer, params, batch: PackedRows) -> list[tuple[float, float, int, int]]:
    """(chosen sum, rejected sum, chosen count, rejected count) of every valid pair, each document run
    alone as a plain window (the row's other documents and the packing machinery play no part)."""
    tokens, segments, mask = batch.tokens_BT, batch.segments_BT, batch.mask_BT
    T = tokens.shape[1]
    docs, spans = [], []
    for b in range(tokens.shape[0]):
        for d in range(0, int(segments[b].max()) + 1):
            where = np.flatnonzero(segments[b] == d)
            window = np.zeros(T, np.int32)
            window[:len(where)] = tokens[b, where]
            docs.append(window)
            spans.append((b, d, mask[b, where][1:].astype(bool)))  # the targets that count, from position 1
    losses = np.asarray(target_losses(trainer.graphdef, params, PackedRows(jnp.asarray(np.stack(docs))),
                                      trainer.precision))
    sums = {(b, d): (-float(losses[i, :len(counted)][counted].sum()), int(counted.sum()))
            for i, (b, d, counted) in enumerate(spans)}
    return [(*zip(sums[b, d], sums[b, d + 1]),) for (b, d) in sums if d % 2 == 0 and (b, d + 1) in sums
            and sums[b, d][1] > 0 and sums[b, d + 1][1] > 0]


def test_single_device_step_is_each_pairs_formula():
    """SimPO and ORPO at step 0 on one device: the mean over the batch's valid pairs of the papers'
    per-pair losses (SimPO: Meng et al. 2024 eq. 6; ORPO: Hong et al. 2024 eqs. 2-7), from each
    document's log-probabilities with the document run alone."""
    rng = np.random.default_rng(3)
    for objective in ("simpo", "orpo"):
        cfg = reference_config(load_config(None, [*SMALL_MODEL, *OBJECTIVES[objective], "train.batch_size=8"]))
        trainer = Trainer(on_devices(cfg, jax.devices()[:1]))
        state = trainer.init()
        batch = preference_rows(rng, 8, cfg.model.seq_len + 1, cfg.model.vocab_size)
        pairs = _pair_log_prob_sums(trainer, trainer.to_model_order(state.params), batch)
        _, metrics = trainer.step(state, trainer.put_batch(batch))
        p = cfg.train.preference
        losses, nlls = [], []
        for (pc, pr), (nc, nr) in pairs:
            mc, mr = pc / nc, pr / nr
            if objective == "simpo":
                losses.append(math.log1p(math.exp(-(p.beta * mc - p.beta * mr - p.gamma))))
            else:
                log_odds = (mc - math.log(-math.expm1(mc))) - (mr - math.log(-math.expm1(mr)))
                losses.append(-mc + p.beta * math.log1p(math.exp(-log_odds)))
                nlls.append(-mc)
        assert len(pairs) >= 4
        assert abs(float(metrics["loss"]) - np.mean(losses)) <= 1e-5 * np.mean(losses), (objective, metrics["loss"])
        if nlls:
            assert abs(float(metrics["nll"]) - np.mean(nlls)) <= 1e-5 * np.mean(nlls)


@pytest.mark.slow
def test_dpo_starts_at_log_2():
    """Adapters' B start at zero, so at step 0 the policy is the reference: every pair's log-ratio is 0
    (to rounding: the reference is the evaluation's forward, the policy the step's), the loss
    -log sigmoid(0) = log 2, and the chosen rewards do not beat the rejected ones (accuracy counts strict
    wins: 0 at exact ties, test_tied_pairs_have_accuracy_0)."""
    trainer = Trainer(_session(*SMALL_MODEL, *OBJECTIVES["dpo"], "mesh.data=4", "mesh.tensor=2"))
    batch = preference_rows(np.random.default_rng(1), trainer.cfg.train.batch_size, trainer.cfg.model.seq_len + 1,
                            trainer.cfg.model.vocab_size)
    state, metrics = trainer.step(trainer.init(), trainer.put_batch(batch))
    metrics = jax.device_get(metrics)
    assert abs(float(metrics["loss"]) - math.log(2)) <= 1e-6, metrics["loss"]
    assert 0.0 <= float(metrics["accuracy"]) <= 0.1
    assert abs(float(metrics["margin"])) <= 1e-6 and float(metrics["grad_norm"]) > 0
    for _ in range(3):  # the learning rate warms up from 0
        state, metrics = trainer.step(state, trainer.put_batch(batch))
    assert float(metrics["loss"]) < math.log(2) - 1e-3 and float(metrics["accuracy"]) > 0.5, metrics


def test_tied_pairs_have_accuracy_0_and_rows_weigh_by_the_whole_batch():
    """batch_objective with the reference equal to the policy: DPO's loss is log 2 and its accuracy 0. And
    the batch cut in microbatches of rows, weighted on the whole batch (weighted_pairs): the microbatches'
    plain mean of their values is the whole batch's value, the mean over its valid pairs."""
    cfg = PreferenceConfig()
    batch = preference_rows(np.random.default_rng(2), 12, 33, 50)
    batch = weighted_pairs(jax.tree.map(jnp.asarray, batch))
    losses_BL = jnp.asarray(np.random.default_rng(3).exponential(1.0, batch.targets_BL.shape), jnp.float32)
    tied = dataclasses.replace(batch, reference_BL=-losses_BL)
    loss, stats = batch_objective("dpo", cfg, losses_BL, tied)
    assert abs(float(loss) - math.log(2)) <= 1e-6 and float(stats["accuracy"]) == 0.0
    for objective in ("simpo", "orpo"):
        whole = batch_objective(objective, cfg, losses_BL, batch)[1]
        parts = [batch_objective(objective, cfg, losses_BL[rows], jax.tree.map(lambda a, rows=rows: a[rows], batch))[1]
                 for rows in (slice(0, 4), slice(4, 8), slice(8, 12))]
        for key, value in whole.items():
            np.testing.assert_allclose(np.mean([float(p[key]) for p in parts]), float(value), rtol=1e-6, atol=1e-7)
        valid = pair_log_probs(-losses_BL, batch.target_mask_BL(), batch.target_documents_BL(), 16).valid
        assert 0 < int(valid.sum()) < 12 * 16


def test_dpo_needs_adapters(capsys):
    assert main(["train", "configs/tiny_test.yaml", "train.objective=dpo"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxpar: error: train.objective=dpo takes its reference") and len(err.splitlines()) == 1
    for settings in (["train.objective=dpo", "model.lora.rank=4"], ["train.objective=simpo"],
                     ["train.objective=orpo"], []):
        assert problem(load_config(None, settings), dict.fromkeys(MESH_AXES, 1)) is None
