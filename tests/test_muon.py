"""train.optimizer=muon: which axes of each weight Muon orthogonalises over, one step against a numpy
Muon written here, every layout against one device, and the weights it refuses."""

import json
import math

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import SMALL_MODEL, resumed_run_matches

from jaxpar.cli import main
from jaxpar.config.presets import load_config
from jaxpar.interop.checkpoint_files import flat_by_path
from jaxpar.model.axes import is_variable, path_names
from jaxpar.model.transformer import Transformer
from jaxpar.plan.memory import shard_bytes
from jaxpar.train.muon import dimension_numbers
from jaxpar.train.optim import make_optimizer
from jaxpar.train.trainer import Trainer

MLA = ["model.mla.kv_rank=32", "model.mla.q_rank=32", "model.mla.rope_dim=8", "model.mla.nope_dim=16",
       "model.mla.v_dim=16"]
MOE = ["model.moe.experts=4", "model.moe.mlp=swiglu"]

# path -> (batch axes, reduction axes, output axes), each axis by its logical name, or by its size where it
# has none; ADAMW where AdamW takes the weight. Tiny model: 2 layers, D 64, 4 heads of 16, F 256, V 256.
ADAMW = "adamw"
DENSE_TABLE = {
    "blocks/attn/w_qkv": (("layers", "3"), ("embed",), ("heads", "kv")),
    "blocks/attn/wo": (("layers",), ("heads", "kv"), ("embed",)),
    "blocks/mlp/w_up": (("layers",), ("embed",), ("mlp",)),
    "blocks/mlp/w_down": (("layers",), ("mlp",), ("embed",)),
    "blocks/attn_norm/scale": ADAMW, "blocks/mlp_norm/scale": ADAMW, "embedding": ADAMW, "final_norm/scale": ADAMW,
}
MOE_TABLE = {  # every second layer's MLP is a mixture of experts: the blocks are stacked in units of two
    **{f"blocks/blocks/{unit}/{k[len('blocks/'):]}": v for k, v in DENSE_TABLE.items() if k.startswith("blocks/")
       for unit in (0, 1) if unit == 0 or "mlp/" not in k},
    "blocks/blocks/1/mlp/w_gate_up": (("layers", "expert", "2"), ("embed",), ("mlp",)),
    "blocks/blocks/1/mlp/w_down": (("layers", "expert"), ("mlp",), ("embed",)),
    "blocks/blocks/1/mlp/w_router": ADAMW,  # a classifier over the experts (jaxpar.train.muon)
    "embedding": ADAMW, "final_norm/scale": ADAMW,
}
MLA_TABLE = {
    **{k: v for k, v in DENSE_TABLE.items() if k != "blocks/attn/w_qkv"},
    "blocks/attn/w_q_down": (("layers",), ("embed",), ("32",)),
    "blocks/attn/w_q_up": (("layers",), ("32",), ("heads", "kv")),
    "blocks/attn/w_kv_down": (("layers",), ("embed",), ("40",)),
    "blocks/attn/w_kv_up": (("layers",), ("32",), ("heads", "kv")),
    "blocks/attn/q_norm/scale": ADAMW, "blocks/attn/kv_norm/scale": ADAMW,
}


def abstract_params(*overrides: str):
    cfg = load_config("configs/tiny_test.yaml", ["train.optimizer=muon", *overrides])
    return cfg, nnx.split(nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0))))[1]


def axes_by_name(weight, dims) -> tuple:
    """(batch, reduction, output axes) of a weight, each axis by its logical name, or its size where it has none."""
    shape, names = weight.get_value().shape, weight.get_metadata()["out_sharding"]
    reduction = sorted(a % len(shape) for a in dims.reduction_axis)
    output = sorted(a % len(shape) for a in dims.output_axis)
    batch = [a for a in range(len(shape)) if a not in reduction + output]
    return tuple(tuple(names[a] or str(shape[a]) for a in axes) for axes in (batch, reduction, output))


def muon_table(cfg, params) -> dict:
    """path -> (batch, reduction, output axes) or ADAMW, from jaxpar's dimension numbers."""
    numbers = dimension_numbers(cfg.train)(params)
    return {"/".join(map(str, path)): ADAMW if dims.get_value() is None else axes_by_name(weight, dims.get_value())
            for (path, weight), (_, dims) in zip(nnx.to_flat_state(params), nnx.to_flat_state(numbers))}


@pytest.mark.parametrize("overrides, expected", [([], DENSE_TABLE), (MOE, MOE_TABLE), (MLA, MLA_TABLE)],
                         ids=["dense", "moe", "mla"])
def test_dimension_numbers_follow_each_weights_role(overrides, expected):
    table = muon_table(*abstract_params(*overrides))
    print("\n".join(f"{path:36s} " + (row if row == ADAMW else
                                      "batch {} | reduction {} | output {}".format(*map(",".join, row)))
                    for path, row in table.items()))
    assert table == expected


# ---------------------------------------------------------------- one step against numpy

