"""The ragged step (k2jax.ops.ragged, laid out by k2jax.runtime.layout) against the plain model call, row by
row: decoding rows and prompt chunks of any lengths in one flat batch, each over its own cached prefix, give
the logits and the cache the rectangular step with the plain attention gives each row."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k2jax import K2Config, K2Model, init_params
from k2jax.ops.paged import TRASH_PAGE
from k2jax.ops.ragged import RaggedCache
from k2jax.runtime.cache import init_cache
from k2jax.runtime.layout import Feed, RaggedShape, lay_out, place
from tests.conftest import CONFIGS

TINY = K2Config.from_hf_config(CONFIGS / "tiny.json")
PAGE, MAX_LEN = 8, 48

# Per row: (tokens its pages hold, tokens it feeds). A first chunk (13, not a multiple of any block), a decode
# at a page edge (8 held), a later chunk, an empty row, a decode mid-page, a chunk across pages from a page
# edge, one more one-token row (it takes a block when the decode region is full), and a chunk ending at a
# page edge (5 + 11 = 16).
ROWS = [(0, 13), (8, 1), (21, 5), (7, 0), (15, 1), (16, 9), (3, 1), (5, 11)]


@pytest.fixture(scope="module")
def params():
    return init_params(TINY, jax.random.PRNGKey(3))


@pytest.fixture(scope="module")
def tokens():
    return np.asarray(jax.random.randint(jax.random.PRNGKey(4), (len(ROWS), MAX_LEN), 0, TINY.vocab_size))


def _prefixes(params, tokens, kv_dtype, rows=ROWS):
    """A cache whose rows hold their `rows` prefixes, written by the rectangular step."""
    B = len(rows)
    cache = init_cache(TINY, B, MAX_LEN, kv_dtype, page_size=PAGE)
    held = np.array([h for h, _ in rows])
    T = int(held.max())
    mask = np.arange(T)[None, :] < held[:, None]
    _, cache = jax.jit(lambda p, t, m, c: K2Model(TINY).apply({"params": p}, t, None, m, c))(
        params, jnp.asarray(tokens[:, :T]), jnp.asarray(mask), cache)
    return cache


def _plain(params, tokens, cache, rows=ROWS):
    """Each row's new tokens through the rectangular step with the plain attention: logits [B, T, V], cache."""
    held = np.array([h for h, _ in rows])
    fed = np.array([n for _, n in rows])
    T = int(fed.max())
    new = np.stack([tokens[b, held[b]:held[b] + T] for b in range(len(rows))])
    mask = np.arange(T)[None, :] < fed[:, None]
    model = K2Model(TINY, attention="plain")
    return jax.jit(lambda p, t, m, c: model.apply({"params": p}, t, None, m, c))(
        params, jnp.asarray(new), jnp.asarray(mask), cache)


def _feeds(tokens, cache, rows=ROWS):
    table = np.asarray(cache.page_table)
    return {b: Feed(tuple(int(t) for t in tokens[b, h:h + n]), h, tuple(int(p) for p in table[b]))
            for b, (h, n) in enumerate(rows)}


def _ragged_call(params, cache, shape, meta):
    rc = RaggedCache(cache.pages, cache.scales, jnp.asarray(meta["table"]), jnp.asarray(meta["lengths"]),
                     jnp.asarray(meta["row"]), jnp.asarray(meta["pos"]), jnp.asarray(meta["valid"]),
                     TINY.qk_rope_head_dim, shape.decode, shape.block, cache.pad)
    return _RAGGED(params, jnp.asarray(meta["tokens"])[None], jnp.asarray(meta["valid"])[None], rc,
                   jnp.asarray(meta["last"])[None])


_RAGGED = jax.jit(lambda p, t, v, c, at: K2Model(TINY).apply({"params": p}, t, None, v, c, at))


