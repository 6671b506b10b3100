"""The engine's settings (k2jax.runtime.settings.EngineConfig): made from serve's flags as one typed value,
and checked when made, naming the bad setting. No jax, no model."""

import argparse

import pytest

from k2jax.runtime.settings import EngineConfig
from k2jax.serving.server import add_arguments, engine_config


def _flags(*argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["--demo", *argv])


def test_serve_flags_become_one_engine_config():
    c = engine_config(_flags("--max-batch", "4", "--max-len", "300", "--prefill-chunk", "64", "--page-size", "16",
                             "--no-prefix-cache", "--batch-wait-ms", "5", "--fixed-chunks", "--step-layout",
                             "ragged", "--speculative", "ngram", "--num-speculative-tokens", "3",
                             "--kv-cache-dtype", "float8"))
    assert c == EngineConfig(max_batch=4, max_len=300, prefill_chunk=64, page_size=16, prefix_cache=False,
                             batch_wait_s=0.005, stall_bound=False, ragged=True, speculative="ngram",
                             num_speculative_tokens=3, kv_cache_dtype="float8", prompt_lookup=c.prompt_lookup)
    defaults = engine_config(_flags())
    assert defaults.ragged is True and defaults.speculative is None and defaults.prefix_cache and defaults.overlap
    assert engine_config(_flags("--step-layout", "rectangular")).ragged is False
    assert engine_config(_flags("--no-overlap")).overlap is False


@pytest.mark.parametrize("bad,match", [
    (dict(max_batch=0), r"max_batch \(0\)"),
    (dict(max_len=1), r"max_len \(1\)"),
    (dict(prefill_chunk=0), r"prefill_chunk \(0\)"),
    (dict(page_size=0), r"page_size \(0\)"),
    (dict(kv_tokens=0), "kv_tokens must be >= 1"),
    (dict(speculative="ngram", num_speculative_tokens=17), "num_speculative_tokens must be in"),
    (dict(speculative="ngram", num_speculative_tokens=2, ragged=False), "needs ragged steps"),
])
def test_bad_settings_are_refused_by_name(bad, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**bad)


def test_replace_checks_again_and_keeps_the_rest():
    c = EngineConfig(max_batch=3)
    assert c.replace(max_len=99) == EngineConfig(max_batch=3, max_len=99)
    with pytest.raises(ValueError, match="max_batch"):
        c.replace(max_batch=-1)