NS_COEFFS, BETA, RMS, B1, B2, EPS = (3.4445, -4.7750, 2.0315), 0.95, 0.2, 0.9, 0.95, 1e-8
# how this test reads each Muon weight of the model below as a stack of matrices:
# (batch axes, rows: what the layer contracts with its input, columns: what it produces)
MATRICES = {"w_qkv": ((0, 2), (1,), (3, 4)), "wo": ((0,), (1, 2), (3,)), "w_gate_up": ((0, 2), (1,), (3,)),
            "w_down": ((0,), (1,), (2,))}


def newton_schulz(m: np.ndarray) -> np.ndarray:
    """Muon's quintic Newton-Schulz iteration, 5 steps, on the wider orientation of one matrix."""
    wide = m.T if m.shape[0] > m.shape[1] else m
    x = wide / (np.linalg.norm(wide) + 1e-8)
    a, b, c = NS_COEFFS
    for _ in range(5):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if m.shape[0] > m.shape[1] else x


def orthogonalised(m: np.ndarray, axes) -> np.ndarray:
    batch, rows, cols = axes
    order = (*batch, *rows, *cols)
    moved = m.transpose(order)
    n_rows, n_cols = math.prod(m.shape[a] for a in rows), math.prod(m.shape[a] for a in cols)
    out = np.stack([newton_schulz(x) for x in moved.reshape(-1, n_rows, n_cols)])
    return out.reshape(moved.shape).transpose(np.argsort(order)) * RMS * math.sqrt(max(n_rows, n_cols))


def numpy_steps(params: dict, grads: list[dict], lrs: list[float], wd: float, clip: float) -> dict:
    """Muon (Nesterov momentum) on MATRICES' weights, AdamW (decay on 2-D weights) on the rest, after clipping."""
    mu = {k: np.zeros_like(v) for k, v in params.items()}
    nu = {k: np.zeros_like(v) for k, v in params.items()}
    params = dict(params)
    for t, (g, lr) in enumerate(zip(grads, lrs), start=1):
        norm = math.sqrt(sum(float(np.sum(x * x)) for x in g.values()))
        g = {k: x * min(1.0, clip / norm) for k, x in g.items()}
        for k, p in params.items():
            name = k.split("/")[-1]
            if name in MATRICES:
                mu[k] = BETA * mu[k] + (1 - BETA) * g[k]
                nesterov = BETA * mu[k] / (1 - BETA ** (t + 1)) + (1 - BETA) * g[k] / (1 - BETA ** t)
                update = orthogonalised(nesterov, MATRICES[name]) + wd * p
            else:
                mu[k] = B1 * mu[k] + (1 - B1) * g[k]
                nu[k] = B2 * nu[k] + (1 - B2) * g[k] ** 2
                update = (mu[k] / (1 - B1 ** t)) / (np.sqrt(nu[k] / (1 - B2 ** t)) + EPS)
                update = update + (wd * p if p.ndim - ("blocks" in k) >= 2 else 0)
            params[k] = p - lr * update
    return params


def flat(tree) -> dict:
    return {"/".join(path_names(p)): np.asarray(v.get_value(), np.float64)
            for p, v in jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_variable)}


def test_two_steps_match_a_numpy_muon():
    cfg = load_config("configs/tiny_test.yaml", ["train.optimizer=muon", "model.mlp=swiglu",
                                                 "model.tie_embeddings=false", "train.warmup=0", "train.steps=10",
                                                 "train.lr=0.02", "train.weight_decay=0.1", "train.clip_norm=30"])
    params = nnx.state(Transformer(cfg.model, rngs=nnx.Rngs(0)))
    assert {k.split("/")[-1] for k in flat(params)} == {*MATRICES, "scale", "embedding", "head"}
    rng = np.random.default_rng(0)
    grads = [jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), params) for _ in range(2)]
    tx = make_optimizer(cfg.train)
    state, new, update = tx.init(params), params, jax.jit(tx.update)
    for g in grads:
        updates, state = update(g, state, new)
        new = jax.tree.map(lambda p, u: p + u, new, updates)
    peak = cfg.train.lr
    lrs = [peak, peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 10)))]
    expected = numpy_steps(flat(params), [flat(g) for g in grads], lrs, 0.1, 30.0)
    start, got = flat(params), flat(new)
    # the change of every weight to 1e-5 of its largest element (fp32 against numpy's float64)
    for path, want in expected.items():
        change, want_change = got[path] - start[path], want - start[path]
        assert np.max(np.abs(change - want_change)) <= 1e-5 * np.max(np.abs(want_change)), path


# ---------------------------------------------------------------- the state's sharding

def moments(trainer) -> dict:
    """(moment, weight path) -> (partition spec, bytes a device holds) of that moment of that weight in the
    optimizer state."""
    found = {}
    shapes = flat_by_path(trainer.abstract_state().opt_state)
    for key, sharding in flat_by_path(trainer.state_shardings.opt_state).items():
        parts, shape = key.split("/"), shapes[key]
        for moment in {"mu", "nu"} & set(parts):
            held = math.prod(sharding.shard_shape(shape.shape)) * shape.dtype.itemsize
            found[moment, "/".join(parts[parts.index(moment) + 1:-1])] = (sharding.spec, held)
    return found


