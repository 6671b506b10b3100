"""Generation over the paged latent cache: greedy equals the full forward's argmax and transformers'
generate, fixed shapes (no recompilation), sharded == single device, bad inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k2jax import K2Config, K2Model, generate
from k2jax.runtime.generate import PAD_ID, bucket_length
from k2jax.runtime import compiles
from k2jax.testing import random_params
from tests.conftest import CONFIGS

TINY = K2Config.from_hf_config(CONFIGS / "tiny.json")
PROMPTS = [[5, 6, 7], list(range(20, 31)), [42]]  # lengths 3, 11, 1: one bucket of 16
NEW = 6  # every generate call here uses (3 prompts, bucket 16, NEW tokens): compiled once for the module


@pytest.fixture(scope="module")
def model_params():
    return K2Model(TINY), random_params(TINY)


def _full_logits(model, params, seqs):
    """K2Model.apply over each whole sequence (right-padded into one batch; causality keeps the pads out)."""
    T = max(len(s) for s in seqs)
    toks = np.zeros((len(seqs), T), np.int32)
    for b, s in enumerate(seqs):
        toks[b, :len(s)] = s
    return np.asarray(jax.jit(model.apply)({"params": params}, jnp.asarray(toks)))


def test_greedy_generate_is_argmax_of_full_forward(model_params):
    model, params = model_params
    tokens, lengths = generate(model, params, PROMPTS, NEW)
    assert tokens.shape == (3, NEW) and tokens.dtype == np.int32 and list(lengths) == [NEW] * 3
    full = _full_logits(model, params, [p + list(t) for p, t in zip(PROMPTS, tokens)])
    for b, p in enumerate(PROMPTS):
        np.testing.assert_array_equal(tokens[b], full[b, len(p) - 1:len(p) - 1 + NEW].argmax(-1))
    # A prompt's output does not depend on the others in its batch (nor on their padding).
    alone, _ = generate(model, params, [PROMPTS[1], PROMPTS[1], PROMPTS[1]], NEW)
    np.testing.assert_array_equal(alone[0], tokens[1])


def test_greedy_equals_transformers_generate(tmp_path, oracle):
    import k2jax

    prompts = [[3, 1, 4, 1, 5], list(range(100, 112)), [7, 7]]
    want = oracle.run({"config": TINY.to_hf_config(), "seed": 11, "save": {"dir": str(tmp_path), "format": "hf"},
                       "generate": {"prompts": prompts, "max_new_tokens": NEW}})
    cfg, params = k2jax.load_hf(tmp_path)
    assert cfg == TINY
    tokens, lengths = generate(K2Model(cfg), params, prompts, NEW)
    for j in range(len(prompts)):
        np.testing.assert_array_equal(tokens[j], want[f"generate.{j}"])


def test_no_compilation_after_first_step_or_for_prompts_in_the_bucket(model_params):
    model, params = model_params
    compiles.install()
    seen = []
    generate(model, params, PROMPTS, NEW, on_token=lambda t, a: seen.append(compiles.count()))
    assert len(seen) == NEW and len(set(seen)) == 1, f"compilations during decoding: {seen}"
    before = compiles.count()
    # Other prompt lengths in the same bucket, other sampling settings and seed: nothing compiles.
    other = [list(range(1, 15)), [9, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    assert bucket_length(14) == bucket_length(11)
    generate(model, params, other, NEW, temperature=0.7, top_k=20, top_p=0.9, seed=1, stop_tokens=[3])
    assert compiles.count() == before, f"{compiles.count() - before} compilations for new prompts in the bucket"


def test_stop_tokens_and_sampling(model_params):
    model, params = model_params
    greedy, _ = generate(model, params, PROMPTS, NEW)
    stop = int(greedy[0, 2])
    tokens, lengths = generate(model, params, PROMPTS, NEW, stop_tokens=[stop])
    for b in range(3):
        hits = np.flatnonzero(greedy[b] == stop)
        n = hits[0] + 1 if hits.size else NEW
        assert lengths[b] == n
        np.testing.assert_array_equal(tokens[b, :n], greedy[b, :n])
        assert (tokens[b, n:] == PAD_ID).all()
    a = generate(model, params, PROMPTS, NEW, temperature=1.0, top_p=0.95, seed=3)[0]
    b = generate(model, params, PROMPTS, NEW, temperature=1.0, top_p=0.95, seed=3)[0]
    c = generate(model, params, PROMPTS, NEW, temperature=1.0, top_p=0.95, seed=4)[0]
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    # top_k=1 and a tiny top_p both leave only the most likely token: greedy.
    np.testing.assert_array_equal(generate(model, params, PROMPTS, NEW, temperature=2.0, top_k=1, seed=5)[0], greedy)
    np.testing.assert_array_equal(generate(model, params, PROMPTS, NEW, temperature=2.0, top_p=1e-6)[0], greedy)


@pytest.mark.parametrize("spec", ["expert=8", "expert=4,tensor=2", "data=2,expert=4"])
@pytest.mark.parametrize("prompts", [PROMPTS + [[9, 9], [4], [8, 1, 2], [3, 3, 3], [7]], PROMPTS])
def test_sharded_generation_equals_single_device(model_params, spec, prompts):
    """Rows (and their pages) split over the batch's mesh axes where they divide the batch (8 prompts), and
    replicated where they do not (3): the same tokens as one device."""
    from k2jax.placement import param_shardings
    from k2jax.sharding import make_mesh

    model, params = model_params
    mesh = make_mesh(spec)
    sharded = jax.device_put(params, param_shardings(TINY, mesh, warn=False))
    want, want_len = generate(model, params, prompts, NEW)
    got, got_len = generate(model, sharded, prompts, NEW, mesh=mesh)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_len, want_len)


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompts=[]), "prompts is empty"),
    (dict(prompts=[[1, 2], []]), "prompt 1 is empty"),
    (dict(prompts=[[1, 256]]), "token id 256 is outside the vocabulary"),
    (dict(prompts=[[-1]]), "token id -1 is outside the vocabulary"),
    (dict(prompts=[list(range(10))], max_len=8), "longer than the cache"),
    (dict(prompts=[list(range(10))], max_len=12), "does not fit the cache"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_k=0), "top_k"),
    (dict(top_p=1.5), "top_p"),
    (dict(stop_tokens=[999]), "stop_tokens"),
])
def test_bad_inputs_raise(kwargs, match):
    args = dict(prompts=[[1, 2, 3]], max_new_tokens=4) | kwargs
    with pytest.raises(ValueError, match=match):
        generate(K2Model(TINY), {}, args.pop("prompts"), args.pop("max_new_tokens"), **args)


@pytest.mark.parametrize("quant", [None, "int4"])
def test_generate_command_on_one_device(tmp_path, quant):
    """`k2jax generate --hf-checkpoint [--quant int4]` on one CPU device: the same tokens as generate() on the
    loaded params (with --quant int4: the FP8 experts requantized to INT4)."""
    import subprocess
    import sys

    import k2jax
    from k2jax.testing import write_release_checkpoint

    cfg = TINY.replace(num_hidden_layers=4)
    src = write_release_checkpoint(cfg, tmp_path / "hf", seed=3)
    prompt = PROMPTS[1]
    p = subprocess.run([sys.executable, "-m", "k2jax.cli", "generate", "--hf-checkpoint", str(src), "--dtype",
                        "float32", "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", str(NEW),
                        "--no-stop"] + (["--quant", quant] if quant else []), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    _, params = k2jax.load_hf(src, dtype=jnp.float32, quant=quant)
    want, _ = generate(K2Model(cfg), params, [prompt], NEW)
    assert ",".join(map(str, want[0])) in p.stdout.splitlines(), p.stdout
