"""The scheduler's ragged plan with fake sequences and a real page pool: no model, no device. Which rows a
step takes, in which shape, and what each row feeds."""

from k2jax.runtime.layout import RaggedShape
from k2jax.runtime.pages import PagePool
from k2jax.runtime.scheduler import Scheduler, Seq

PAGE = 8


def _sched(slots=4, pages=33, chunk=16, idle=32, block=4):
    pool = PagePool(pages, 1, PAGE, False)
    return Scheduler(slots, pool, max_len=64, prefill_chunk=chunk, idle_chunk=idle, ragged_block=block)


def _seq(n, start=100):
    return Seq(None, list(range(start, start + n)), n)


def _ran(sched, call, sampled=7):
    """The call ran: advance its rows, and each row that sampled gets a new token."""
    sched.advance(call)
    for (s, _), samples in zip(call.rows, call.samples):
        if samples:
            s.tokens.append(sampled)


def test_prompts_share_a_step_within_the_idle_budget_then_decode_beside_the_next_prompt():
    sched = _sched()
    a, b, c = _seq(5), _seq(21), _seq(9)
    for s in (a, b, c):
        sched.add(s)
    sched.admit()
    assert [s.slot for s in (a, b, c)] == [0, 1, 2]
    call = sched.plan_ragged()
    # 5 tokens take 2 blocks of 4, 21 take 6: the idle budget of 32 is spent, the third prompt waits
    assert [(s, n) for s, n in call.rows] == [(a, 5), (b, 21), (None, 0), (None, 0)]
    assert call.shape == RaggedShape(decode=4, blocks=8, block=4, rows=4, table_pages=8)
    assert call.samples == [True, True, False, False]
    _ran(sched, call)
    assert a.decoding and b.decoding and a.cached == 5
    call = sched.plan_ragged()  # both decode; the third prompt's 9 tokens fit prefill_chunk (16) beside them
    assert [(s, n) for s, n in call.rows] == [(a, 1), (b, 1), (c, 9), (None, 0)]
    assert call.shape == RaggedShape(decode=4, blocks=8, block=4, rows=4, table_pages=8)
    _ran(sched, call)
    call = sched.plan_ragged()  # three decoding rows: a decode-only step of the smallest size holding them
    assert [n for _, n in call.rows] == [1, 1, 1, 0] and call.shape.blocks == 0 and call.shape.decode == 4
    sched.finish(b)
    sched.finish(c)
    _ran(sched, call)
    assert sched.plan_ragged().shape.decode == 1  # decode sizes from an eighth of the slots: 1, 2, 4


def test_a_long_prompt_is_cut_to_the_budget_and_pages_are_taken_as_it_grows():
    sched = _sched()
    s = _seq(50)
    sched.add(s)
    sched.admit()
    fed = []
    while not s.decoding:
        call = sched.plan_ragged()
        fed.append(call.rows[0][1])
        assert len(s.pages) * PAGE >= s.cached + call.rows[0][1]
        _ran(sched, call)
    assert fed == [32, 18]


def test_each_shard_fills_its_own_segment_and_the_fullest_sizes_the_step():
    """Two data-parallel shards (slots 0-1 on shard 0, 2-3 on shard 1): each shard's chunks come from its
    own rows within the same budget, side by side, and the step's segments are as long as the fullest."""
    pool = PagePool(2 * 17, 2, PAGE, False)
    sched = Scheduler(4, pool, max_len=64, prefill_chunk=16, idle_chunk=32, ragged_block=4)
    assert {sh.shards for sh in sched.shapes()} == {2}
    assert sorted({sh.decode for sh in sched.shapes()}) == [1, 2]  # decode sizes up to a shard's 2 slots
    a, b, c = _seq(30), _seq(9), _seq(6)
    for s in (a, b, c):
        sched.add(s)
    sched.admit()
    assert [s.slot for s in (a, b, c)] == [0, 2, 1]  # each to the shard with the most room
    call = sched.plan_ragged()
    # Shard 0: a's 30 tokens spend its idle budget (8 blocks of 4), so c waits; shard 1's b runs beside it.
    assert [(s, n) for s, n in call.rows] == [(a, 30), (None, 0), (b, 9), (None, 0)]
    assert call.shape == RaggedShape(decode=2, blocks=8, block=4, rows=4, table_pages=8, shards=2)
    _ran(sched, call)
    call = sched.plan_ragged()  # a and b decode; c's 6 tokens beside them, the step's one chunk: spread
    assert [(s, n) for s, n in call.rows] == [(a, 1), (c, 6), (b, 1), (None, 0)]
    assert call.spread == 1
    assert call.shape == RaggedShape(decode=2, blocks=0, block=4, rows=4, table_pages=8, shards=2, spread=4)


