"""Runtime defaults that depend on the host (XLA's recommended GPU flags), and run.devices against the
devices found."""

import pytest

from jaxpar.config import ConfigError
from jaxpar.runtime import devices as runtime
from jaxpar.runtime.devices import check_device_count


def test_gpu_host_gets_the_latency_hiding_scheduler_unless_the_user_set_xla_flags(monkeypatch):
    monkeypatch.setattr(runtime, "has_accelerator_plugin", lambda plugins=(): set(plugins) == set(runtime._GPU_PLUGINS))
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    runtime._default_gpu_flags()
    assert runtime.os.environ["XLA_FLAGS"] == "--xla_gpu_enable_latency_hiding_scheduler=true"
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/mine")
    runtime._default_gpu_flags()
    assert runtime.os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/mine"  # the user's flags win, whole


def test_no_gpu_flags_without_a_gpu_plugin(monkeypatch):
    monkeypatch.setattr(runtime, "has_accelerator_plugin", lambda plugins=(): False)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    runtime._default_gpu_flags()
    assert "XLA_FLAGS" not in runtime.os.environ


def test_a_multi_process_run_uses_every_device_it_finds():
    check_device_count(None, 16, "cpu", processes=2)
    check_device_count(16, 16, "cpu", processes=2)
    with pytest.raises(ConfigError, match=r"^run.devices=8 but a multi-process run uses all 16 devices of its 2 "
                                          r"processes; leave run.devices=auto.$"):
        check_device_count(8, 16, "cpu", processes=2)
    check_device_count(8, 16, "gpu", processes=1)  # one process may take fewer
