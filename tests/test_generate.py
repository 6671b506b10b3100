"""Generation with the latent KV cache: incremental decoding equals the full forward, greedy equals
transformers' generate, fixed shapes (no recompilation), sharded == single device, bad inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k2jax import K2Config, K2Model, abstract_params, generate
from k2jax.inference.cache import cache_bytes, cache_shapes
from k2jax.inference.generate import PAD_ID, bucket_length
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


def test_incremental_decoding_reproduces_full_forward(model_params):
    model, params = model_params
    cont = np.asarray(jax.random.randint(jax.random.PRNGKey(5), (len(PROMPTS), 5), 0, TINY.vocab_size))
    T, S = 16, 16 + 5
    toks = np.zeros((len(PROMPTS), T), np.int32)
    start = np.array([T - len(p) for p in PROMPTS])
    for b, p in enumerate(PROMPTS):
        toks[b, start[b]:] = p
    pos = np.maximum(np.arange(T)[None] - start[:, None], 0)
    prefill = jax.jit(lambda p, t, q, v: model.apply({"params": p}, t, q, v, method=K2Model.prefill))
    decode = jax.jit(lambda p, t, q, v, c, i: model.apply({"params": p}, t, q, v, c, i, method=K2Model.decode))
    logits, entries = prefill(params, toks, pos, np.arange(T)[None] >= start[:, None])
    cache = jax.tree.map(lambda x: jnp.pad(x, [(0, 0), (0, 0), (0, S - T), (0, 0)]), entries)
    steps = [logits]
    valid = np.arange(S)[None] >= start[:, None]
    for i in range(cont.shape[1]):
        step, cache = decode(params, cont[:, i:i + 1], (T - start + i)[:, None], valid, cache, T + i)
        steps.append(step[:, 0])
    full = _full_logits(model, params, [p + list(c) for p, c in zip(PROMPTS, cont)])
    for b, p in enumerate(PROMPTS):
        want = full[b, len(p) - 1:len(p) + cont.shape[1]]
        got = np.stack([s[b] for s in steps])
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


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


def test_cache_holds_only_latents():
    B, T, S = 2, 5, 12
    model = K2Model(TINY, jnp.bfloat16)
    params = abstract_params(TINY, jnp.bfloat16)
    tok, pos = jax.ShapeDtypeStruct((B, T), jnp.int32), jax.ShapeDtypeStruct((B, T), jnp.int32)
    _, entries = jax.eval_shape(lambda p, t, q: model.apply({"params": p}, t, q, jnp.ones((B, T), bool),
                                                            method=K2Model.prefill), params, tok, pos)
    R, P = TINY.kv_lora_rank, TINY.qk_rope_head_dim
    nd, nm = TINY.num_dense_layers, TINY.num_moe_layers
    assert jax.tree.map(lambda x: (x.shape, x.dtype), entries) == {
        "dense_layers": {"ckv": ((nd, B, T, R), jnp.bfloat16), "k_pe": ((nd, B, T, P), jnp.bfloat16)},
        "moe_layers": {"ckv": ((nm, B, T, R), jnp.bfloat16), "k_pe": ((nm, B, T, P), jnp.bfloat16)}}
    cache = cache_shapes(TINY, B, S, jnp.bfloat16)
    _, new_cache = jax.eval_shape(
        lambda p, t, q, c: model.apply({"params": p}, t, q, jnp.ones((B, S), bool), c, 3, method=K2Model.decode),
        params, tok, pos, cache)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), new_cache) == jax.tree.map(lambda x: (x.shape, x.dtype), cache)
    kimi = K2Config.from_hf_config(CONFIGS / "kimi_k2.json")
    assert cache_bytes(kimi, 1, 1) == 61 * 576 * 2  # per token: 576 bf16 values per layer, nothing per head


def test_no_compilation_after_first_step_or_for_prompts_in_the_bucket(model_params):
    model, params = model_params
    events = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        seen = []
        generate(model, params, PROMPTS, NEW, on_token=lambda t, a: seen.append(len(events)))
        assert len(seen) == NEW and len(set(seen)) == 1, f"compilations during decoding: {seen}"
        before = len(events)
        # Other prompt lengths in the same bucket, other sampling settings and seed: nothing compiles.
        other = [list(range(1, 15)), [9, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
        assert bucket_length(14) == bucket_length(11)
        generate(model, params, other, NEW, temperature=0.7, top_k=20, top_p=0.9, seed=1, stop_tokens=[3])
        assert len(events) == before, f"{len(events) - before} compilations for new prompts in the bucket"
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


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


def test_sharded_generation_equals_single_device(model_params):
    from k2jax.placement import param_shardings
    from k2jax.sharding import make_mesh

    model, params = model_params
    mesh = make_mesh("expert=4,data=2")
    sharded = jax.device_put(params, param_shardings(TINY, mesh))
    want, want_len = generate(model, params, PROMPTS, NEW)
    got, got_len = generate(model, sharded, PROMPTS, NEW, mesh=mesh)  # 3 prompts: a filler row makes 4
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
    """`k2jax generate --hf-checkpoint [--quant int4]` on one CPU device serves the split experts layout: same
    tokens as generate() on the stacked params (with --quant int4: the FP8 experts requantized to INT4)."""
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
