"""The ragged step (k2jax.ops.ragged, laid out by k2jax.runtime.layout) against the plain model call, row by
row: decoding rows and prompt chunks of any lengths in one flat batch, each over its own cached prefix, give
the logits and the cache the rectangular step with the plain attention gives each row."""

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k2jax import K2Config, K2Model, init_params
from k2jax.ops.paged import TRASH_PAGE
from k2jax.ops.ragged import RaggedCache
from k2jax.runtime.cache import init_cache
from k2jax.runtime.layout import Feed, RaggedShape, flat_indices, lay_out, place
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
    monkeypatch.setattr(ragged, "PREFIX_TILE", 8)
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


def _one_device(cache):
    """The cache's pool, table and lengths fetched whole onto one device: read by global page ids."""
    def get(x):
        return jnp.asarray(np.asarray(x))

    return dataclasses.replace(cache, pages=jax.tree.map(get, cache.pages), scales=jax.tree.map(get, cache.scales),
                               page_table=get(cache.page_table), lengths=get(cache.lengths), shard_axes=())


def _sharded(params, tokens, kv_dtype, spec):
    """A cache of ROWS on a mesh of `spec` (None: a 2-shard pool's layout on one device) holding the rows'
    prefixes, and the plain rectangular call's logits and cache on one device reading the same pool ->
    (mesh, shard axes, shards, the cache on one device, want_logits, want_cache)."""
    from k2jax.sharding import make_mesh

    mesh = make_mesh(spec or "data=2,tensor=4")
    B = len(ROWS)
    sharded = init_cache(TINY, B, MAX_LEN, kv_dtype, page_size=PAGE, mesh=mesh)
    shards = int(np.prod([mesh.shape[a] for a in sharded.shard_axes]))
    assert shards > 1
    assert np.asarray(sharded.page_table)[B // shards, 0] == (1 + B // shards * (MAX_LEN // PAGE)) + 1  # shard 1
    cache = _one_device(sharded)
    held = np.array([h for h, _ in ROWS])
    T = int(held.max())
    _, cache = jax.jit(lambda p, t, m, c: K2Model(TINY).apply({"params": p}, t, None, m, c))(
        params, jnp.asarray(tokens[:, :T]), jnp.asarray(np.arange(T)[None, :] < held[:, None]), cache)
    want_logits, want_cache = _plain(params, tokens, cache)
    return mesh, sharded.shard_axes, shards, cache, want_logits, want_cache


def _sharded_call_args(params, cache, mesh, axes, shards, shape, meta, on_mesh):
    """The ragged step's arguments (params, tokens [S, Ts], valid [S, Ts], the RaggedCache, at [S, B / S]), the
    pool placed on the mesh when on_mesh."""
    B = shape.rows
    per, Ts = B // shards, shape.segment
    at = (meta["last"] - np.arange(B) // per * Ts).reshape(shards, per)
    if on_mesh:
        place_ = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, axes))
        pool = jax.device_put((cache.pages, cache.scales), place_)
    else:
        pool = (cache.pages, cache.scales)
    rc = RaggedCache(*pool, jnp.asarray(meta["table"]), jnp.asarray(meta["lengths"]), jnp.asarray(meta["row"]),
                     jnp.asarray(meta["pos"]), jnp.asarray(meta["valid"]), TINY.qk_rope_head_dim, shape.decode,
                     shape.block, cache.pad, shards, axes if on_mesh else (), shape.spread_tokens)
    return (params, jnp.asarray(meta["tokens"]).reshape(shards, Ts), jnp.asarray(meta["valid"]).reshape(shards, Ts),
            rc, jnp.asarray(at))


