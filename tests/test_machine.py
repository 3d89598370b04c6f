"""The machine record every speed figure carries (jaxpar.runtime.machine), and MFU against it."""

import jax
import pytest

from jaxpar.config import Config
from jaxpar.runtime import machine
from jaxpar.train.model_flops import active_params, flops_per_token, utilization


def test_the_record_names_the_processor_native_bf16_and_measured_rates(monkeypatch):
    monkeypatch.setattr(machine, "MATMUL_SIZE", 128)  # the fields, not the figure: a small matmul
    record = machine.describe(jax.devices(), ("float32", "bfloat16"))
    assert record["processor"] == machine.processor() and record["cores"] >= 1
    assert record["platform"] == "cpu" and record["devices"] == 8 and record["native_bf16"] in (True, False)
    assert set(record["matmul_flops"]) == {"float32", "bfloat16"} and min(record["matmul_flops"].values()) > 0
    words = machine.line(record)
    assert words.startswith(f"{record['processor']}, {record['cores']} cores, ") and "128^3 matmul: fp32 " in words


@pytest.mark.parametrize("flags, native", [({"avx2", "fma"}, False), ({"avx512f", "avx512_bf16"}, True),
                                           ({"amx_bf16", "amx_tile"}, True), (None, None)])
def test_native_bf16_is_read_from_the_cpu_flags(monkeypatch, flags, native):
    monkeypatch.setattr(machine, "cpu_flags", lambda: flags)
    assert machine.native_bf16() is native


def test_cpu_mfu_is_model_flops_over_the_measured_rate_of_the_compute_dtype():
    cfg = Config()
    record = {"matmul_flops": {"float32": 1e11, "bfloat16": 4e10}, "matmul_size": 2048}
    found = utilization(cfg, 5000.0, jax.devices(), "bfloat16", record)
    assert found["mfu"] == pytest.approx(flops_per_token(cfg) * 5000.0 / 4e10)
    assert found["peak_flops"] == 4e10 and found["peak_source"] == "measured 2048^3 bfloat16 matmul"
    assert utilization(cfg, 5000.0, jax.devices(), "float16", record)["mfu"] is None  # no rate measured for it


def test_model_flops_leave_out_an_untied_input_embedding():
    """An untied head multiplies as the tied embedding does; the untied input embedding is looked up, so
    the model FLOPs are the same (counting its 6 x V x D, as 6 x all parameters would, inflates MFU)."""
    tied, untied = Config(), Config().replace(**{"model.tie_embeddings": False})
    m = tied.model
    assert active_params(untied) - active_params(tied) == m.d_model * m.padded_vocab
    assert flops_per_token(untied) == flops_per_token(tied)


def test_a_windowed_layer_counts_the_keys_it_sees_in_the_model_flops():
    """6N + 12 H Q x (the keys each layer attends to): seq_len for a global layer, the window for a local one."""
    full = Config().replace(**{"model.seq_len": 128, "model.n_layers": 4})
    windowed = full.replace(**{"model.window": 32, "model.attention_pattern": "lg"})
    m = full.model
    assert flops_per_token(full) - flops_per_token(windowed) == 12 * m.n_heads * m.head_size * 2 * (128 - 32)
