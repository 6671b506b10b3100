"""Absorbed MLA attention over the paged latent cache, read in place: a Pallas TPU kernel.

The XLA form (k2jax.ops.ragged.over_cache) gathers each visit's pages into a contiguous copy, which XLA:TPU
writes to HBM and reads back. Here each grid step DMAs a few of the row's pages, straight from the pool
through the page table, into VMEM, and folds them into an online softmax held there: HBM sees each page the
step reads once, and nothing else but the queries and the result.

Query groups: M groups of g tokens sharing one row's cached keys (a decode token alone, g = 1; a prompt
chunk's block of g tokens), each with its N heads: rows gN = g * N of the absorbed queries (q_lat [gN, R]
= q_nope @ W_UK, and q_pe [gN, P], both already scaled). All heads and tokens of a group share the row's
latent keys (one [C] vector per cached token: ckv [R] then k_pe [P]), so a visit is two matmuls for the
scores and one for the values:

    s [gN, Z] = q_lat @ ckv.T + q_pe @ k_pe.T        acc [gN, R] += softmax-weights @ ckv

- The grid is (groups, query-row tiles, visits). A visit reads `pages_per_visit` pages, each its own input
  whose index map looks its page id up in the scalar-prefetched page table, so Pallas pipelines the DMAs
  (the next visit's pages load while this one computes). Visits past the row's length repeat the last
  needed pages' block indices (no new DMA) and compute nothing; a group with no cached key (a dead group, or
  a row's first chunk) reads one page and computes nothing.
- fp8 (e4m3) pages enter the MXU as bf16 (exact), and their per-token scales (the latent's, the rope key's)
  scale the scores' columns and the softmax weights' (a key's scale factors out of its dot products), so no
  dequantized page is formed. The scales come gathered for the step's rows, [B, W, 2, Y].
- It returns the online-softmax state (m, l [M, g, N], acc [M, g, N, R], float32), as the XLA form does, so
  the ragged step merges it with the new tokens' own part unchanged.

k2jax.ops.ragged.over_cache is the plain form (XLA's loop of gathered visits), which the kernel is tested
equal to in interpret mode on CPU, and which stays the path on other backends.

Letters as in k2jax.ops.ragged: M groups, g tokens per group, N heads, R kv_lora_rank, P rope dim, C = R + P,
L layers, A pages in the pool, Y tokens per page, B rows, W pages per row.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

_NEG_INF = -1e30
_LANES = 128  # m and l are held broadcast over a lane row (Mosaic lays out [rows, 128] tiles)


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Query rows per grid step (rows: a multiple of the heads, at most this), cached keys read per visit
    (keys: whole pages, at least one), and the scoped VMEM the kernel may use (bytes)."""

    rows: int = 2048
    keys: int = 512
    vmem: int = 48 << 20


# Per TPU generation (k2jax.aot.topology's chip names). Checked against VMEM by compiling Kimi K2's shapes for
# v5p and v6e (tests/test_paged_mla.py): a 2048-row tile's float32 accumulator is 4 MiB, its scores 4 MiB,
# and its outputs are double-buffered. Every row tile reads the keys again: a lone 8192-token prompt split
# over 64 chips has 128 tokens x 64 heads = 8192 query rows a chip, 4 tiles (8 at 1024 rows).
BLOCKS = {"v5p": Blocks(), "v6e": Blocks(), "v5e": Blocks(rows=512, vmem=32 << 20), "v7x": Blocks()}