def _check_sharded(logits, got, want_logits, want_cache, shards, kv_dtype):
    """Each fed row's logits and every page but the shards' trash pages, against the plain call's."""
    B = len(ROWS)
    logits = np.asarray(logits).reshape(B, -1)
    tol = 1e-5 if kv_dtype == "float32" else 2e-4
    for b, (_, n) in enumerate(ROWS):
        if n:
            np.testing.assert_allclose(logits[b], np.asarray(want_logits[b, n - 1]), atol=tol, rtol=tol,
                                       err_msg=f"row {b}")
    np.testing.assert_array_equal(np.asarray(got.lengths), [h + n for h, n in ROWS])
    A = next(iter(want_cache.pages.values())).shape[1]
    trash = np.arange(A) % (A // shards) == 0  # each shard's first page: its trash page (padding lands there)
    for g in want_cache.pages:
        got_g, want_g = np.asarray(got.pages[g], np.float32), np.asarray(want_cache.pages[g], np.float32)
        np.testing.assert_allclose(got_g[:, ~trash], want_g[:, ~trash], atol=tol, rtol=tol, err_msg=g)
        if kv_dtype == "float8":
            np.testing.assert_allclose(np.asarray(got.scales[g])[:, ~trash],
                                       np.asarray(want_cache.scales[g])[:, ~trash], rtol=1e-6)


@pytest.mark.parametrize("kv_dtype", ["float32", "float8"])
@pytest.mark.parametrize("spec", ["data=2,tensor=4", "data=2,expert=2,tensor=2", None],
                         ids=["data2_tensor4", "data2_expert2_tensor2", "no_mesh"])
def test_sharded_ragged_step_equals_the_plain_call_row_by_row(params, tokens, kv_dtype, spec, monkeypatch):
    """A flat batch in one segment per data-parallel shard (each shard's rows, chunks and pool part): on a
    mesh each shard attends and writes under shard_map; without one (the plain form) the segments run one
    after another. Both against the plain rectangular call on one device reading the same pool. On a mesh
    with a tensor axis each chip attends with its own heads: fewer flops per chip than every head on each."""
    from k2jax.sharding import use_mesh

    mesh, axes, shards, cache, want_logits, want_cache = _sharded(params, tokens, kv_dtype, spec)
    feeds = _feeds(tokens, cache)
    B = len(ROWS)
    per = B // shards
    blocks = max(sum(-(-n // 4) for b, (_, n) in enumerate(ROWS) if b // per == s and n > 1) for s in range(shards))
    shape = RaggedShape(2, blocks + 1, 4, B, MAX_LEN // PAGE, shards=shards)
    meta = lay_out(shape, feeds)
    assert set(np.asarray(meta["row"])[:shape.segment]) <= set(range(per))  # segment 0: shard 0's rows only
    args = _sharded_call_args(params, cache, mesh, axes, shards, shape, meta, spec is not None)
    with use_mesh(mesh) if spec else contextlib.nullcontext():
        if spec is not None and kv_dtype == "float32":
            def flops():  # per chip, of a fresh trace
                step = jax.jit(lambda p, t, v, c, at: K2Model(TINY).apply({"params": p}, t, None, v, c, at))
                return step.lower(*args).compile().cost_analysis()["flops"]

            split = flops()
            with monkeypatch.context() as m:
                m.setattr("k2jax.ops.ragged.cutting_axes", lambda *a: ())  # every head on every chip
                whole = flops()
            assert split < 0.95 * whole, (split, whole)
        logits, got = _RAGGED(*args)
    _check_sharded(logits, got, want_logits, want_cache, shards, kv_dtype)


@pytest.mark.parametrize("kv_dtype,spec,spread,kernel", [
    ("float32", "data=2,tensor=4", 5, False), ("float8", "data=2,expert=2,tensor=2", 0, False),
    ("float32", None, 2, False), ("float32", "data=2,tensor=4", 2, True)],
    ids=["data2_tensor4_row5", "data2_expert2_tensor2_row0_fp8", "no_mesh_row2", "data2_tensor4_row2_kernel"])
def test_a_spread_chunk_equals_the_plain_call(params, tokens, kv_dtype, spec, spread, kernel, monkeypatch):
    """One row's chunk spread over every segment (k2jax.runtime.layout), beside the other rows' decodes and
    chunks in their own segments: a first chunk on shard 0 (row 0), a later one on shard 1 reading 16 cached
    tokens of its shard's pages (row 5), one reading 21 across a page edge (row 2). Its pieces see its
    cached pages from whichever shard holds them and each other; the shard holding its pages writes them.
    Against the plain rectangular call, row by row and page by page; `kernel`: the cached keys read by the
    TPU's paged kernel (in Pallas' interpreter), as on a TPU."""
    from k2jax.ops.paged_mla import Blocks, paged_mla
    from k2jax.sharding import use_mesh

    if kernel:
        monkeypatch.setattr("k2jax.ops.ragged.cache_state", lambda *a: paged_mla(
            *a[:-4], a[-4], a[-3], blocks=Blocks(rows=64, keys=PAGE), interpret=True))

    mesh, axes, shards, cache, want_logits, want_cache = _sharded(params, tokens, kv_dtype, spec)
    feeds = _feeds(tokens, cache)
    feeds[spread] = dataclasses.replace(feeds[spread], spread=True)
    B, per = len(ROWS), len(ROWS) // shards
    blocks = max(sum(-(-n // 4) for b, (_, n) in enumerate(ROWS) if b // per == s and n > 1 and b != spread)
                 for s in range(shards))
    pieces = -(-ROWS[spread][1] // (shards * 4))  # blocks of 4 in each segment's spread region
    shape = RaggedShape(2, blocks, 4, B, MAX_LEN // PAGE, shards=shards, spread=pieces)
    meta = lay_out(shape, feeds)
    segment_of = np.flatnonzero((meta["row"] == spread) & meta["valid"]) // shape.segment
    assert len(set(segment_of)) == shards  # its tokens in every segment
    assert meta["last"][spread] // shape.segment == spread // per  # its last one in its own shard's
    args = _sharded_call_args(params, cache, mesh, axes, shards, shape, meta, spec is not None)
    with use_mesh(mesh) if spec else contextlib.nullcontext():
        logits, got = _RAGGED(*args)
    _check_sharded(logits, got, want_logits, want_cache, shards, kv_dtype)


def test_sharded_layout_keeps_each_segment_to_its_shard():
    shape = RaggedShape(2, 2, 4, 4, 3, shards=2)
    feeds = {0: Feed((5,), 3, (1, 2)), 1: Feed((6, 7, 8), 0, (3,)), 2: Feed((9,), 1, (8,)),
             3: Feed((1, 2, 3, 4, 5), 4, (9, 10))}
    meta = lay_out(shape, feeds)
    assert shape.segment == 10 and shape.tokens == 20
    assert place(shape, feeds) == {0: ("decode", 0), 1: ("chunk", 2), 2: ("decode", 10), 3: ("chunk", 12)}
    np.testing.assert_array_equal(meta["row"], [0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3])
    np.testing.assert_array_equal(meta["last"], [0, 4, 10, 16])
    np.testing.assert_array_equal(meta["pos"][12:17], [4, 5, 6, 7, 8])
    with pytest.raises(ValueError, match="row 3's 9 tokens do not fit"):
        lay_out(shape, feeds | {3: Feed((1,) * 9, 0, (9, 10))})
    with pytest.raises(ValueError, match="do not split over 3 shards"):
        RaggedShape(2, 2, 4, 4, 3, shards=3)


def test_a_spread_rows_pieces_end_in_its_own_segment():
    """A spread row's chunk in pieces of each segment's spread region (its last tokens), in order, the last
    in its own shard's segment; every spread-region token is the spread row's, padding too."""
    shape = RaggedShape(2, 1, 4, 4, 3, shards=2, spread=2)
    feeds = {0: Feed((5,), 3, (1, 2)), 1: Feed(tuple(range(10, 21)), 4, (9, 10), spread=True),
             2: Feed((9,), 1, (8,))}
    assert shape.segment == 14 and shape.spread_tokens == 8
    m = lay_out(shape, feeds)
    # row 1 is shard 0's: its last piece (tokens 8-10) in segment 0, the first (0-7) in segment 1
    np.testing.assert_array_equal(m["tokens"][6:14], [18, 19, 20, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(m["tokens"][20:28], range(10, 18))
    np.testing.assert_array_equal(m["pos"][20:28], range(4, 12))
    np.testing.assert_array_equal(m["pos"][6:9], [12, 13, 14])
    assert (m["row"][6:14] == 1).all() and (m["row"][20:28] == 1).all()
    assert m["valid"][6:9].all() and not m["valid"][9:14].any() and m["valid"][20:28].all()
    assert m["last"][1] == 8 and m["count"][1] == 11 and m["lengths"][1] == 4
    assert m["table"][1].tolist() == [9, 10, 0]
    assert place(shape, feeds) == {0: ("decode", 0), 1: ("spread", 20), 2: ("decode", 14)}
    flat = flat_indices(shape, feeds)
    assert flat[1].tolist() == list(range(20, 28)) + [6, 7, 8] and flat[2].tolist() == [14]
    with pytest.raises(ValueError, match="row 1's 17 tokens do not fit the spread regions: 2 of 8 tokens"):
        lay_out(shape, feeds | {1: Feed((1,) * 17, 0, (9, 10, 11), spread=True)})
    with pytest.raises(ValueError, match="both spread"):
        lay_out(shape, feeds | {0: Feed((1,), 0, (1,), spread=True)})
    with pytest.raises(ValueError, match="row 1 is spread, but the step's shape has no spread region"):
        lay_out(dataclasses.replace(shape, spread=0), feeds)


@pytest.mark.parametrize("fmt", ["plain", "fp8"])
def test_kv_b_read_out_of_the_stack(fmt):
    """With the model's kv_b_proj stack in the cache (K2Model.forward hands it), a ragged step's layer takes
    W_UK and W_UV from the stack at its layer (1 here), not from the weight passed in: a plain stack's halves
    each read by their own product, an fp8 one in head-aligned blocks read as held (its block scales after the
    product over K, on the latent before the one over R: k2jax.ops.paged.head_blocks). Decode tokens and a
    chunk block, against ragged_attention given the layer's weight (dequantized to bf16)."""
    from k2jax.ops.paged import head_blocks
    from k2jax.ops.quant import dequantize_weight, quantize_weight
    from k2jax.ops.ragged import RaggedContext, ragged_attention

    L, A, Y, R, P, N, K, V = 2, 8, 4, 32, 8, 2, 128, 128
    rng = np.random.default_rng(0)
    bf = jnp.bfloat16
    pages = jnp.asarray(rng.standard_normal((L, A, Y, R + P)), bf)
    table = jnp.asarray([[1, 2], [3, 4], [5, 6]], jnp.int32)
    lengths = jnp.asarray([5, 2, 7], jnp.int32)
    # decode tokens of rows 1 and 2, a padding one, then a block of row 0's next 3 tokens and a padding one
    row_T = jnp.asarray([1, 2, 0, 0, 0, 0, 0], jnp.int32)
    pos_T = jnp.asarray([2, 7, 0, 5, 6, 7, 0], jnp.int32)
    valid_T = np.array([1, 1, 0, 1, 1, 1, 0], bool)
    T = len(valid_T)
    q_nope, q_pe = (jnp.asarray(rng.standard_normal((1, T, N, d)), bf) for d in (K, P))
    ckv, k_pe = (jnp.asarray(rng.standard_normal((1, T, d)), bf) for d in (R, P))
    w = rng.standard_normal((2, R, N, K + V)).astype(np.float32) * 0.2
    w[1, :, 1] *= 4.0  # blocks of different scales
    stack = quantize_weight(w, "fp8", 1, 1) if fmt == "fp8" else jnp.asarray(w, bf)
    layer_w = dequantize_weight(stack[1], bf) if fmt == "fp8" else stack[1]
    if fmt == "fp8":
        assert head_blocks(stack, K)
    scale = K ** -0.5

    def attend(layer, kv_b):
        cache = RaggedCache({"g": pages}, {}, table, lengths, row_T, pos_T, jnp.asarray(valid_T), P, 3, 4,
                            kv_b=kv_b)
        ctx = RaggedContext(cache, "g", jnp.asarray(layer), bf)
        return np.asarray(jax.jit(lambda *a: ctx.attend(*a, None, scale))(q_nope, q_pe, ckv, k_pe, layer_w * 0.5),
                          np.float32)[0]

    got = attend(1, {"g": stack})
    want = np.asarray(ragged_attention(q_nope[0], q_pe[0], ckv[0], k_pe[0], layer_w, scale, pages, None,
                                       jnp.asarray(1), table, lengths, row_T, pos_T, jnp.asarray(valid_T), 3, 4,
                                       0, bf), np.float32)
    assert np.abs(want[valid_T]).max() > 0.5
    tol = 0.02 * np.abs(want[valid_T]).max()
    np.testing.assert_allclose(got[valid_T], want[valid_T], atol=tol)
    assert np.abs(attend(0, {"g": stack})[valid_T] - want[valid_T]).max() > 10 * tol  # layer 0 is another
