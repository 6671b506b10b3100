"""The meshes `plan` recommends split the batch over `expert` (data-parallel attention): on 8 simulated CPU
devices the model's logits, the runtime step's logprobs over the paged cache, and `generate`'s tokens equal
one device's (float32, within 1e-5), for batches the batch axes divide and batches they do not."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k2jax import K2Config, K2Model, generate
from k2jax.runtime.cache import data_shards, init_cache
from k2jax.runtime.runner import Runner, StepShape, host_batch
from k2jax.ops.paged import batch_axes
from k2jax.placement import param_shardings
from k2jax.sharding import make_mesh, use_mesh
from k2jax.testing import random_params
from tests.conftest import CONFIGS

# One dense and one MoE block (each compiles once), 8 experts top-2, vocab 256.
CFG = K2Config.from_hf_config(CONFIGS / "tiny.json").replace(num_hidden_layers=2, first_k_dense_replace=1)
MESHES = ["expert=8", "expert=4,tensor=2", "data=2,expert=4"]
# (mesh, batch, the batch's axes): 8 rows divide every mesh's batch axes; 3 divide none (replicated); 6 on
# data=2,expert=4 split over data only.
CASES = [("expert=8", 8, ("expert",)), ("expert=8", 3, ()),
         ("expert=4,tensor=2", 8, ("expert",)), ("expert=4,tensor=2", 3, ()),
         ("data=2,expert=4", 8, ("data", "expert")), ("data=2,expert=4", 6, ("data",)), ("data=2,expert=4", 3, ())]
MAX_LEN = 32


@pytest.fixture(scope="module")
def params():
    return random_params(CFG, seed=4, scale=0.12)


def prompts(B, seed=0):
    rng = np.random.default_rng(seed + B)
    return [list(rng.integers(2, CFG.vocab_size, size=int(n))) for n in rng.integers(3, 12, size=B)]


def cached_logits(params, tokens, lens, mesh):
    """Prefill (right-padded prompts, logits at each row's last token), then two decode steps feeding the
    argmax: the model over the paged cache -> logits [3, B, V]."""
    model = K2Model(CFG)
    B, T = tokens.shape
    cache = init_cache(CFG, B, MAX_LEN, "float32", page_size=8, mesh=mesh)
    step = jax.jit(lambda p, t, m, c, at: model.apply({"params": p}, t, None, m, c, at))
    out = []
    valid = jnp.arange(T)[None, :] < lens[:, None]
    logits, cache = step(params, tokens, valid, cache, lens - 1)
    out.append(logits)
    for _ in range(2):
        nxt = jnp.argmax(logits, -1).astype(jnp.int32)[:, None]
        logits, cache = step(params, nxt, jnp.ones((B, 1), bool), cache, jnp.zeros(B, jnp.int32))
        out.append(logits)
    return np.stack([np.asarray(x) for x in out])


def padded(B):
    ps = prompts(B)
    T = max(len(p) for p in ps)
    tokens = np.zeros((B, T), np.int32)
    for b, p in enumerate(ps):
        tokens[b, :len(p)] = p
    return jnp.asarray(tokens), jnp.asarray([len(p) for p in ps], jnp.int32)


@pytest.fixture(scope="module")
def references(params):
    """Per batch size: one device's full-forward logits, cached-path logits and greedy tokens."""
    out = {}
    for B in sorted({b for _, b, _ in CASES}):
        tokens, lens = padded(B)
        full = np.asarray(jax.jit(lambda p, t: K2Model(CFG).apply({"params": p}, t))(params, tokens))
        out[B] = full, cached_logits(params, tokens, lens, None), generate(K2Model(CFG), params, prompts(B), 4)
    return out


@pytest.mark.parametrize("spec, B, axes", CASES, ids=[f"{c[0]}-batch{c[1]}" for c in CASES])
def test_logits_on_the_mesh_equal_one_device(params, references, spec, B, axes):
    mesh = make_mesh(spec)
    assert batch_axes(B, mesh) == axes
    sharded = jax.device_put(params, param_shardings(CFG, mesh))
    tokens, lens = padded(B)
    full_ref, cached_ref, (gen_ref, gen_len_ref) = references[B]
    with use_mesh(mesh):
        full = jax.jit(lambda p, t: K2Model(CFG).apply({"params": p}, t))(sharded, tokens)
        cached = cached_logits(sharded, tokens, lens, mesh)
    np.testing.assert_allclose(full, full_ref, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(cached, cached_ref, atol=1e-5, rtol=1e-5)
    got, got_len = generate(K2Model(CFG), sharded, prompts(B), 4, mesh=mesh)
    np.testing.assert_array_equal(got, gen_ref)
    np.testing.assert_array_equal(got_len, gen_len_ref)


@pytest.mark.parametrize("spec", MESHES)
def test_runner_step_logprobs_on_the_mesh_equal_one_device(params, spec):
    """The runtime's step (what generate and the server run): a prefill of 8 rows split over the batch axes,
    then a decode step, and a lone row's decode (replicated): each row's sampled logprob and top logprobs
    (a log-softmax of its logits) equal one device's."""
    B, W, Y = 8, 4, 8
    mesh = make_mesh(spec)

    def run(p, mesh):
        shards = data_shards(mesh, B)  # each shard: its trash page, then W pages per row (as generate lays it out)
        per = B // shards
        runner = Runner(K2Model(CFG), p, slots=B, num_pages=shards * (1 + per * W), page_size=Y, kv_dtype="float32",
                        mesh=mesh)
        assert runner.shards == shards
        table = np.array([[(b // per) * (1 + per * W) + 1 + (b % per) * W + w for w in range(W)] for b in range(B)],
                         np.int32)
        ps = prompts(B, seed=7)
        first = host_batch(StepShape(B, 16, 0, W), CFG.vocab_size)
        for b, q in enumerate(ps):
            first.tokens[b, :len(q)] = q
        lens = np.array([len(q) for q in ps], np.int32)
        first = first.replace(slot=np.arange(B, dtype=np.int32), count=lens, table=table, prompt_len=lens,
                              reset=np.ones(B, bool))
        outs = [runner.step(StepShape(B, 16, 0, W), first)]
        nxt = host_batch(StepShape(B, 1, W, W), CFG.vocab_size).replace(
            slot=first.slot, count=np.ones(B, np.int32), table=table, lengths=lens, prompt_len=lens,
            tokens=np.asarray(outs[0]["tokens"])[:, None])
        outs.append(runner.step(StepShape(B, 1, W, W), nxt))
        lone = host_batch(StepShape(1, 1, W, W), CFG.vocab_size).replace(
            slot=np.array([3], np.int32), count=np.ones(1, np.int32), table=table[3:4], lengths=lens[3:4] + 1,
            prompt_len=lens[3:4], tokens=np.asarray(outs[1]["tokens"])[3:4, None])
        outs.append(runner.step(StepShape(1, 1, W, W), lone))
        return [{k: np.asarray(v) for k, v in o.items()} for o in outs]

    want = run(params, None)
    got = run(jax.device_put(params, param_shardings(CFG, mesh)), mesh)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g["tokens"], w["tokens"])
        np.testing.assert_allclose(g["logprob"], w["logprob"], atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(g["top_logprobs"], w["top_logprobs"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", ["float32", "float8"])
def test_a_tpu_padded_pool_gives_the_same_logits(params, monkeypatch, kv_dtype):
    """On a TPU each token's cache values are padded to a multiple of 128 (k2jax.runtime.cache.lane): the
    model over such a pool (forced here on CPU) equals the unpadded one."""
    from k2jax.runtime import cache as cache_mod
    from k2jax.runtime import runner as runner_mod

    tokens, lens = padded(3)
    model = K2Model(CFG)
    step = jax.jit(lambda p, t, m, c, at: model.apply({"params": p}, t, None, m, c, at))

    def run():
        c = init_cache(CFG, 3, MAX_LEN, kv_dtype, page_size=8)
        valid = jnp.arange(tokens.shape[1])[None, :] < lens[:, None]
        logits, c = step(params, tokens, valid, c, lens - 1)
        nxt = jnp.argmax(logits, -1).astype(jnp.int32)[:, None]
        logits2, c = step(params, nxt, jnp.ones((3, 1), bool), c, jnp.zeros(3, jnp.int32))
        return c, np.stack([logits, logits2])

    plain_cache, want = run()
    assert plain_cache.pad == 0 and plain_cache.pages["moe_layers"].shape[-1] == 24
    gen_want = generate(model, params, prompts(3), 3, kv_cache_dtype=kv_dtype, page_size=16)
    monkeypatch.setattr(cache_mod, "lane", lambda mesh=None: 128)
    monkeypatch.setattr(runner_mod, "lane", lambda mesh=None: 128)
    padded_cache, got = run()
    assert padded_cache.pad == 128 - 24 and padded_cache.pages["moe_layers"].shape[-1] == 128
    np.testing.assert_array_equal(np.asarray(padded_cache.pages["moe_layers"][..., 24:]).astype(np.float32), 0)
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-6)
    # generate's runner (a new one: another page size) over a padded pool
    from k2jax.runtime.generate import _RUNNERS

    gen_got = generate(model, params, prompts(3), 3, kv_cache_dtype=kv_dtype, page_size=32)
    assert [r.pad for k, r in _RUNNERS.items() if k[3] == 32 and k[4] == kv_dtype] == [104]
    np.testing.assert_array_equal(gen_got[0], gen_want[0])