def test_a_lone_chunk_is_spread_over_the_shards_and_several_take_regions():
    """With data-parallel shards a step's only chunk is spread over every segment, at the smallest spread
    size that holds it, up to idle_chunk; chunks of several shards side by side take at most prefill_chunk
    tokens each (the largest chunk region)."""
    pool = PagePool(4 * 33, 4, PAGE, False)
    sched = Scheduler(8, pool, max_len=256, prefill_chunk=64, idle_chunk=256, ragged_block=4)
    assert sched.region_sizes == [64] and sched.spread_sizes == [4, 8, 16]  # 64, 128, 256 tokens over 4
    assert len(set(sched.shapes())) == 2 + 1 + 3  # decode sizes 1, 2; one region; three spread sizes
    b, c = _seq(100, 300), _seq(90, 500)
    for s in (b, c):
        sched.add(s)
    sched.admit()
    assert b.slot // 2 != c.slot // 2  # two shards
    call = sched.plan_ragged()  # nothing decodes, but two shards' chunks: each cut to prefill_chunk, no spread
    assert call.spread is None and call.rows[b.slot] == (b, 64) and call.rows[c.slot] == (c, 64)
    assert call.shape == RaggedShape(decode=2, blocks=16, block=4, rows=8, table_pages=32, shards=4)
    sched.finish(b)
    sched.finish(c)
    a = _seq(200)
    sched.add(a)
    sched.admit()
    call = sched.plan_ragged()  # a lone prompt takes idle_chunk, spread 4 ways
    assert call.rows[a.slot] == (a, 200) and call.spread == a.slot
    assert call.shape == RaggedShape(decode=2, blocks=0, block=4, rows=8, table_pages=32, shards=4, spread=16)


def test_nothing_to_run_is_no_step():
    sched = _sched()
    assert sched.plan_ragged() is None
    assert len(set(sched.shapes())) == 3 + 1  # decode sizes 1, 2, 4; one chunk region of 32 tokens