def _shape(decode, block):
    singles = [n for _, n in ROWS if n == 1][decode:]  # one-token rows beyond the decode region take blocks
    blocks = sum(-(-n // block) for _, n in ROWS if n > 1) + len(singles) + 2  # and two padding blocks
    return RaggedShape(decode, blocks, block, len(ROWS), MAX_LEN // PAGE)


@pytest.mark.parametrize("kv_dtype", ["float32", "float8"])
@pytest.mark.parametrize("decode,block", [(2, 4), (0, 1), (3, 16)])
def test_ragged_step_equals_the_plain_call_row_by_row(params, tokens, kv_dtype, decode, block):
    cache = _prefixes(params, tokens, kv_dtype)
    want_logits, want_cache = _plain(params, tokens, cache)
    cache = _prefixes(params, tokens, kv_dtype)  # the plain call donated nothing, but start from a fresh one
    shape = _shape(decode, block)
    meta = lay_out(shape, _feeds(tokens, cache))
    logits, got_cache = _ragged_call(params, cache, shape, meta)
    tol = 1e-5 if kv_dtype == "float32" else 2e-4
    for b, (_, n) in enumerate(ROWS):
        if n:
            np.testing.assert_allclose(np.asarray(logits[0, b]), np.asarray(want_logits[b, n - 1]), atol=tol,
                                       rtol=tol, err_msg=f"row {b}")
    np.testing.assert_array_equal(np.asarray(got_cache.lengths), [h + n for h, n in ROWS])
    for g in want_cache.pages:  # every page but the trash page (padding lands there)
        got, want = np.asarray(got_cache.pages[g], np.float32), np.asarray(want_cache.pages[g], np.float32)
        keep = np.arange(got.shape[1]) != TRASH_PAGE
        np.testing.assert_allclose(got[:, keep], want[:, keep], atol=tol, rtol=tol)
        if kv_dtype == "float8":
            np.testing.assert_allclose(np.asarray(got_cache.scales[g])[:, keep],
                                       np.asarray(want_cache.scales[g])[:, keep], rtol=1e-6)


@pytest.mark.parametrize("kv_dtype", ["float32", "float8"])
@pytest.mark.parametrize("expanded", [False, True], ids=["absorbed_prefix", "expanded_prefix"])
def test_chunk_tiles_skip_earlier_rows(params, tokens, monkeypatch, kv_dtype, expanded):
    """Tiles of 8 new tokens (two blocks of 4): rows span tiles and tiles hold parts of two rows; the same
    logits as the plain call. expanded: each tile's first row reads its cached prefix expanded per head (the
    form long chunks take; the tiny config's ranks always choose absorbed), the other rows absorbed."""
    from k2jax.ops import ragged

    monkeypatch.setattr(ragged, "CHUNK_TILE", 8)
    if expanded:
        monkeypatch.setattr(ragged, "absorbed_is_cheaper", lambda *a: False)
    cache = _prefixes(params, tokens, kv_dtype)
    want_logits, _ = _plain(params, tokens, cache)
    shape = _shape(2, 4)
    meta = lay_out(shape, _feeds(tokens, cache))
    rc = RaggedCache(cache.pages, cache.scales, jnp.asarray(meta["table"]), jnp.asarray(meta["lengths"]),
                     jnp.asarray(meta["row"]), jnp.asarray(meta["pos"]), jnp.asarray(meta["valid"]),
                     TINY.qk_rope_head_dim, shape.decode, shape.block, cache.pad)
    logits, _ = jax.jit(lambda p, t, v, c, at: K2Model(TINY).apply({"params": p}, t, None, v, c, at))(
        params, jnp.asarray(meta["tokens"])[None], jnp.asarray(meta["valid"])[None], rc,
        jnp.asarray(meta["last"])[None])
    tol = 1e-5 if kv_dtype == "float32" else 2e-4
    for b, (_, n) in enumerate(ROWS):
        if n:
            np.testing.assert_allclose(np.asarray(logits[0, b]), np.asarray(want_logits[b, n - 1]), atol=tol,
                                       rtol=tol, err_msg=f"row {b}")


# A verifying step (speculative decoding): rows feed a few consecutive tokens in the decode region (a decoding
# row's last token and its drafts), across a page edge (6 + 4), from nothing, one token alone, and none.
VERIFY_ROWS = [(6, 4), (0, 3), (8, 1), (7, 0), (13, 5), (21, 2), (3, 1), (40, 2)]


@pytest.mark.parametrize("kv_dtype", ["float32", "float8"])
def test_a_verifying_step_gives_every_fed_tokens_logits(params, tokens, kv_dtype):
    """Each decode-region token sees its row's cache and its row's tokens before it in the region: the logits
    at every fed token equal the plain call's at that position, and the cache holds them all."""
    cache = _prefixes(params, tokens, kv_dtype, VERIFY_ROWS)
    want_logits, want_cache = _plain(params, tokens, cache, VERIFY_ROWS)
    cache = _prefixes(params, tokens, kv_dtype, VERIFY_ROWS)
    shape = RaggedShape(24, 0, 4, len(VERIFY_ROWS), MAX_LEN // PAGE, verify=True)
    meta = lay_out(shape, _feeds(tokens, cache, VERIFY_ROWS))
    logits, got_cache = _ragged_call(params, cache, shape, meta | {"last": np.arange(shape.decode)})
    tol = 1e-5 if kv_dtype == "float32" else 2e-4
    starts = place(shape, _feeds(tokens, cache, VERIFY_ROWS))
    for b, (_, n) in enumerate(VERIFY_ROWS):
        for j in range(n):
            np.testing.assert_allclose(np.asarray(logits[0, starts[b][1] + j]), np.asarray(want_logits[b, j]),
                                       atol=tol, rtol=tol, err_msg=f"row {b}, token {j}")
    np.testing.assert_array_equal(np.asarray(got_cache.lengths), [h + n for h, n in VERIFY_ROWS])
    for g in want_cache.pages:
        got, want = np.asarray(got_cache.pages[g], np.float32), np.asarray(want_cache.pages[g], np.float32)
        keep = np.arange(got.shape[1]) != TRASH_PAGE
        np.testing.assert_allclose(got[:, keep], want[:, keep], atol=tol, rtol=tol)


def test_one_program_serves_every_cache_length(params, tokens):
    """The cached keys are visited in a loop as long as the step's longest row: the same shape over short and
    long prefixes is one compiled program, and each gives the plain call's logits."""
    shape = RaggedShape(2, 2, 4, len(ROWS), MAX_LEN // PAGE)
    before = _RAGGED._cache_size()
    for held in (0, 3, 40):
        cache = init_cache(TINY, len(ROWS), MAX_LEN, "float32", page_size=PAGE)
        if held:
            mask = jnp.ones((len(ROWS), held), bool)
            _, cache = jax.jit(lambda p, t, m, c: K2Model(TINY).apply({"params": p}, t, None, m, c))(
                params, jnp.asarray(tokens[:, :held]), mask, cache)
        table = np.asarray(cache.page_table)
        feeds = {0: Feed(tuple(int(t) for t in tokens[0, held:held + 1]), held, tuple(map(int, table[0]))),
                 5: Feed(tuple(int(t) for t in tokens[5, held:held + 6]), held, tuple(map(int, table[5])))}
        logits, _ = _ragged_call(params, cache, shape, lay_out(shape, feeds))
        full = jax.jit(lambda p, t: K2Model(TINY).apply({"params": p}, t, method=K2Model.reference))(
            params, jnp.asarray(tokens[:, :held + 6]))
        np.testing.assert_allclose(np.asarray(logits[0, 0]), np.asarray(full[0, held]), atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(logits[0, 5]), np.asarray(full[5, held + 5]), atol=1e-5, rtol=1e-5)
    assert _RAGGED._cache_size() - before == 1


def test_layout_places_decode_rows_then_whole_blocks():
    shape = RaggedShape(decode=2, blocks=4, block=4, rows=5, table_pages=3)
    feeds = {0: Feed((5, 6, 7, 8, 9), 0, (1, 2)), 1: Feed((3,), 9, (3, 4)), 2: Feed((), 4, (5,)),
             3: Feed((4,), 2, (6,)), 4: Feed((1,), 0, (7,))}
    assert place(shape, feeds) == {0: ("chunk", 2), 1: ("decode", 0), 3: ("decode", 1), 4: ("chunk", 10)}
    m = lay_out(shape, feeds)
    assert m["tokens"].tolist()[:11] == [3, 4, 5, 6, 7, 8, 9, 0, 0, 0, 1]
    assert m["row"].tolist() == [1, 3, 0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 0, 0, 0, 0]  # a block: its row
    assert m["pos"].tolist()[:11] == [9, 2, 0, 1, 2, 3, 4, 0, 0, 0, 0]
    assert m["valid"].sum() == 8 and m["valid"][:7].all() and m["valid"][10]
    assert m["last"].tolist() == [6, 0, 0, 1, 10] and m["count"].tolist() == [5, 1, 0, 1, 1]
    assert m["table"].tolist() == [[1, 2, 0], [3, 4, 0], [5, 0, 0], [6, 0, 0], [7, 0, 0]]
    assert m["lengths"].tolist() == [0, 9, 4, 2, 0]


def test_layout_of_a_verifying_step_keeps_each_rows_tokens_together():
    shape = RaggedShape(decode=8, blocks=0, block=4, rows=4, table_pages=2, verify=True)
    feeds = {0: Feed((5, 6, 7), 4, (1,)), 2: Feed((9,), 3, (2,)), 3: Feed((1, 2), 0, (3,))}
    assert place(shape, feeds) == {0: ("decode", 0), 2: ("decode", 3), 3: ("decode", 4)}
    m = lay_out(shape, feeds)
    assert m["tokens"].tolist() == [5, 6, 7, 9, 1, 2, 0, 0]
    assert m["row"].tolist()[:6] == [0, 0, 0, 2, 3, 3] and m["pos"].tolist()[:6] == [4, 5, 6, 3, 0, 1]
    assert m["valid"].tolist() == [True] * 6 + [False] * 2
    with pytest.raises(ValueError, match="row 3's 2 tokens do not fit: 1 of the 5 decode tokens left"):
        lay_out(dataclasses.replace(shape, decode=5), feeds)
    with pytest.raises(ValueError, match="no chunk blocks"):
        RaggedShape(decode=8, blocks=1, block=4, rows=4, table_pages=2, verify=True)


def test_layout_names_what_does_not_fit():
    shape = RaggedShape(decode=0, blocks=1, block=4, rows=2, table_pages=2)
    with pytest.raises(ValueError, match="row 1's 5 tokens do not fit"):
        lay_out(shape, {1: Feed((1, 2, 3, 4, 5), 0, (1, 2))})
    with pytest.raises(ValueError, match="row 2 is outside"):
        lay_out(shape, {2: Feed((1,), 0, (1,))})
    with pytest.raises(ValueError, match="holds 3 pages"):
        lay_out(shape, {0: Feed((1,), 0, (1, 2, 3))})
