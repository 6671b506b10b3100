"""The paged MLA attention kernel (k2jax.ops.paged_mla): run in Pallas' interpreter on CPU against the XLA
form it replaces on TPUs (k2jax.ops.ragged.over_cache) and against a plain float64 loop over each group's
cached tokens; and compiled by the TPU compiler (Mosaic, with its VMEM limits) for v5p and v6e at Kimi K2's
shapes, where it must read the pool in place: no gather, no copy of the pages."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k2jax.aot import hlo
from k2jax.aot.topology import has_libtpu
from k2jax.ops.paged import quantize_latents
from k2jax.ops.paged_mla import BLOCKS, Blocks, fit_rows, paged_mla
from k2jax.ops.ragged import over_cache

L, A, Y, R, P, N = 2, 14, 4, 32, 8, 4
C = R + P
# Rows' page tables, with holes: pages in no order, entries past a row's length pointing anywhere (13, or the
# trash page 0), one row's pages shared with another's (a prefix).
TABLE = np.array([[5, 2, 9, 13], [7, 11, 3, 1], [5, 2, 4, 0]], np.int32)
SMALL = Blocks(rows=2 * N, keys=2 * Y)  # several row tiles, two pages per visit, two visits


def _pool(seed, quantized, pad):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((L, A, Y, C)).astype(np.float32)
    x[..., R:] *= 3.0  # the rope keys on another scale than the latents: the two scales must differ
    if not quantized:
        return jnp.asarray(np.pad(x, [(0, 0)] * 3 + [(0, pad)])), None
    q, s = quantize_latents(jnp.asarray(x), R)  # s [L, A, Y, 2] -> held [L, A, 2 * Y]
    return jnp.pad(q, [(0, 0)] * 3 + [(0, pad)]), jnp.swapaxes(s, -1, -2).reshape(L, A, 2 * Y)


def _plain(q_lat, q_pe, row, live, pages, scales, layer, lengths, pad):
    """Each group's (m, l, acc) in float64, token by token through the page table."""
    q_lat, q_pe = np.asarray(q_lat, np.float64), np.asarray(q_pe, np.float64)
    pages = np.asarray(pages.astype(jnp.float32), np.float64)[layer, ..., :C]
    if scales is not None:
        s = np.asarray(scales, np.float64)[layer].reshape(A, 2, Y).transpose(0, 2, 1)  # [A, Y, 2]
        pages = np.concatenate([pages[..., :R] * s[..., :1], pages[..., R:] * s[..., 1:]], -1)
    M, g = q_lat.shape[:2]
    m, l, acc = np.full((M, g, N), -1e30), np.zeros((M, g, N)), np.zeros((M, g, N, R))
    for i in range(M):
        n = lengths[row[i]] if live[i] else 0
        if not n:
            continue
        keys = np.stack([pages[TABLE[row[i], p // Y], p % Y] for p in range(n)])  # [n, C]
        s_gNn = q_lat[i] @ keys[:, :R].T + q_pe[i] @ keys[:, R:].T
        m[i] = s_gNn.max(-1)
        e = np.exp(s_gNn - m[i][..., None])
        l[i], acc[i] = e.sum(-1), e @ keys[:, :R]
    return m, l, acc


@pytest.mark.parametrize("quantized", [False, True], ids=["bf16-pool", "fp8-pool"])
@pytest.mark.parametrize("g,rows,live", [
    (1, [0, 1, 2, 1, 0], [True, True, True, False, True]),  # decode tokens; a dead one (padding)
    (3, [2, 0, 1], [True, True, True]),                       # chunk blocks of 3 tokens over their prefix
])
@pytest.mark.parametrize("pad", [0, 8])
def test_kernel_equals_the_xla_form_and_the_plain_loop(quantized, g, rows, live, pad):
    """Lengths 0 (a first chunk: nothing cached), 8 (a page boundary, a visit boundary) and 13 (mid-page)."""
    pages, scales = _pool(0, quantized, pad)
    lengths = jnp.asarray([13, 8, 0] if g == 1 else [13, 0, 8], jnp.int32)
    row, live = jnp.asarray(rows, jnp.int32), jnp.asarray(live)
    M = len(rows)
    rng = np.random.default_rng(1)
    q_lat = jnp.asarray(rng.standard_normal((M, g, N, R)) * 0.3, jnp.float32)
    q_pe = jnp.asarray(rng.standard_normal((M, g, N, P)) * 0.3, jnp.float32)
    layer = jnp.asarray(1)
    args = (q_lat, q_pe, row, live, pages, scales, layer, jnp.asarray(TABLE), lengths, R, pad)
    m, l, acc = paged_mla(*args, blocks=SMALL, interpret=True)
    assert m.shape == l.shape == (M, g, N) and acc.shape == (M, g, N, R) and acc.dtype == jnp.float32
    pm, pl_, pacc = _plain(q_lat, q_pe, np.asarray(rows), np.asarray(live), pages, scales, 1, np.asarray(lengths),
                           pad)
    np.testing.assert_allclose(np.asarray(m), pm, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(l), pl_, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(acc), pacc, rtol=1e-5, atol=1e-5)
    assert (np.asarray(l) == 0).any() and (np.asarray(l) > 0).any()  # both kinds of group were exercised
    xm, xl, xacc = over_cache(*args, jnp.float32, 2 * Y)
    for a, b in ((m, xm), (l, xl), (acc, xacc)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_bf16_queries_against_the_xla_form():
    """The model's dtype: bf16 products with float32 accumulation on both sides."""
    pages, scales = _pool(2, True, 0)
    rng = np.random.default_rng(3)
    q_lat = jnp.asarray(rng.standard_normal((2, 2, N, R)) * 0.3, jnp.bfloat16)
    q_pe = jnp.asarray(rng.standard_normal((2, 2, N, P)) * 0.3, jnp.bfloat16)
    args = (q_lat, q_pe, jnp.asarray([0, 1]), jnp.asarray([True, True]), pages, scales, jnp.asarray(0),
            jnp.asarray(TABLE), jnp.asarray([16, 5, 0], jnp.int32), R, 0)
    got = paged_mla(*args, blocks=Blocks(rows=N, keys=Y), interpret=True)
    want = over_cache(*args, jnp.bfloat16, Y)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(got[2] / got[1][..., None]), np.asarray(want[2] / want[1][..., None]),
                               atol=1e-2)


def test_fit_rows():
    assert fit_rows(1024, 1, 64) == 64        # a decode token's heads
    assert fit_rows(1024, 256, 64) == 1024    # a 256-token block: 16 tokens per tile
    assert fit_rows(1024, 12, 64) == 768      # 12 tokens fit whole
    assert fit_rows(8, 3, 4) == 4
    assert fit_rows(2, 3, 4) == 4             # never fewer rows than one token's heads


# --- compiled for TPUs by libtpu (Mosaic enforces the scoped VMEM limit) --------------------------------------

needs_libtpu = pytest.mark.skipif(not has_libtpu() and os.environ.get("K2JAX_REQUIRE_TPU_AOT") != "1",
                                  reason="libtpu is not installed (pip install 'k2jax[tpu-aot]')")


@needs_libtpu
@pytest.mark.parametrize("topology", ["v5p:2x2x1", "v6e:2x2"])
@pytest.mark.parametrize("kv", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("M,g", [(64, 1), (2, 256)], ids=["decode-64", "two-256-token-blocks"])
def test_compiles_for_tpus_and_reads_the_pool_in_place(topology, kv, M, g):
    """Kimi K2's latent (R 512, P 64, 64 heads) in a TPU pool's pages (64 tokens of 576 values padded to 640,
    as k2jax.runtime.cache lays them out there: the TPU's default layout of the pool is then row-major, the
    kernel's), rows of up to 8192 cached tokens: Mosaic accepts the blocks within the VMEM limit, and the
    program is the kernel alone (besides the queries' reshapes and the tiny metadata): no gather of the pages,
    no copy of the pool."""
    from k2jax.aot.topology import load_topology

    dev = load_topology(topology).devices[0]
    sh = jax.sharding.SingleDeviceSharding(dev)
    Rk, Pk, Nk, Yk, Wk, B, Lk, pad = 512, 64, 64, 64, 128, 64, 2, 64
    Ak = B * Wk + 1

    def s(shape, dtype):
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sh)

    quantized = kv != "bfloat16"
    args = (s((M, g, Nk, Rk), "bfloat16"), s((M, g, Nk, Pk), "bfloat16"), s((M,), "int32"), s((M,), "bool"),
            s((Lk, Ak, Yk, Rk + Pk + pad), kv), s((Lk, Ak, 2 * Yk), "float32") if quantized else None, s((), "int32"),
            s((B, Wk), "int32"), s((B,), "int32"))
    blocks = BLOCKS[topology.split(":")[0]]
    fn = jax.jit(lambda *a: paged_mla(*a, Rk, pad, blocks=blocks))
    compiled = fn.lower(*args).compile()
    text = compiled.as_text()
    assert "tpu_custom_call" in text
    module = hlo.parse(text)
    # No page is gathered or copied outside the kernel: no array there has a page's width of values.
    entry = module.computations[module.entry].instructions.values()
    paged = [i.text[:160] for i in entry if i.op not in ("parameter", "custom-call", "bitcast")
             and any(a.dims and a.dims[-1] == Rk + Pk + pad for a in i.shapes)]
    assert not paged, paged
    # What runs outside the kernel moves the queries and the state (re-laid, reshaped: copy-starts count
    # twice), and for an fp8 pool the rows' pages' scales, gathered (8 bytes a token; the async gather's
    # operand counts whole) -- never a copy of the pool's scales to another layout.
    others = [t for t in hlo.traffic(module, top=10**6).top if t[1] != "custom-call"]
    assert not [t for t in others if t[1] == "copy" and t[2] >= Lk * Ak * Yk * 8], others[:3]
    queries = M * g * Nk * (Rk + Pk) * 2 + M * g * Nk * (Rk + 2 * 128) * 4
    scales = (Lk * Ak * Yk * 8 + 3 * B * Wk * Yk * 8) if quantized else 0
    assert sum(t[2] * t[3] for t in others) <= 3 * queries + 2 * scales, others[:5]
