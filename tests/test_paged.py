"""The paged latent cache (k2jax.ops.paged) against the plain forward over whole sequences: each row reads
and writes at its own positions, whatever its length and however its tokens are split into steps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k2jax import K2Config, K2Model, init_params
from k2jax.runtime.cache import init_cache, kv_bytes_per_token, pool_shapes
from k2jax.ops.attention import absorbed_is_cheaper
from k2jax.placement import param_shardings
from k2jax.sharding import make_mesh, use_mesh
from tests.conftest import CONFIGS

TINY = K2Config.from_hf_config(CONFIGS / "tiny.json")
PAGE = 8


@pytest.fixture(scope="module")
def model_params():
    return K2Model(TINY), init_params(TINY)


@pytest.fixture(scope="module")
def step(model_params):
    model, _ = model_params
    return jax.jit(lambda p, t, m, c: model.apply({"params": p}, t, None, m, c), donate_argnums=(3,))


def _reference(model, params, tokens_BT):
    """Logits of the plain forward (the whole [T, T] attention, no cache) over whole sequences."""
    return np.asarray(jax.jit(lambda p, t: model.apply({"params": p}, t, method=K2Model.reference))(params, tokens_BT))


def _chunked(step, params, tokens_BT, chunks, lens=None, kv_dtype="float32"):
    """Feed each row its tokens in chunks of the given sizes (row b feeds only its first lens[b] tokens; the
    rest of a chunk is padding): -> logits [B, T, V] at the fed positions, the final cache."""
    B, T = tokens_BT.shape
    lens = np.full(B, T) if lens is None else np.asarray(lens)
    cache = init_cache(TINY, B, T + PAGE, kv_dtype, page_size=PAGE)
    out = np.zeros((B, T, TINY.vocab_size), np.float32)
    pos = 0
    for n in chunks:
        real = np.clip(lens - pos, 0, n)
        mask = np.arange(n)[None, :] < real[:, None]
        logits, cache = step(params, tokens_BT[:, pos:pos + n], jnp.asarray(mask), cache)
        out[:, pos:pos + n] = np.asarray(logits)
        pos += n
    return out, cache


# Chunks splitting 40 tokens at one token, a page edge (8), a page plus one (9), and across pages.
@pytest.mark.parametrize("chunks", [[1, 7, 1, 31], [8, 8, 24], [9, 1, 16, 14], [40]])
def test_chunked_rows_of_different_lengths_equal_the_plain_forward(model_params, step, chunks):
    model, params = model_params
    tokens = jax.random.randint(jax.random.PRNGKey(1), (3, 40), 0, TINY.vocab_size)
    lens = np.array([40, 9, 23])
    want = _reference(model, params, tokens)
    got, cache = _chunked(step, params, tokens, chunks, lens)
    for b in range(3):
        np.testing.assert_allclose(got[b, :lens[b]], want[b, :lens[b]], atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(cache.lengths), lens)


def test_decode_rows_at_their_own_positions(model_params, step):
    """One token per row on top of prompts of different lengths: each row's next logits equal the plain
    forward's at its own position (no shared index)."""
    model, params = model_params
    tokens = jax.random.randint(jax.random.PRNGKey(2), (3, 30), 0, TINY.vocab_size)
    lens = np.array([5, 17, 29])
    want = _reference(model, params, tokens)
    cache = init_cache(TINY, 3, 40, "float32", page_size=PAGE)
    _, cache = step(params, tokens[:, :29], jnp.asarray(np.arange(29)[None] < lens[:, None]), cache)
    nxt = jnp.asarray([[int(tokens[b, lens[b]])] for b in range(3)])
    logits, cache = step(params, nxt, jnp.ones((3, 1), bool), cache)
    for b in range(3):
        np.testing.assert_allclose(np.asarray(logits[b, 0]), want[b, lens[b]], atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(cache.lengths), lens + 1)


def test_float8_pages_within_the_float8_tolerance(model_params, step):
    """e4m3 pages with a per-token scale: the logits of later chunks stay within the error measured for the
    float8 cache (a few % of the logits' spread on this config), and are not exact (the pages are e4m3)."""
    model, params = model_params
    tokens = jax.random.randint(jax.random.PRNGKey(3), (2, 40), 0, TINY.vocab_size)
    want = _reference(model, params, tokens)
    got, cache = _chunked(step, params, tokens, [16, 1, 23], kv_dtype="float8")
    assert cache.pages["moe_layers"].dtype == jnp.float8_e4m3fn
    err = np.abs(got[:, 16:] - want[:, 16:]).max()
    assert 0 < err < 0.1 * want.std(), (err, want.std())
    np.testing.assert_allclose(got[:, :16], want[:, :16], atol=1e-5, rtol=1e-5)  # the first chunk reads no pages


@pytest.mark.parametrize("spec, B, cuts", [("expert=8", 8, (9, 10)), ("expert=8", 3, (9, 10)),
                                           ("expert=4,tensor=2", 4, (9, 10)), ("data=2,expert=4", 8, (9, 10)),
                                           ("data=2,expert=4", 1, (9, 10)), ("expert=8", 1, (16, 17))])