def opt_state_bytes(trainer) -> int:
    return shard_bytes(trainer.abstract_state().opt_state, trainer.state_shardings.opt_state)


@pytest.mark.parametrize("layout", [[f"parallel.zero={zero}", "mesh.data=4", "mesh.tensor=2"] for zero in range(4)]
                         + [["mesh.data=2", "mesh.stage=4", "parallel.zero=1"]],
                         ids=[f"data=4 x tensor=2, zero {zero}" for zero in range(4)] + ["data=2 x stage=4, zero 1"])
def test_state_is_sharded_like_adamws_with_one_moment_a_matrix(layout, session_for):
    adamw, muon = (Trainer(session_for(*SMALL_MODEL, f"train.optimizer={opt}", *layout))
                   for opt in ("adamw", "muon"))
    matrices = {path for path, row in muon_table(muon.cfg, adamw.abstract_params).items() if row != ADAMW}
    adamw_moments, muon_moments = moments(adamw), moments(muon)
    # Muon's momentum for every weight, Adam's second moment for the others, each sharded as AdamW's
    assert set(muon_moments) == set(adamw_moments) - {("nu", path) for path in matrices}
    assert all(held == adamw_moments[key] for key, held in muon_moments.items())
    dropped = sum(adamw_moments["nu", path][1] for path in matrices)
    # beside the moments, 4 more step counts (int32) and the 3 Newton-Schulz coefficients (fp32)
    assert opt_state_bytes(muon) == opt_state_bytes(adamw) - dropped + 4 * 4 + 3 * 4


# ---------------------------------------------------------------- layouts against one device

# the acceptance's two layouts, then the other places an optimizer is built: the offloaded update (layer by
# layer: Muon treats each layer's slice alone), local SGD (a Muon state per replica) and 2BW's stale weights
LAYOUTS = {
    "data=4 x tensor=2, zero 3": ["mesh.data=4", "mesh.tensor=2", "parallel.zero=3"],
    "data=2 x stage=4, 1f1b": ["mesh.data=2", "mesh.stage=4", "parallel.pipeline.schedule=1f1b"],
    "data=4 x tensor=2, zero 1, optimizer offload": ["mesh.data=4", "mesh.tensor=2", "parallel.zero=1",
                                                     "train.offload=optimizer"],
    "data=4 x tensor=2, local SGD": ["mesh.data=4", "mesh.tensor=2", "parallel.sync_every=2", "train.steps=4"],
    "data=2 x stage=4, 2bw": ["mesh.data=2", "mesh.stage=4", "parallel.pipeline.schedule=2bw", "train.steps=6"],
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_verify_matches_one_device_at_fp32(layout, tmp_path, capsys):
    code = main(["verify", *SMALL_MODEL, *LAYOUTS[layout], "train.optimizer=muon", f"run.dir={tmp_path}"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and result["ok"] and "muon" in result["layout"], result
    assert result["loss_max_rel_err"] <= 1e-5 and result["param_max_rel_err"] <= 1e-4, result


@pytest.mark.slow
def test_a_run_resumed_from_a_checkpoint_continues_exactly(capsys, tmp_path):
    assert resumed_run_matches(capsys, tmp_path, ["train.optimizer=muon"], steps=6, cut=3)


# ---------------------------------------------------------------- what Muon refuses

@pytest.mark.parametrize("command", ["train", "verify"])
@pytest.mark.parametrize("overrides, message", [
    (["train.muon_weights=w_qkv,attn_norm/scale"],
     "train.muon_weights names blocks/attn_norm/scale of shape (2, 64), which Muon cannot treat as a matrix"),
    (["model.qkv_bias=true", "train.muon_weights=b_qkv"],
     "train.muon_weights names blocks/attn/b_qkv of shape (2, 3, 4, 16), which Muon cannot treat as a matrix"),
    (["train.muon_weights=w_qvk"], "train.muon_weights names 'w_qvk', which is no weight of this model"),
    (["train.optimizer=adamw", "train.muon_weights=wo"],
     "train.muon_weights picks Muon's matrices, so it needs train.optimizer=muon (got adamw)."),
    (["model.lora.rank=4"], "train.optimizer=muon orthogonalises whole weight matrices, and model.lora trains"),
], ids=["norm scale", "bias", "no such weight", "weights without muon", "lora"])
def test_a_weight_muon_cannot_take_exits_2_before_compiling(command, overrides, message, tmp_path, capsys):
    run_dir = tmp_path / "run"
    code = main([command, "configs/tiny_test.yaml", "train.optimizer=muon", *overrides, f"run.dir={run_dir}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("jaxpar: error: ") and err.endswith(".")
    assert message in err
    assert not run_dir.exists()
