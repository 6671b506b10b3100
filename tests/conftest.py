"""Test set-up: 8 simulated CPU devices (set before jax is imported) and shared fixtures."""

import os
import pathlib

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import pytest  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"


@pytest.fixture(scope="session")
def repo():
    return REPO