def test_the_scheduler_and_its_types_import_no_jax():
    """The scheduler, the page pool, the step layouts and the request types import nothing that needs jax
    (their own imports, read from the source: the k2jax package itself does load jax)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "k2jax" / "runtime"
    free = {"scheduler", "pages", "layout", "requests", "speculate"}
    for name in sorted(free):
        tree = ast.parse((root / f"{name}.py").read_text())
        for node in ast.walk(tree):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module] if isinstance(node, ast.ImportFrom) else [])
            for m in mods:
                assert m.split(".")[0] not in ("jax", "jaxlib", "flax"), (name, m)
                if m.startswith("k2jax."):
                    assert m.startswith("k2jax.runtime.") and m.split(".")[2] in free, (name, m)


def test_drafts_are_verified_in_a_step_of_their_own_and_never_preempt():
    """Speculative decoding: decoding rows with drafts feed them in a verifying step (no prompt chunk beside),
    counted as cached only when accepted; a draft whose pages are not free is dropped rather than preempting;
    a row that cannot be verified (draft None) keeps the step plain."""
    pool = PagePool(5, 1, PAGE, False)  # the trash page and 4 pages of 8 tokens
    sched = Scheduler(4, pool, max_len=64, prefill_chunk=16, idle_chunk=32, ragged_block=4, speculative_tokens=3)
    a, b = _seq(7), _seq(15, start=200)
    for s in (a, b):
        sched.add(s)
    sched.admit()
    _ran(sched, sched.plan_ragged())  # both prompts: 7 and 15 tokens held, 3 pages taken, 1 free
    assert a.decoding and b.decoding and pool.free_count() == 1
    a.draft, b.draft = [1, 2, 3], [4, 5]
    call = sched.plan_ragged()
    # a's 7 held + 4 fed need a second page, the free one; b's 15 + 3 would need a third, none is left: b feeds
    # its token alone, and nobody is preempted
    assert call.shape == RaggedShape(decode=8, blocks=0, block=4, rows=4, table_pages=8, verify=True)
    assert [(s, n) for s, n in call.rows][:2] == [(a, 4), (b, 1)] and call.drafts == {0: (1, 2, 3)}
    assert call.samples[:2] == [True, True] and sched.preemptions == 0 and sched.live() == [a, b]
    sched.advance(call)
    assert a.cached == 7 + 1 and b.cached == 15 + 1  # the drafts are not cached until accepted
    a.tokens += [1, 2, 9]  # two drafts accepted, then the model's own token
    b.tokens.append(6)
    sched.verified(a, 2)
    assert a.cached == 10 and a.pending == 1
    sched.finish(b)  # (its next token would need the last page)
    a.draft = None  # a row that cannot be verified: a plain decode step
    call = sched.plan_ragged()
    assert not call.shape.verify and not call.drafts and [n for _, n in call.rows][0] == 1


def test_beside_decoding_rows_a_chunk_is_cut_to_its_modeled_time_prefix_included():
    """With the steps' times (base + per cached token, set by hand here), a chunk beside a decoding row is the
    largest region whose modeled step fits RAGGED_FILL of a first chunk of prefill_chunk tokens; as the
    prompt's cached prefix grows its chunks shrink, down to the smallest region (it still goes on). While
    none decodes, a chunk is idle_chunk tokens whatever it costs."""
    from k2jax.runtime.scheduler import RAGGED_FILL

    pool = PagePool(600, 1, PAGE, False)
    sched = Scheduler(2, pool, max_len=4096, prefill_chunk=512, ragged_block=16)
    sizes = [64, 128, 256, 512]
    regions = [RaggedShape(2, t // 16, 16, 2, 4096 // PAGE) for t in sizes]
    assert sched.timed_shapes() == regions
    assert [sched.timing_prefix(r) for r in regions] == [4096 - t for t in sizes]
    model = {t: (t / 64, t / 64 / 300) for t in sizes}  # seconds: base, per cached token
    sched.ragged_s = {r: model[t] for r, t in zip(regions, sizes)}
    budget = RAGGED_FILL * model[512][0]

    def want(cached, pending):  # the largest region that fits, computed from the model directly
        fits = [t for t in sizes if model[t][0] + model[t][1] * cached <= budget]
        return min(pending, max(fits) if fits else 64)

    a, b = _seq(3), _seq(3000, start=10)
    sched.add(a)
    sched.admit()
    _ran(sched, sched.plan_ragged())
    assert a.decoding
    sched.add(b)
    sched.admit()
    fed = []
    while not b.decoding:
        call = sched.plan_ragged()
        n = call.rows[b.slot][1]
        assert n == want(b.cached, b.pending), (b.cached, n)
        assert call.rows[a.slot][1] == 1
        fed.append(n)
        _ran(sched, call)
    assert fed[0] == 256 and 128 in fed and fed[-2] == 64  # every size the model allows, in turn
    assert sum(fed) == 3000

    c = _seq(3000, start=20)  # alone: the idle chunk, whatever it costs
    sched.finish(a)
    sched.finish(b)
    sched.add(c)
    sched.admit()
    _ran(sched, sched.plan_ragged())
    assert c.cached == 512
    sched.ragged_s = {}  # untimed: prefill_chunk tokens beside a decoding row
    d = _seq(900, start=30)
    while not c.decoding:
        _ran(sched, sched.plan_ragged())
    sched.add(d)
    sched.admit()
    call = sched.plan_ragged()
    assert call.rows[d.slot][1] == 512