def test_sharded_pages_equal_one_device(model_params, spec, B, cuts):
    """On meshes where the batch (and the pool's pages) split over expert, and where they cannot split (the
    rows replicated, the pool read by global page id; a lone row's 16-token chunk split over the devices,
    sequence parallel, its pages written whole by the shard holding them): the same logits as one device."""
    model, params = model_params
    tokens = jax.random.randint(jax.random.PRNGKey(4), (B, 24), 0, TINY.vocab_size)
    want = _reference(model, params, tokens)
    mesh = make_mesh(spec)
    sharded = jax.device_put(params, param_shardings(TINY, mesh, warn=False))
    with use_mesh(mesh):
        cache = init_cache(TINY, B, 32, "float32", page_size=PAGE, mesh=mesh)
        step = jax.jit(lambda p, t, m, c: model.apply({"params": p}, t, None, m, c), donate_argnums=(3,))
        outs = []
        for a, b in ((0, cuts[0]), cuts, (cuts[1], 24)):
            logits, cache = step(sharded, tokens[:, a:b], jnp.ones((B, b - a), bool), cache)
            outs.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(outs, 1), want, atol=1e-5, rtol=1e-5)


def test_cache_holds_only_latents():
    """Per token and layer the pool holds kv_lora_rank + qk_rope_head_dim values, nothing per head."""
    pages, scales = pool_shapes(TINY, 5, PAGE, "bfloat16")
    C = TINY.kv_lora_rank + TINY.qk_rope_head_dim
    assert {g: (x.shape, x.dtype) for g, x in pages.items()} == {
        "dense_layers": ((TINY.num_dense_layers, 5, PAGE, C), jnp.bfloat16),
        "moe_layers": ((TINY.num_moe_layers, 5, PAGE, C), jnp.bfloat16)}
    assert scales == {}
    kimi = K2Config.from_hf_config(CONFIGS / "kimi_k2.json")
    assert kv_bytes_per_token(kimi) == 61 * 576 * 2
    assert kv_bytes_per_token(kimi, "float8") == 61 * (576 + 8)  # e4m3 values and two float32 scales


def test_attention_form_follows_the_shapes():
    """Absorbed attention for decode-sized steps, expanded for prompt chunks, by flops on every backend:
    Kimi K2 (R 512, K = V = 128) switches between 170 and 171 queries, the bench config (R 256, K = V = 64)
    between 85 and 86."""
    assert absorbed_is_cheaper(1, 512, 128, 256) and absorbed_is_cheaper(170, 512, 128, 256)
    assert not absorbed_is_cheaper(171, 512, 128, 256) and not absorbed_is_cheaper(512, 512, 128, 256)
    assert absorbed_is_cheaper(85, 256, 64, 128) and not absorbed_is_cheaper(86, 256, 64, 128)


@pytest.mark.parametrize("quantized", [False, True])
def test_write_pages_equals_writing_each_token(quantized):
    """write_pages (a chunk's tokens, a page at a time) against numpy writing token by token: rows whose
    cache ends mid-page or on a page edge, chunks that fill pages whole, in part (at either end, or one page
    from a page edge), or not at all (count 0),
    pages owned by another part of the pool (trash), and the scales of an e4m3 pool."""
    from k2jax.ops.paged import TRASH_PAGE, write_pages

    rng = np.random.default_rng(0)
    L, Y, C, T, W, first, A = 2, 4, 3, 10, 6, 5, 40
    lengths = np.array([0, 3, 8, 5, 13, 12])
    count = np.array([10, 9, 4, 0, 7, 2])  # the last: a page edge, then part of one page
    B = len(lengths)
    table = (first + rng.permutation(A - 1)[:B * W] + 1).reshape(B, W)
    table[4, 4] = 100  # a page of another part of the pool: its tokens go to the trash page
    pages = rng.normal(size=(L, A, Y, C)).astype(np.float32)
    x = rng.normal(size=(L, B, T, C)).astype(np.float32)
    scales = rng.normal(size=(L, A, 2 * Y)).astype(np.float32) if quantized else None
    s_new = rng.normal(size=(L, B, T, 2)).astype(np.float32) if quantized else None
    want, want_s = pages.copy(), None if scales is None else scales.copy()
    for b in range(B):
        for t in range(count[b]):
            pos = lengths[b] + t
            page = table[b, pos // Y] - first
            if not 0 <= page < A:
                continue
            want[:, page, pos % Y] = x[:, b, t]
            if quantized:
                want_s[:, page, pos % Y] = s_new[:, b, t, 0]
                want_s[:, page, Y + pos % Y] = s_new[:, b, t, 1]
    args = (first, jnp.asarray(table), jnp.asarray(lengths), jnp.asarray(count), jnp.asarray(x), jnp.asarray(pages))
    got = jax.jit(write_pages)(*args, *((jnp.asarray(scales), jnp.asarray(s_new)) if quantized else ()))
    keep = np.arange(A) != TRASH_PAGE
    np.testing.assert_array_equal(np.asarray(got[0])[:, keep], want[:, keep])
    if quantized:
        np.testing.assert_array_equal(np.asarray(got[1])[:, keep], want_s[:, keep])
