"""Test set-up: 8 simulated CPU devices (set before jax is imported) and shared fixtures."""

import os
import pathlib

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# The simulated devices are CPU ones; the test environment also has libtpu (for the TPU compile checks), which
# without this would try to start a TPU in every process (and log warnings when there is none).
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"


def flat(tree) -> dict:
    """A pytree's leaves by their key path, for comparing trees leaf by leaf with a readable name."""
    import jax

    return {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(tree)}


# XLA:CPU workaround: a test worker died in native code on the training step (k2jax.train, jit name "step") of
# test_train_masks, after the worker's earlier files: once reading its executable from jax's persistent cache
# (deserialize_executable), once writing it there (executable.serialize), once compiling it; never when the
# file ran alone. tests/run.sh runs each file in a fresh process (tests/run_files.py), and the training steps'
# programs are neither written to the cache nor, once tests/run.sh has removed what earlier runs wrote
# ("jit_step-*"), read from it: they compile afresh each run (about a minute in all).
TRAIN_FILES = ("test_train.py", "test_train_masks.py")


@pytest.fixture(autouse=True, scope="module")
def _no_persistent_cache_for_train_steps(request):
    if pathlib.Path(str(request.fspath)).name not in TRAIN_FILES:
        yield
        return
    import jax

    before = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)  # jax writes no program quicker
    try:
        yield
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before)


@pytest.fixture(scope="session")
def repo():
    return REPO


@pytest.fixture(scope="session")
def oracle():
    """The transformers reference (tests/oracle), one process for the whole run. Skipped when it is not
    installed, unless K2JAX_REQUIRE_ORACLE=1 (CI), where a missing oracle is an error."""
    from tests.oracle.client import Oracle, require_oracle

    o = require_oracle()
    if o is None:
        pytest.skip(Oracle.unavailable_reason())
    with o:
        yield o
