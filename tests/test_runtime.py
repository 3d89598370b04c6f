"""Runtime defaults that depend on the host: XLA's recommended GPU flags."""

from jaxpar import runtime


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
