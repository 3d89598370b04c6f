"""Test setup: 8 emulated CPU devices, set before jax is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import pytest  # noqa: E402

from jaxpar.config import load_config  # noqa: E402


@pytest.fixture
def session_for(tmp_path):
    """Build a prepared Session from key=value overrides (run.dir inside tmp_path)."""
    from jaxpar.session import prepare

    def build(*overrides: str):
        return prepare(load_config(None, [f"run.dir={tmp_path / 'run'}", *overrides]))

    return build
