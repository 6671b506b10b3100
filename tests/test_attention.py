"""Inference attention kernels against the plain expanded attention (k2jax.ops.attention.attend_expanded)."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k2jax.ops.attention import attend_absorbed, attend_blocked, attend_expanded
from k2jax.testing import prefill_memory
from tests.conftest import CONFIGS

B, N, K, P, V, R = 2, 3, 16, 8, 12, 20
SCALE = 0.17
blocked = jax.jit(attend_blocked, static_argnames=("block", "unroll_blocks"))
absorbed = jax.jit(attend_absorbed)


def _inputs(T, S, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    return (jax.random.normal(ks[0], (B, T, N, K)), jax.random.normal(ks[1], (B, T, N, P)),
            jax.random.normal(ks[2], (B, S, R)), jax.random.normal(ks[3], (B, S, P)),
            jax.random.normal(ks[4], (R, N, K + V)) * 0.3)


@pytest.mark.parametrize("unroll", [0, 4])  # the scanned tiles, the unrolled query blocks
@pytest.mark.parametrize("T", [24, 21, 5])  # a multiple of the block, not one, shorter than one block
def test_blocked_prefill_equals_plain(T, unroll):
    q_nope, q_pe, ckv, k_pe, w = _inputs(T, T)
    # Row 0 left-padded by 4 (its first keys invalid), row 1 all valid.
    valid = jnp.arange(T)[None, :] >= jnp.array([[min(4, T - 1)], [0]])
    mask = jnp.tril(jnp.ones((T, T), bool))[None] & valid[:, None, :]
    want = attend_expanded(q_nope, q_pe, ckv, k_pe, w, mask, SCALE)
    got = np.asarray(blocked(q_nope, q_pe, ckv, k_pe, w, valid, SCALE, block=8, unroll_blocks=unroll))
    rows = np.asarray(mask.any(-1))  # query rows that see at least one key (padding rows are never used)
    np.testing.assert_allclose(got[rows], np.asarray(want)[rows], atol=1e-5, rtol=1e-5)
    # Causality: changing the last key changes only the last query row.
    got2 = np.asarray(blocked(q_nope, q_pe, ckv.at[:, -1].add(1.0), k_pe, w, valid, SCALE, block=8,
                               unroll_blocks=unroll))
    np.testing.assert_allclose(got2[:, :-1][rows[:, :-1]], got[:, :-1][rows[:, :-1]], atol=1e-6)
    assert not np.allclose(got2[:, -1], got[:, -1])


@pytest.mark.parametrize("T", [1, 3])
def test_absorbed_decode_equals_expanded_on_same_cache(T):
    S = 19
    q_nope, q_pe, ckv, k_pe, w = _inputs(T, S, seed=1)
    # Row 0: slots 2..10+t visible; row 1: slots 0..15+t.
    starts, ends = jnp.array([2, 0]), jnp.array([10, 15])
    s = jnp.arange(S)
    mask = (s[None, None, :] >= starts[:, None, None]) & (s[None, None, :] <= ends[:, None, None] + jnp.arange(T)[None, :, None])
    want = attend_expanded(q_nope, q_pe, ckv, k_pe, w, mask, SCALE)
    got = absorbed(q_nope, q_pe, ckv, k_pe, w, mask, SCALE)
    assert got.shape == (B, T, N, V)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    # bf16: the same up to bf16 rounding of the folded query and latent output.
    b16 = [x.astype(jnp.bfloat16) for x in (q_nope, q_pe, ckv, k_pe, w)]
    got16 = absorbed(*b16, mask, SCALE)
    assert got16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got16, np.float32), want, atol=0.06, rtol=0.06)


def test_long_prefill_memory_is_linear():
    """An 8k-token chunk of the tiny config over an 8k-token cache (the cached keys all visited): the plain
    path's score matrix alone would be
    1 × 4 heads × 8192² × 4 bytes = 1 GiB; the blocked one stays far below (bench/decode.py measures 32k)."""
    length = 8192
    _, _, grew_mib = prefill_memory(length, CONFIGS / "tiny.json", timeout=300)
    assert grew_mib < 256, f"peak memory grew by {grew_mib:.0f} MiB during an {length}-token prefill"


@pytest.mark.parametrize("mesh_spec", ["expert=8", "data=2,expert=4"])
@pytest.mark.parametrize("C", [0, 24])  # a first chunk; a later one over a cached prefix
@pytest.mark.parametrize("T", [64, 512])  # absorbed per device (8 queries); blocked (64 queries per device)
def test_a_lone_rows_tokens_split_over_the_mesh_equal_the_whole(mesh_spec, C, T):
    """A lone row's chunk on a mesh (sequence parallel: the "length" rule splits its T tokens over the axes
    the batch of 1 cannot use): each device gathers the new tokens' latents and attends its own queries
    (attend_split_tokens). Against attend_with_prefix on one device: the queries of every device, its last
    5 tokens padding (computed, not compared), the prefix partly invalid. And the split is taken: the
    function is traced under shard_map, with an all-gather of the latents, not of expanded keys."""
    from k2jax.ops.attention import attend_with_prefix
    from k2jax.sharding import make_mesh, use_mesh

    q_nope, q_pe, ckv, k_pe, w = _inputs(T, T, seed=1)
    q_nope, q_pe, ckv, k_pe = q_nope[:1], q_pe[:1], ckv[:1], k_pe[:1]
    valid = jnp.ones((1, T), bool).at[:, -5:].set(False)
    ks = jax.random.split(jax.random.PRNGKey(2), 3)
    prefix = None if C == 0 else (jax.random.normal(ks[0], (1, C, R)), jax.random.normal(ks[1], (1, C, P)),
                                  jax.random.uniform(ks[2], (1, C)) > 0.2)
    args = (q_nope, q_pe, ckv, k_pe, w, valid)
    want = attend_with_prefix(*args, SCALE, jnp.float32, "auto", prefix)
    fn = jax.jit(lambda *a: attend_with_prefix(*a, SCALE, jnp.float32, "auto", prefix))
    with use_mesh(make_mesh(mesh_spec)):
        got = fn(*args)
        hlo = fn.lower(*args).as_text()
    assert "all_gather" in hlo or "all-gather" in hlo
    np.testing.assert_allclose(np.asarray(got)[:, :-5], np.asarray(want)[:, :-5], atol=2e-5, rtol=2e-5)
    # not vacuous: another device's keys matter (the row's first half of new keys zeroed changes its end)
    other = jax.jit(lambda *a: attend_with_prefix(*a, SCALE, jnp.float32, "auto", prefix))
    with use_mesh(make_mesh(mesh_spec)):
        changed = other(q_nope, q_pe, ckv.at[:, :T // 2].set(0.0), k_pe, w, valid)
    assert np.abs(np.asarray(changed)[:, T // 2:-5] - np.asarray(want)[:, T // 2:-5]).max() > 1e-2


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("start", [0, 8, 13, 31])  # device 0 (nothing before it); a page edge; mid-page; last
def test_own_block_on_the_paged_kernel_equals_attend(start, dtype):
    """attend_split_tokens' TPU form (attend_own_block: the keys before a device's block read by the paged
    kernel, in Pallas' interpreter here, its own block causally in XLA) against the plain expanded attention
    over the keys up to the block's end. Row 0 has holes in its keys (a cached prefix's) and two padding
    keys in the block, row 1 its first 10 keys invalid (all of them, for start 8)."""
    from k2jax.ops.attention import attend, attend_own_block, causal_mask

    t, S = 6, 37
    q_nope, q_pe, ckv, k_pe, w = (x.astype(dtype) for x in _inputs(t, S, seed=3))
    valid = jnp.ones((B, S), bool).at[0, 3:5].set(False).at[0, start + t - 2:start + t].set(False)
    valid = valid.at[1, :10].set(False)
    end = start + t
    want = attend(q_nope, q_pe, ckv[:, :end], k_pe[:, :end], w, valid[:, :end], SCALE, impl="plain")
    run = jax.jit(lambda *a: attend_own_block(*a, SCALE, jnp.int32(start), page=8, interpret=True))
    got = run(q_nope, q_pe, ckv, k_pe, w, valid)
    assert got.shape == (B, t, N, V) and got.dtype == dtype
    tol = 1e-5 if dtype == jnp.float32 else 0.05
    rows = np.asarray(causal_mask(valid[:, :end], t).any(-1))  # query rows that see a key (others unused)
    assert rows.sum() >= t
    np.testing.assert_allclose(np.asarray(got, np.float32)[rows], np.asarray(want, np.float32)[rows], atol=tol,
                               rtol=tol)
    if start:  # not vacuous: a valid key before the block counts, the keys past its end do not
        moved = run(q_nope, q_pe, ckv.at[0, 0].add(3.0), k_pe, w, valid)
        assert np.abs(np.asarray(moved, np.float32) - np.asarray(got, np.float32))[0].max() > 1e-2
    later = run(q_nope, q_pe, ckv.at[:, end:].add(3.0), k_pe, w, valid)
    np.testing.assert_array_equal(np.asarray(later), np.asarray(got))