def fit_rows(limit: int, g: int, N: int) -> int:
    """Query rows per tile: N times the largest divisor of g with at most `limit` rows (at least N)."""
    per = max(1, limit // N)
    return N * max(d for d in range(1, g + 1) if g % d == 0 and d <= per) if per < g else N * g


def _kernel(row_ref, len_ref, table_ref, layer_ref, q_lat_ref, q_pe_ref, *refs, v: int, Y: int, R: int,
            C: int, quantized: bool, visits: int):
    del row_ref, table_ref, layer_ref  # used by the index maps only
    pages = refs[:v]
    scales = refs[v:2 * v] if quantized else ()
    ml_out, acc_out, m_scr, l_scr, acc_scr = refs[2 * v if quantized else v:]
    grp, j = pl.program_id(0), pl.program_id(2)
    n_keys = len_ref[grp]
    f32 = jnp.float32

    @pl.when(j == 0)
    def _():
        m_scr[...] = jnp.full_like(m_scr, _NEG_INF)
        l_scr[...] = jnp.zeros_like(l_scr)
        acc_scr[...] = jnp.zeros_like(acc_scr)

    @pl.when(j * v * Y < n_keys)
    def _():
        dt = q_lat_ref.dtype
        q_lat, q_pe = q_lat_ref[...], q_pe_ref[...]
        nt = (((1,), (1,)), ((), ()))  # a @ b.T
        for i in range(v):  # the visit's pages, each its own DMA'd block [Y, C + pad]
            x = pages[i][...]
            ckv, k_pe = x[:, :R].astype(dt), x[:, R:C].astype(dt)  # e4m3 -> bf16 is exact
            s_ckv = jax.lax.dot_general(q_lat, ckv, nt, preferred_element_type=f32)  # [rows, Y]
            s_pe = jax.lax.dot_general(q_pe, k_pe, nt, preferred_element_type=f32)
            if quantized:  # a key's scale scales its column of the scores, and its row of the values
                sc = scales[i][...]  # [2, Y]: the page's tokens' latent and rope-key scales, as rows
                s_rz = s_ckv * sc[0:1, :] + s_pe * sc[1:2, :]
            else:
                s_rz = s_ckv + s_pe
            pos = (j * v + i) * Y + jax.lax.broadcasted_iota(jnp.int32, s_rz.shape, 1)
            see = pos < n_keys
            s_rz = jnp.where(see, s_rz, _NEG_INF)
            m_prev = m_scr[...][:, :1]
            m_new = jnp.maximum(m_prev, s_rz.max(axis=1, keepdims=True))
            p = jnp.where(see, jnp.exp(s_rz - m_new), 0.0)
            corr = jnp.exp(m_prev - m_new)
            l_scr[...] = jnp.broadcast_to(l_scr[...][:, :1] * corr + p.sum(axis=1, keepdims=True), l_scr.shape)
            m_scr[...] = jnp.broadcast_to(m_new, m_scr.shape)
            pv = p * sc[0:1, :] if quantized else p
            acc_scr[...] = acc_scr[...] * corr + jnp.dot(pv.astype(dt), ckv, preferred_element_type=f32)

    @pl.when(j == visits - 1)
    def _():
        # m and l leave as two rows [2, rows] (rows along the lanes), not lane-broadcast [rows, 128] columns:
        # 1/64 of the bytes for the caller to read back.
        ml_out[...] = jnp.concatenate([m_scr[...].T[:1], l_scr[...].T[:1]], axis=0)
        acc_out[...] = acc_scr[...]


def paged_mla(q_lat_MgNR, q_pe_MgNP, row_M, live_M, pages_LAYC, scales_LA2Y, layer, table_BW, lengths_B,
              R: int, pad: int = 0, *, blocks: Blocks | None = None, interpret: bool = False):
    """The online-softmax state of each query group over its row's cached keys (positions < lengths[row],
    none for a group not live), reading the pool in place.

    q_lat [M, g, N, R], q_pe [M, g, N, P] (scaled, the compute dtype); row [M] int32, live [M] bool; pages
    [L, A, Y, C + pad] (e4m3 with scales [L, A, 2 * Y], or scales None); layer: a scalar index; table [B, W]
    (global page ids); lengths [B]. -> (m, l [M, g, N], acc [M, g, N, R]) float32, as k2jax.ops.ragged.over_cache.
    blocks: default BLOCKS["v5p"]. interpret: Pallas' interpreter (CPU tests)."""
    M, g, N, _ = q_lat_MgNR.shape
    P = q_pe_MgNP.shape[-1]
    _, _, Y, Cp = pages_LAYC.shape
    C = Cp - pad
    assert C == R + P, (C, R, P)
    B, W = table_BW.shape
    b = blocks or BLOCKS["v5p"]
    v = max(1, min(b.keys // Y, W))  # pages per visit
    visits = -(-W // v)
    rows = fit_rows(b.rows, g, N)
    tiles = g * N // rows
    quantized = scales_LA2Y is not None
    len_M = jnp.where(live_M, lengths_B[row_M], 0).astype(jnp.int32)
    table = table_BW.astype(jnp.int32).reshape(-1)
    layer_1 = jnp.asarray(layer, jnp.int32).reshape(1)
    q_lat = q_lat_MgNR.reshape(M, g * N, R)
    q_pe = q_pe_MgNP.reshape(M, g * N, P)

    def page_of(i, grp, j, row_ref, len_ref):
        """(row, w): the visit's i-th page of the group's row, or past the row's keys the last page it needs
        (the same block as before: no new DMA)."""
        need = jnp.maximum(jax.lax.div(len_ref[grp] + Y - 1, Y), 1)  # lax.div: Mosaic lowers no sign op
        return row_ref[grp], jnp.minimum(jnp.minimum(j * v + i, need - 1), W - 1)

    def page_map(i):
        def index(grp, t, j, row_ref, len_ref, table_ref, layer_ref):
            row, w = page_of(i, grp, j, row_ref, len_ref)
            return layer_ref[0], table_ref[row * W + w], 0, 0
        return index

    def scale_map(i):
        def index(grp, t, j, row_ref, len_ref, table_ref, layer_ref):
            return (*page_of(i, grp, j, row_ref, len_ref), 0, 0)
        return index

    def q_map(grp, t, j, *_):
        return grp, t, 0

    in_specs = [pl.BlockSpec((None, rows, R), q_map), pl.BlockSpec((None, rows, P), q_map)]
    in_specs += [pl.BlockSpec((None, None, Y, Cp), page_map(i)) for i in range(v)]
    args = [pages_LAYC] * v
    if quantized:
        # The rows' pages' scales, gathered by XLA (8 bytes a token beside a page's 640): rows [2, Y] per page.
        s_BW2Y = scales_LA2Y[layer, table_BW].reshape(B, W, 2, Y)
        in_specs += [pl.BlockSpec((None, None, 2, Y), scale_map(i)) for i in range(v)]
        args += [s_BW2Y] * v
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4, grid=(M, tiles, visits), in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, 2, rows), lambda grp, t, j, *_: (grp, t, 0, 0)),
                   pl.BlockSpec((None, rows, R), q_map)],
        scratch_shapes=[pltpu.VMEM((rows, _LANES), jnp.float32), pltpu.VMEM((rows, _LANES), jnp.float32),
                        pltpu.VMEM((rows, R), jnp.float32)])
    f32 = jnp.float32
    out_shape = [jax.ShapeDtypeStruct((M, tiles, 2, rows), f32), jax.ShapeDtypeStruct((M, g * N, R), f32)]
    page_bytes = Y * (Cp * pages_LAYC.dtype.itemsize + (8 if quantized else 0))
    cost = pl.CostEstimate(  # the keys a full table would read (once per row tile); the kernel reads only
        flops=2 * M * g * N * W * Y * (R + P + R), transcendentals=M * g * N * W * Y,  # the rows' own
        bytes_accessed=int(M * tiles * W * page_bytes + q_lat.size * q_lat.dtype.itemsize * (R + P) // R
                           + M * g * N * (R + 2) * 4))
    ml, acc = pl.pallas_call(
        functools.partial(_kernel, v=v, Y=Y, R=R, C=C, quantized=quantized, visits=visits),
        out_shape=out_shape, grid_spec=spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"),
                                             vmem_limit_bytes=b.vmem),
        cost_estimate=cost, interpret=interpret,
    )(row_M.astype(jnp.int32), len_M, table, layer_1, q_lat, q_pe, *args)
    m, l = (ml[:, :, i].reshape(M, g, N) for i in range(2))
    return m, l, acc.reshape(M, g, N, R)
