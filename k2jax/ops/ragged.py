"""The ragged step over the paged latent cache: one flat batch of new tokens from many rows (the decoding rows'
one token each and prompt chunks of any lengths, together), each row with its own cached length and
page-table row. k2jax.runtime.layout lays the batch out.

The flat batch holds T = D + M * G tokens:
- tokens [0, D), the decode region: a decoding row's one token each (row_T says whose), or, in a verifying
  step (speculative decoding), a row's few consecutive tokens: its last sampled token and its drafts;
- tokens [D, T), the chunk region: M blocks of G tokens, each block one row's consecutive new tokens (a row's
  chunk takes whole blocks, the last one padded), so a block reads its row's pages once for all its tokens.
Padding tokens (valid_T False) are computed but never written. A valid token t of row b sits at position
pos_T[t] = lengths[b] + its index among the row's new tokens: it sees the row's cached tokens (positions <
lengths[b]) and the row's new tokens up to its own position.

`ragged_attention` is the XLA form (the reference, and the CPU path): absorbed attention (K2_REFERENCE.md §3:
W_UK folded into the query, W_UV into the output, so the latent cache is never expanded per head), with an
online softmax that visits each row's pages a few at a time in a loop whose trip count is the step's longest
cached row, not a static read size: one program serves every cache length. Then the new tokens: a decode
token sees its row's decode tokens up to itself (itself alone, but for a verifying row's drafts); a chunk
block sees its row's blocks up to its own (the others are skipped, not masked).
On a TPU, each region's reads of its rows' cached keys run as a Pallas kernel that reads the pool in place
through the page table (k2jax.ops.paged_mla, the same metadata); `over_cache` is its XLA form.

Letters as in k2jax.nn.mla: T flat tokens, D decode tokens, M chunk blocks, G tokens per block, B rows,
W pages per row, A pages in the pool, Y tokens per page, N heads, R kv_lora_rank, P rope head dim, C = R + P,
K nope head dim, V value head dim. `g` is the tokens sharing one row's reads (1 in the decode region, G in the
chunk region), Z the keys one visit reads (visit_pages * Y).

On a mesh whose data-parallel shards split the pool (k2jax.ops.paged: each shard owns a contiguous part, its
trash page first), the flat batch has S segments, one per shard (k2jax.runtime.layout), and the model takes
it as tokens [S, T / S]: each shard attends over its own segment, rows and part of the pool under shard_map
(`RaggedCache.shards`), and reads or writes no other chip's pages. Without such a mesh the segments run one
after another: the plain form, equal by construction.

A step may also spread one row's chunk over every segment (k2jax.runtime.layout: each segment's last
`spread` tokens hold a piece of it), so a lone long prompt runs on every shard rather than on one
(`spread_attention`). Every shard lays that row's keys out once a layer: its cached pages, brought a visit
at a time (read by the shard that holds them, summed over the shards: `RaggedCache.row_keys`), then every
piece's new latents. Each piece then attends as a chunk block does, through `cache_state` (the paged kernel
on a TPU); the shard holding the row's pages writes them all.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from k2jax.ops.paged import TRASH_PAGE, gather_latents, head_blocks, quantize_latents, set_scales
from k2jax.ops.attention import absorbed_is_cheaper, stack_halves
from k2jax.ops.paged_mla import paged_mla
from k2jax.ops.quant import materialize
from k2jax.ops.spec import cutting_axes
from k2jax.sharding import per_shard, split_axes, split_specs

_NEG_INF = -1e30
# Cached keys an online-softmax visit reads per row (whole pages: at least one), for a decode token and for a
# chunk block (bench config, XLA:CPU: 8 rows decoding over 2048 cached keys 71 -> 52 ms with 512 rather than
# 256; a 512-token chunk over 3584 was slower with 512 or 1024, its intermediates being G times larger).
DECODE_VISIT_KEYS = 512
CHUNK_VISIT_KEYS = 256
CHUNK_TILE = 256  # new tokens per query and key tile in the chunk region (whole blocks)
# The expanded prefix form's tiles: each expands its first row's cached keys once per visit, so a chunk's
# tiles of one row expand the same keys again each; larger tiles, with fewer keys per visit (the same
# scores held at once), expand them fewer times.
PREFIX_TILE = 512
PREFIX_VISIT_KEYS = 128
UNROLL_TILES = 4  # up to this many tiles, each query tile takes its keys in one product (no loop)
# A spread row's cached keys brought to every shard per visit: each visit sums its pages over the shards (one
# collective a layer and visit), so visits are few and large.
SPREAD_VISIT_KEYS = 1024


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RaggedCache:
    """The paged pool (as k2jax.ops.paged.PagedCache: pages {group: [L, A, Y, C + pad]}, scales for an e4m3
    pool) with one ragged step's metadata: page_table [B, W] int32 (global page ids), lengths [B] int32 (tokens
    each row holds before the step), and per flat token row_T [T] int32 (global rows), pos_T [T] int32 and
    valid_T [T] bool (see the module docstring); decode (D) and block (G) static, each segment's; shards (S)
    static: the segments, split over shard_axes on a mesh whose data-parallel shards split the pool; spread
    (static): the tokens at the end of each segment that hold pieces of one row's chunk, the spread row (their
    row_T). The model takes it in place of a PagedCache (k2jax.nn.model.K2Model, with tokens [S, T / S])."""

    pages: dict
    scales: dict
    page_table: jax.Array
    lengths: jax.Array
    row_T: jax.Array
    pos_T: jax.Array
    valid_T: jax.Array
    rope_dim: int = dataclasses.field(metadata=dict(static=True))
    decode: int = dataclasses.field(default=0, metadata=dict(static=True))
    block: int = dataclasses.field(default=1, metadata=dict(static=True))
    pad: int = dataclasses.field(default=0, metadata=dict(static=True))
    shards: int = dataclasses.field(default=1, metadata=dict(static=True))
    shard_axes: tuple = dataclasses.field(default=(), metadata=dict(static=True))
    spread: int = dataclasses.field(default=0, metadata=dict(static=True))  # each segment's spread tokens
    # The groups' kv_b_proj stacks {group: [L, R, N, K + V]}, as the model hands them for a step
    # (K2Model.forward): a plain stack's layer is read in place, each half by its own product, where a
    # layer's slice handed in would be copied out of the stack (on a TPU, 2 x its 16 MiB a layer for Kimi K2).
    kv_b: dict = dataclasses.field(default_factory=dict)

    def replace(self, **changes) -> "RaggedCache":
        return dataclasses.replace(self, **changes)

    def positions(self, T: int):
        """The new tokens' positions [S, T] (T: one segment's tokens)."""
        assert T * self.shards == self.pos_T.shape[0], (T, self.shards, self.pos_T.shape)
        return self.pos_T.reshape(self.shards, T)

    def context(self, group: str, layer, dtype) -> "RaggedContext":
        """What layer `layer` of `group` attends over (k2jax.nn.block): the pool and the step's metadata."""
        return RaggedContext(self, group, layer, dtype)

    def each_shard(self, fn, args, dims, out_dims, head_dims=None, out_head_dims=None, head_axes=()):
        """fn(first_page, first_row, *args) -> tuple, once per segment, each arg split along its dim in `dims`
        (None: whole) into S parts and the outputs joined along `out_dims`; `first_page` and `first_row` are
        the global ids of the segment's shard's first page and row. Under shard_map on a mesh that splits
        shard_axes into S shards (and head_dims / out_head_dims over head_axes: k2jax.sharding.per_shard);
        without one, the segments one after another (S = 1: one call)."""
        S = self.shards
        A, B = next(iter(self.pages.values())).shape[1], self.page_table.shape[0]
        axes = split_axes(self.shard_axes, S)
        if axes:
            mesh = jax.sharding.get_abstract_mesh()
            if (n := math.prod(mesh.shape[a] for a in axes)) != S:
                raise ValueError(f"a ragged step of {S} segments on a mesh of {n} data-parallel shards")
            return per_shard(lambda s, *xs: fn(s * (A // S), s * (B // S), *xs), args, dims, out_dims, axes,
                             head_dims, out_head_dims, head_axes)
        if S == 1:
            return fn(0, 0, *args)

        def part(x, d, s):
            if d is None:
                return x
            n = x.shape[d] // S
            return jax.lax.slice_in_dim(x, s * n, (s + 1) * n, axis=d)

        outs = [fn(s * (A // S), s * (B // S), *(jax.tree.map(lambda x, d=d: part(x, d, s), a)
                                                  for a, d in zip(args, dims))) for s in range(S)]
        return tuple(jnp.concatenate(xs, d) for xs, d in zip(zip(*outs), out_dims))

    def regions(self, x_ST):
        """x [S, Ts, ...] (per token of each segment) -> (the segments' own tokens [S, Ts - X, ...], their spread
        tokens [S, X, ...]) (X: self.spread)."""
        Ts = x_ST.shape[1]
        return x_ST[:, :Ts - self.spread], x_ST[:, Ts - self.spread:]

    def flat_regions(self, x_T):
        """regions() of a flat per-token array [T] -> [S * (Ts - X)], [S * X]."""
        own, spread = self.regions(x_T.reshape(self.shards, -1))
        return own.reshape(-1), spread.reshape(-1)

    def spread_row(self):
        """The spread row's id (a traced int32): every spread token's row."""
        return self.flat_regions(self.row_T)[1][0]

    def row_keys(self, group: str, layer, ids_v, C: int, R: int, dt):
        """Pages ids_v [v] (global ids, of one row) of layer `layer` -> [v * Y, C] in dt on every chip: on a mesh
        whose shards split the pool, each shard reads the ones it holds (zeros for the others) and the shards'
        reads are summed (one holds each page: the sum is that page, exactly)."""
        pages, scales = self.pages[group], self.scales.get(group)
        axes = split_axes(self.shard_axes, self.shards)

        def read(first_page, ids_v, pages, scales):
            A = pages.shape[1]
            mine = (ids_v >= first_page) & (ids_v < first_page + A)
            x_vYC = gather_latents(pages, scales, layer, jnp.where(mine, ids_v - first_page, TRASH_PAGE), C, R, dt)
            return jnp.where(mine[:, None, None], x_vYC, 0).reshape(-1, C)

        if not axes:
            return read(0, ids_v, pages, scales)

        def one(shard, ids_v, pages, *scales):
            return (jax.lax.psum(read(shard * pages.shape[1], ids_v, pages, *(scales or (None,))), axes),)

        held = () if scales is None else (scales,)
        (x_ZC,) = per_shard(one, (ids_v, pages) + held, (None, 1) + (1,) * len(held), (None,), axes)
        return x_ZC

    def append(self, new: dict, count_B=None) -> "RaggedCache":
        """The cache with every valid token's latents written at its row's page and slot for pos_T, and each
        row's length advanced by its valid tokens (count_B is not used: the metadata says). new: {group: {"ckv":
        [L, S, T / S, R], "k_pe": [L, S, T / S, P]}}. Padding goes to the trash page. Donate to write in
        place."""
        pages, scales = dict(self.pages), dict(self.scales)
        valid_T = self.valid_T
        if self.spread:  # the spread tokens are written below, by the shard that holds the row's pages
            own_ST, spread_SX = self.regions(valid_T.reshape(self.shards, -1))
            valid_T = jnp.concatenate([own_ST, jnp.zeros_like(spread_SX)], 1).reshape(-1)
            row = self.spread_row()
            spread_meta = (self.page_table[row][None], jnp.zeros_like(self.flat_regions(self.row_T)[1]),
                           self.flat_regions(self.pos_T)[1], self.flat_regions(self.valid_T)[1])
        meta = (self.page_table, self.row_T, self.pos_T, valid_T)
        for g, kv in new.items():
            x_LSTC = jnp.concatenate([kv["ckv"], kv["k_pe"].astype(kv["ckv"].dtype)], -1)
            R = kv["ckv"].shape[-1]
            held = (scales[g],) if self.scales else ()
            out = self.each_shard(functools.partial(_write, R=R, pad=self.pad), meta + (x_LSTC, pages[g]) + held,
                                  (0, 0, 0, 0, 1, 1) + (1,) * len(held), (1,) * (1 + len(held)))
            if self.spread:  # every piece, on every shard (written where the row's pages are, else trashed)
                L, C = x_LSTC.shape[0], x_LSTC.shape[-1]
                x_L1ZC = x_LSTC[:, :, x_LSTC.shape[2] - self.spread:].reshape(L, 1, -1, C)
                out = self.each_shard(lambda first_page, _, *xs: _write(first_page, 0, *xs, R=R, pad=self.pad),
                                      spread_meta + (x_L1ZC,) + out, (None,) * 5 + (1,) * len(out),
                                      (1,) * len(out))
            if held:
                pages[g], scales[g] = out
            else:
                (pages[g],) = out
        added_B = jnp.zeros_like(self.lengths).at[self.row_T].add(self.valid_T.astype(self.lengths.dtype))
        return dataclasses.replace(self, pages=pages, scales=scales, lengths=self.lengths + added_B)


def _local_table(first_page, table_BW, pages_LAYC):
    """A segment's page table with its shard's global page ids made local to its part of the pool; any other
    id (an unfed row's trash page of another shard) becomes the part's own trash page."""
    A = pages_LAYC.shape[1]
    return jnp.where((table_BW >= first_page) & (table_BW < first_page + A), table_BW - first_page, TRASH_PAGE)


def _write(first_page, first_row, table_BW, row_T, pos_T, valid_T, x_L1TC, pages_LAYC, scales_LA2Y=None, *, R,
           pad):
    """One segment's writes (RaggedCache.append) into its shard's part of the pool -> (pages, [scales])."""
    Y, W = pages_LAYC.shape[2], table_BW.shape[1]
    table_BW = _local_table(first_page, table_BW, pages_LAYC)
    page_T = jnp.where(valid_T, table_BW[row_T - first_row, jnp.clip(pos_T // Y, 0, W - 1)], TRASH_PAGE)
    slot_T = jnp.where(valid_T, pos_T % Y, 0)
    x_LTC = x_L1TC[:, 0]
    if scales_LA2Y is not None:
        x_LTC, s_LT2 = quantize_latents(x_LTC, R)
        scales_LA2Y = set_scales(scales_LA2Y, page_T, slot_T, s_LT2)
    x_LTC = jnp.pad(x_LTC.astype(pages_LAYC.dtype), [(0, 0), (0, 0), (0, pad)])
    pages_LAYC = pages_LAYC.at[:, page_T, slot_T].set(x_LTC)
    return (pages_LAYC,) if scales_LA2Y is None else (pages_LAYC, scales_LA2Y)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class InPlaceKV:
    """One layer's kv_b_proj halves read out of the plain stack: uk_RNK [R, N, K] (W_UK) and uv_RNV [R, N, V]
    (W_UV), in the params' layout (k2jax.ops.attention.stack_halves)."""

    uk_RNK: jax.Array
    uv_RNV: jax.Array


@dataclasses.dataclass(frozen=True)
class BlocksKV:
    """One layer of an fp8 kv_b_proj stack whose scale blocks each cover whole columns of one head's K or V
    part (k2jax.ops.paged.head_blocks): the decode tokens' products read its values in place, each block's
    scale taken after the product over K or on the latent before the one over R."""

    stack: object
    layer: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HeadMajorKV:
    """kv_b_proj split and held head-major: uk_NRK [..., N, R, K] (W_UK) and uv_NVR [..., N, V, R] (W_UV),
    the layouts XLA:CPU's head-batched products take (a runtime's copy of the params' [..., R, N, K + V]:
    k2jax.nn.model.head_major_kv). Given the params' layout, each step's layer transposes its slices into these
    (bench config: 0.3-0.6 ms a layer, for a decode step's 16 tokens). Indexing it (tree.map) indexes both."""

    uk_NRK: jax.Array
    uv_NVR: jax.Array


def kv_b_split(w_kv_b, K: int, dt):
    """(W_UK [N, R, K], W_UV [N, V, R]) of kv_b_proj: a HeadMajorKV's own arrays, or the halves of an InPlaceKV
    or the slices of w_kv_b [R, N, K + V] (plain or quantized, dequantized to dt) transposed."""
    if isinstance(w_kv_b, HeadMajorKV):
        return w_kv_b.uk_NRK.astype(dt), w_kv_b.uv_NVR.astype(dt)
    if isinstance(w_kv_b, InPlaceKV):
        uk_RNK, uv_RNV = w_kv_b.uk_RNK.astype(dt), w_kv_b.uv_RNV.astype(dt)
    elif isinstance(w_kv_b, BlocksKV):
        w_RNX = materialize(w_kv_b.stack[w_kv_b.layer], dt)
        uk_RNK, uv_RNV = w_RNX[..., :K], w_RNX[..., K:]
    else:
        w_RNX = materialize(w_kv_b, dt)
        uk_RNK, uv_RNV = w_RNX[..., :K], w_RNX[..., K:]
    return jnp.transpose(uk_RNK, (1, 0, 2)), jnp.transpose(uv_RNV, (1, 2, 0))


def _absorb_uk(q_TNK, w_kv_b, K: int, dt):
    """q_nope [T, N, K] through W_UK -> [T, N, R] float32; an InPlaceKV's half multiplied as held (no transposed
    copy of it)."""
    if isinstance(w_kv_b, InPlaceKV):
        return jnp.einsum("TNK,RNK->TNR", q_TNK, w_kv_b.uk_RNK.astype(dt), preferred_element_type=jnp.float32)
    if isinstance(w_kv_b, BlocksKV):
        return sum(jnp.einsum("TNk,RNk->TNR", q_TNK[..., cols], values.astype(dt),
                              preferred_element_type=jnp.float32) * s_NR
                   for cols, values, s_NR in head_blocks(w_kv_b.stack, K, w_kv_b.layer, "K"))
    w_uk_NRK, _ = kv_b_split(w_kv_b, K, dt)
    return jnp.einsum("TNK,NRK->TNR", q_TNK, w_uk_NRK, preferred_element_type=jnp.float32)


def _apply_uv(o_TNR, w_kv_b, K: int, dt):
    """Latent outputs [T, N, R] through W_UV -> [T, N, V] float32 (an InPlaceKV's half as held)."""
    if isinstance(w_kv_b, InPlaceKV):
        return jnp.einsum("TNR,RNV->TNV", o_TNR, w_kv_b.uv_RNV.astype(dt), preferred_element_type=jnp.float32)
    if isinstance(w_kv_b, BlocksKV):
        return jnp.concatenate([
            jnp.einsum("TNR,RNv->TNv", (o_TNR.astype(jnp.float32) * s_NR).astype(dt), values.astype(dt),
                       preferred_element_type=jnp.float32)
            for _, values, s_NR in head_blocks(w_kv_b.stack, K, w_kv_b.layer, "V")], axis=-1)
    _, w_uv_NVR = kv_b_split(w_kv_b, K, dt)
    return jnp.einsum("TNR,NVR->TNV", o_TNR, w_uv_NVR, preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True)
class RaggedContext:
    """One layer's view of a RaggedCache, handed to the attention (k2jax.nn.mla)."""

    cache: RaggedCache
    group: str
    layer: jax.Array
    dtype: jnp.dtype

    def attend(self, q_nope_BTNK, q_pe_BTNP, ckv_BTR, k_pe_BTP, w_kv_b_RNX, kv_valid_BT, scale, impl="auto"):
        """The new tokens' attention (B = S: the flat batch's segments) -> [S, T, N, V]; see ragged_attention,
        run per segment (RaggedCache.each_shard). kv_valid and impl are not used: the step's metadata says
        which tokens are real, and there is one form."""
        c = self.cache
        scales = c.scales.get(self.group)
        stack = c.kv_b.get(self.group)
        K = q_nope_BTNK.shape[-1]
        if isinstance(stack, jax.Array):  # this layer's halves read in place
            w_kv_b_RNX = InPlaceKV(*stack_halves(stack, self.layer, K, self.dtype))
        elif stack is not None and head_blocks(stack, K):  # fp8 in head-aligned blocks, read as held
            w_kv_b_RNX = BlocksKV(stack, self.layer)

        # Heads split over the mesh's tensor axes, as the projections around hold them: each chip attends
        # with its own heads' queries and kv_b_proj columns (the latent pool is whole on every chip of a
        # shard), not every head on each (a kv_b_proj read as fp8 blocks keeps every head: its blocks are
        # the stack's).
        split = isinstance(w_kv_b_RNX, InPlaceKV) or (isinstance(w_kv_b_RNX, jax.Array)
                                                      and w_kv_b_RNX.ndim == 3)
        spec = split_specs(("heads",), q_nope_BTNK.shape[2:3]) if split else None
        head_axes = cutting_axes(spec[0], dict(jax.sharding.get_abstract_mesh().shape)) if spec else ()

        # Each new token's tensors as the segments' own tokens and their spread ones (attended below).
        (q_nope, spread_q_nope), (q_pe, spread_q_pe) = c.regions(q_nope_BTNK), c.regions(q_pe_BTNP)
        (ckv, spread_ckv), (k_pe, spread_k_pe) = c.regions(ckv_BTR), c.regions(k_pe_BTP)
        (pos, spread_pos), (valid, spread_valid) = (c.regions(x.reshape(c.shards, -1)) for x in (c.pos_T, c.valid_T))
        # (argument, its segment dim, its head dim): the kv_b_proj halves go in split by heads, else whole
        # (closed over).
        named = {"q_nope": (q_nope, 0, 2), "q_pe": (q_pe, 0, 2), "ckv": (ckv, 0, None), "k_pe": (k_pe, 0, None),
                 "table": (c.page_table, 0, None), "lengths": (c.lengths, 0, None),
                 "row": (c.flat_regions(c.row_T)[0], 0, None), "pos": (pos.reshape(-1), 0, None),
                 "valid": (valid.reshape(-1), 0, None), "pages": (c.pages[self.group], 1, None)}
        if head_axes:
            named["w"] = (w_kv_b_RNX, None, 1)
        if scales is not None:
            named["scales"] = (scales, 1, None)

        def one(first_page, first_row, *xs):
            a = dict(zip(named, xs))
            out_TNV = ragged_attention(a["q_nope"][0], a["q_pe"][0], a["ckv"][0], a["k_pe"][0],
                                       a.get("w", w_kv_b_RNX), scale, a["pages"], a.get("scales"), self.layer,
                                       _local_table(first_page, a["table"], a["pages"]), a["lengths"],
                                       a["row"] - first_row, a["pos"], a["valid"], c.decode, c.block, c.pad,
                                       self.dtype)
            return (out_TNV[None],)

        args, dims, heads = zip(*named.values())
        parts = []
        if c.spread < q_nope_BTNK.shape[1]:  # the segments' own tokens, each segment on its shard
            parts += c.each_shard(one, args, dims, (0,), heads, (2,), head_axes)
        if not c.spread:
            return parts[0]
        row = c.spread_row()
        Y = c.pages[self.group].shape[2]
        R = ckv_BTR.shape[-1]
        C = R + k_pe_BTP.shape[-1]
        spread_BTNV = spread_attention(
            spread_q_nope, spread_q_pe, spread_ckv, spread_k_pe, w_kv_b_RNX, scale,
            lambda ids_v: c.row_keys(self.group, self.layer, ids_v, C, R, self.dtype), c.page_table[row],
            c.lengths[row], spread_pos, spread_valid, Y, c.pad, self.dtype, split_axes(c.shard_axes, c.shards),
            head_axes)
        return jnp.concatenate(parts + [spread_BTNV], 1)


def ragged_attention(q_nope_TNK, q_pe_TNP, ckv_TR, k_pe_TP, w_kv_b_RNX, scale, pages_LAYC, scales_LA2Y, layer,
                     table_BW, lengths_B, row_T, pos_T, valid_T, decode: int, block: int, pad: int = 0,
                     dtype=None):
    """Attention of a ragged step's new tokens (laid out as the module docstring says) over their rows'
    cached tokens and their own row's new tokens.

    q_nope [T, N, K], q_pe [T, N, P] (rotated), ckv [T, R] (normalised), k_pe [T, P] (rotated): the new
    tokens'; w_kv_b [R, N, K + V] (or its HeadMajorKV); pages [L, A, Y, C + pad] (the group's pool; e4m3
    with scales [L, A, 2 * Y], or scales None) and `layer`, the index into it (read together with the page
    ids: one gather, no copy of the layer's pool); table [B, W]; lengths [B]; row, pos, valid [T]. -> [T, N,
    V] in `dtype` (default the new latents'). Scores and the softmax in float32."""
    T, N, K = q_nope_TNK.shape
    R = ckv_TR.shape[-1]
    dt = jnp.dtype(dtype or ckv_TR.dtype)
    f32 = jnp.float32
    q_pe_TNP = (q_pe_TNP.astype(f32) * scale).astype(dt)
    ckv_TR, k_pe_TP = ckv_TR.astype(dt), k_pe_TP.astype(dt)
    D, G = decode, block
    M = (T - D) // G
    assert D + M * G == T, f"{T} tokens are not {D} decode tokens and whole blocks of {G}"
    pool = (pages_LAYC, scales_LA2Y, layer, table_BW, lengths_B, R, pad, dt)
    outs = []  # each region's normalised outputs [tokens, N, V], float32
    if D:  # each token: its row's cached keys, then its row's tokens in the region up to itself
        q_lat_DNR = (_absorb_uk(q_nope_TNK[:D], w_kv_b_RNX, K, dt) * scale).astype(dt)
        st = cache_state(q_lat_DNR[:, None], q_pe_TNP[:D, None], row_T[:D], valid_T[:D], *pool,
                         DECODE_VISIT_KEYS)
        # The region's tokens as one group of D queries over its D keys (a decoding row's own token, and a
        # verifying row's tokens before it), each seeing its own row's up to its position.
        st = tuple(x.reshape((1, D) + x.shape[2:]) for x in st)
        s_1DND = _scores(q_lat_DNR[None], q_pe_TNP[None, :D], ckv_TR[None, :D], k_pe_TP[None, :D])
        see_DD = valid_T[None, :D] & (row_T[None, :D] == row_T[:D, None]) & (pos_T[None, :D] <= pos_T[:D, None])
        m, l, acc = (x[0] for x in _update(st, s_1DND, see_DD[None, :, None, :], ckv_TR[None, :D], dt))
        o_lat_DNR = (acc / jnp.where(l > 0, l, 1.0)[..., None]).astype(dt)  # padding sees nothing: 0, not NaN
        outs.append(_apply_uv(o_lat_DNR, w_kv_b_RNX, K, dt))
    if M:  # blocks of one row's tokens: its cached keys, then its new tokens up to each (expanded)
        w_uk_NRK, w_uv_NVR = kv_b_split(w_kv_b_RNX, K, dt)
        def blocks(x):
            return x[D:].reshape((M, G) + x.shape[1:])

        row_M, live_M = row_T[D::G], blocks(valid_T).any(1)
        q_nope_cNK = q_nope_TNK[D:]
        q_nope_TNK = (q_nope_cNK.astype(f32) * scale).astype(dt)
        Q = _tile(M * G, G, PREFIX_TILE)
        first_M = row_M == jnp.repeat(row_M[::Q // G], Q // G)  # each tile's first row's blocks
        expanded = not absorbed_is_cheaper(Q, R, K, K + w_uv_NVR.shape[1])  # long tiles: their first row's
        cached = live_M & ~first_M if expanded else live_M  # prefix expanded, once per tile; others absorbed
        prefixed_M = live_M & (lengths_B[row_M] > 0)  # the blocks whose rows have cached keys
        V = w_uv_NVR.shape[1]

        def absorbed():  # the blocks of `cached`, read absorbed; W_UV takes their latent sums to values
            q_lat_cNR = (_absorb_uk(q_nope_cNK, w_kv_b_RNX, K, dt) * scale).astype(dt)
            m1, l1, acc1 = (x.reshape((M * G,) + x.shape[2:]) for x in cache_state(
                q_lat_cNR.reshape(M, G, N, R), blocks(q_pe_TNP), row_M, cached, *pool, CHUNK_VISIT_KEYS))
            return m1, l1, jnp.einsum("TNR,NVR->TNV", acc1.astype(dt), w_uv_NVR, preferred_element_type=f32)

        def prefix():  # the blocks' states over their rows' cached keys
            if not expanded:
                return absorbed()
            return _merge([_over_cache_expanded(q_nope_TNK, q_pe_TNP[D:], jnp.repeat(first_M, G) & valid_T[D:],
                                                row_M[::Q // G], Q, *pool, w_uk_NRK, w_uv_NVR, PREFIX_VISIT_KEYS),
                           _unless_seen_nothing(jnp.any(cached & prefixed_M), absorbed, M * G, N, V)])

        # Skipped at run time where no block has cached keys (a step's chunks often start their rows), and the
        # absorbed form where only tiles' first rows have: their products over every chunk token otherwise
        # cost 20-40% of a chunk step on XLA:CPU (bench config, a lone 256, 512 or 2048-token chunk).
        state = _unless_seen_nothing(jnp.any(prefixed_M), prefix, M * G, N, V)
        m, l, acc = _merge([state, _over_chunk(q_nope_TNK, q_pe_TNP[D:], ckv_TR[D:], k_pe_TP[D:], w_uk_NRK,
                                                w_uv_NVR, row_M, pos_T[D:], valid_T[D:], G, dt)])
        outs.append(acc / jnp.where(l > 0, l, 1.0)[..., None])
    return jnp.concatenate(outs).astype(dt)


def spread_attention(q_nope_SXNK, q_pe_SXNP, ckv_SXR, k_pe_SXP, w_kv_b_RNX, scale, row_keys, table_W, length,
                     pos_SX, valid_SX, page_size: int, pad: int, dtype, shard_axes=(), head_axes=()):
    """The spread row's tokens' attention (X tokens in each of S segments, pieces of one row's chunk: see the
    module docstring) over the row's cached keys and its new tokens up to each one's position -> [S, X, N, V]
    in dtype.

    The row's keys are laid out once a layer on every shard, in position order, as one row's pages of a
    small pool: its cached keys (row_keys(ids_v) -> [v * Y, C] brings its pages ids_v to every shard,
    RaggedCache.row_keys, for as many visits as its `length`, the tokens its pages hold, needs), then every
    piece's new latents. Each segment's piece then attends as a chunk block does, absorbed: to the keys
    before its first token through `cache_state` (on a TPU the paged kernel, which holds the scores in VMEM:
    over a long chunk's keys they would be X x N x S·X floats a chip in HBM), and to itself causally.
    table_W: the row's pages (global ids); pos, valid: the spread tokens' (a padding token's output is not
    used); shard_axes: the segments' mesh axes where a mesh splits them, head_axes the heads' (else the
    segments as query groups of one call)."""
    S, X, N, K = q_nope_SXNK.shape
    R, P = ckv_SXR.shape[-1], k_pe_SXP.shape[-1]
    C = R + P
    dt = jnp.dtype(dtype)
    f32 = jnp.float32
    Y = page_size
    v = max(1, SPREAD_VISIT_KEYS // Y)
    W = table_W.shape[0]
    table_W = jnp.pad(table_W, [(0, -W % v)], constant_values=TRASH_PAGE)
    Z = v * Y

    # The row's keys by position: its cached ones, then the pieces from the one that starts at `length`.
    A = -(-(table_W.shape[0] * Y + S * X) // Y)  # the small pool's pages
    keys_AC = jax.lax.fori_loop(0, (length + Z - 1) // Z, lambda i, k: jax.lax.dynamic_update_slice_in_dim(
        k, row_keys(jax.lax.dynamic_slice_in_dim(table_W, i * v, v)), i * Z, 0), jnp.zeros((A * Y, C), dt))
    x_SXC = jnp.concatenate([ckv_SXR, k_pe_SXP.astype(ckv_SXR.dtype)], -1).astype(dt)
    first = jnp.argmax(valid_SX[:, 0] & (pos_SX[:, 0] == length))  # the segment of the chunk's first piece
    keys_AC = jax.lax.dynamic_update_slice_in_dim(keys_AC, jnp.roll(x_SXC, -first, 0).reshape(S * X, C), length, 0)
    pool_1AYC = jnp.pad(keys_AC.reshape(1, A, Y, C), [(0, 0), (0, 0), (0, 0), (0, pad)])
    start_S = jnp.where(valid_SX[:, 0], pos_SX[:, 0], 0)  # each piece's keys before it

    q_lat_SXNR = (_absorb_uk(q_nope_SXNK.reshape(S * X, N, K), w_kv_b_RNX, K, dt) * scale).astype(dt)
    q_pe_SXNP = (q_pe_SXNP.astype(f32) * scale).astype(dt)

    def pieces(_, q_lat_MXNR, q_pe_MXNP, x_MXC, pos_MX, valid_MX, start_M, pool_1AYC):  # M segments' pieces
        M = x_MXC.shape[0]
        table_MA = jnp.broadcast_to(jnp.arange(A, dtype=jnp.int32), (M, A))
        st = cache_state(q_lat_MXNR, q_pe_MXNP, jnp.arange(M), jnp.ones((M,), bool), pool_1AYC, None, 0,
                         table_MA, start_M, R, pad, dt, CHUNK_VISIT_KEYS)
        see_MX1X = (valid_MX[:, None, :] & (pos_MX[:, None, :] <= pos_MX[:, :, None]))[:, :, None, :]
        s_MXNX = _scores(q_lat_MXNR, q_pe_MXNP, x_MXC[..., :R], x_MXC[..., R:])
        _, l, acc = _update(st, s_MXNX, see_MX1X, x_MXC[..., :R], dt)
        return ((acc / jnp.where(l > 0, l, 1.0)[..., None]).astype(dt),)

    (o_lat_SXNR,) = per_shard(pieces, (q_lat_SXNR.reshape(S, X, N, R), q_pe_SXNP, x_SXC, pos_SX, valid_SX,
                                       start_S, pool_1AYC), (0, 0, 0, 0, 0, 0, None), (0,), shard_axes,
                              (2, 2, None, None, None, None, None), (2,), head_axes)
    return _apply_uv(o_lat_SXNR.reshape(S * X, N, R), w_kv_b_RNX, K, dt).astype(dt).reshape(S, X, N, -1)


def _unless_seen_nothing(any_keys, fn, Tc: int, N: int, V: int):
    """fn() -> (m, l [Tc, N], acc [Tc, N, V]) float32 where any_keys (a traced bool) says some query sees a key;
    else the state of having seen nothing, without running fn."""
    f32 = jnp.float32
    return jax.lax.cond(any_keys, fn, lambda: (jnp.full((Tc, N), _NEG_INF, f32), jnp.zeros((Tc, N), f32),
                                               jnp.zeros((Tc, N, V), f32)))


def _merge(parts):
    """The online-softmax state (m, l [T, N], acc [T, N, V]) over the union of the parts' disjoint keys."""
    m = functools.reduce(jnp.maximum, [p[0] for p in parts])
    a = [jnp.exp(p[0] - m) for p in parts]
    return m, sum(ai * p[1] for ai, p in zip(a, parts)), sum(ai[..., None] * p[2] for ai, p in zip(a, parts))


def _tile(Tc: int, G: int, most: int | None = None) -> int:
    """Tokens per tile of a chunk region of Tc tokens in blocks of G: at most `most` (default CHUNK_TILE),
    whole blocks, a divisor of Tc."""
    most = CHUNK_TILE if most is None else most
    Q = min(Tc, max(G, most // G * G))
    while Tc % Q:
        Q -= G
    return Q


def _scores(q_lat_MgNR, q_pe_MgNP, ckv_MZR, k_pe_MZP):
    """[M, g, N, Z] float32: each query against its group's keys."""
    f32 = jnp.float32
    return (jnp.einsum("MgNR,MZR->MgNZ", q_lat_MgNR, ckv_MZR, preferred_element_type=f32)
            + jnp.einsum("MgNP,MZP->MgNZ", q_pe_MgNP, k_pe_MZP, preferred_element_type=f32))


def _update(state, s_MgNZ, see_MgNZ, ckv_MZR, dt):
    """One online-softmax step: (m, l [M, g, N], acc [M, g, N, R]) after the keys `see` lets each query see
    (R: the values' columns, ckv's last axis)."""
    m, l, acc = state
    s_MgNZ = jnp.where(see_MgNZ, s_MgNZ, _NEG_INF)
    m_new = jnp.maximum(m, s_MgNZ.max(-1))
    p_MgNZ = jnp.where(see_MgNZ, jnp.exp(s_MgNZ - m_new[..., None]), 0.0)
    corr = jnp.exp(m - m_new)
    pv_MgNR = jnp.einsum("MgNZ,MZR->MgNR", p_MgNZ.astype(dt), ckv_MZR, preferred_element_type=jnp.float32)
    return m_new, l * corr + p_MgNZ.sum(-1), acc * corr[..., None] + pv_MgNR


def cache_state(q_lat_MgNR, q_pe_MgNP, row_M, live_M, pages_LAYC, scales_LA2Y, layer, table_BW, lengths_B, R,
                pad, dt, visit_keys: int):
    """over_cache's result, computed where the program runs: on a TPU by the Pallas kernel that reads the
    pool in place (k2jax.ops.paged_mla), elsewhere by over_cache itself."""
    def xla(*args):
        return over_cache(*args, R, pad, dt, visit_keys)

    def kernel(*args):
        return paged_mla(*args, R, pad)

    return jax.lax.platform_dependent(q_lat_MgNR, q_pe_MgNP, row_M, live_M, pages_LAYC, scales_LA2Y, layer,
                                      table_BW, lengths_B, tpu=kernel, default=xla)


def over_cache(q_lat_MgNR, q_pe_MgNP, row_M, live_M, pages_LAYC, scales_LA2Y, layer, table_BW, lengths_B, R, pad,
               dt, visit_keys: int):
    """The online-softmax state (m, l [M, g, N], acc [M, g, N, R], float32) of each query group (g tokens of
    one row: q_lat [M, g, N, R], q_pe [M, g, N, P], scaled) after its row's cached keys (positions <
    lengths[row]; none where live is False), read visit_keys at a time (whole pages) for as many visits as the
    step's longest live row needs: XLA's form, gathering each visit's pages."""
    M, g, N, _ = q_lat_MgNR.shape
    Y = pages_LAYC.shape[2]
    C = pages_LAYC.shape[-1] - pad
    v = max(1, visit_keys // Y)  # pages per visit
    W = table_BW.shape[1]
    table_MW = jnp.pad(table_BW, [(0, 0), (0, -W % v)], constant_values=TRASH_PAGE)[row_M]
    len_M = jnp.where(live_M, lengths_B[row_M], 0)
    visits = (jnp.max(len_M, initial=0) + v * Y - 1) // (v * Y)
    f32 = jnp.float32

    # Each visit's keys are multiplied whole, latent and rope columns together: slicing them apart copies the
    # visit on XLA:CPU. The values' product then also sums the rope columns, dropped at the end.
    q_MgNC = jnp.concatenate([q_lat_MgNR, q_pe_MgNP.astype(q_lat_MgNR.dtype)], -1)

    def visit(i, state):
        x_MZC = _visit_keys(pages_LAYC, scales_LA2Y, layer, table_MW, i, v, C, R, dt)
        see_MZ = (i * v * Y + jnp.arange(v * Y))[None, :] < len_M[:, None]
        s = jnp.einsum("MgNC,MZC->MgNZ", q_MgNC, x_MZC, preferred_element_type=f32)
        return _update(state, s, see_MZ[:, None, None, :], x_MZC, dt)

    init = (jnp.full((M, g, N), _NEG_INF, f32), jnp.zeros((M, g, N), f32), jnp.zeros((M, g, N, C), f32))
    m, l, acc = jax.lax.fori_loop(0, visits, visit, init)
    return m, l, acc[..., :R]


def _visit_keys(pages_LAYC, scales_LA2Y, layer, table_xW, i, v: int, C: int, R: int, dt):
    """Visit i's cached keys of each row of table_xW: its pages i*v .. i*v + v - 1 gathered (only those, not
    the layer's pool) and dequantized -> [x, v * Y, C] in dt."""
    ids_xv = jax.lax.dynamic_slice_in_dim(table_xW, i * v, v, axis=1)
    x_xvYC = gather_latents(pages_LAYC, scales_LA2Y, layer, ids_xv, C, R, dt)
    return x_xvYC.reshape(x_xvYC.shape[0], -1, C)


def _over_cache_expanded(q_nope_TNK, q_pe_TNP, query_T, row_n, Q: int, pages_LAYC, scales_LA2Y, layer,
                         table_BW, lengths_B, R, pad, dt, w_uk_NRK, w_uv_NVR, visit_keys: int):
    """The chunk region's tiles of Q tokens over their first row's cached keys, expanded per head once per
    tile and visit (for a long chunk the cheaper form, as in k2jax.ops.attention.attend): -> (m, l [T, N],
    acc [T, N, V]) for the queries of query_T [T] (the tokens of their tile's first row), nothing seen for
    the others. q_nope [T, N, K] and q_pe [T, N, P] scaled; row_n each tile's first row."""
    Tc, N, K = q_nope_TNK.shape
    n = Tc // Q
    Y = pages_LAYC.shape[2]
    C = pages_LAYC.shape[-1] - pad
    v = max(1, visit_keys // Y)
    W = table_BW.shape[1]
    table_nW = jnp.pad(table_BW, [(0, 0), (0, -W % v)], constant_values=TRASH_PAGE)[row_n]
    query_nQ = query_T.reshape(n, Q)
    len_n = jnp.where(query_nQ.any(1), lengths_B[row_n], 0)
    visits = (jnp.max(len_n, initial=0) + v * Y - 1) // (v * Y)
    f32 = jnp.float32

    def tiles(x):  # [T, N, ...] -> [n, N, Q, ...], head-major
        return jnp.moveaxis(x.reshape((n, Q) + x.shape[1:]), 2, 1)

    V = w_uv_NVR.shape[1]
    q_nope_nNQK, q_pe_nNQP = tiles(q_nope_TNK), tiles(q_pe_TNP)

    def visit(i, st):
        m, l, acc = st
        x_nZC = _visit_keys(pages_LAYC, scales_LA2Y, layer, table_nW, i, v, C, R, dt)
        k_nNZK = jnp.einsum("nZR,NRK->nNZK", x_nZC[..., :R], w_uk_NRK, preferred_element_type=f32).astype(dt)
        v_nNZV = jnp.einsum("nZR,NVR->nNZV", x_nZC[..., :R], w_uv_NVR, preferred_element_type=f32).astype(dt)
        s_nNQZ = (jnp.einsum("nNQK,nNZK->nNQZ", q_nope_nNQK, k_nNZK, preferred_element_type=f32)
                  + jnp.einsum("nNQP,nZP->nNQZ", q_pe_nNQP, x_nZC[..., R:], preferred_element_type=f32))
        # Keys past the row's length masked once: the first visit holds a tile's key 0, so m is finite
        # from then on and a masked key's exp is 0 (a tile that sees nothing is masked after the loop).
        key_nZ = (i * v * Y + jnp.arange(v * Y))[None, :] < len_n[:, None]
        s_nNQZ = jnp.where(key_nZ[:, None, None, :], s_nNQZ, _NEG_INF)
        m_new = jnp.maximum(m, s_nNQZ.max(-1))
        p_nNQZ = jnp.exp(s_nNQZ - m_new[..., None])
        corr = jnp.exp(m - m_new)
        pv = jnp.einsum("nNQZ,nNZV->nNQV", p_nNQZ.astype(dt), v_nNZV, preferred_element_type=f32)
        return m_new, l * corr + p_nNQZ.sum(-1), acc * corr[..., None] + pv

    init = (jnp.full((n, N, Q), _NEG_INF, f32), jnp.zeros((n, N, Q), f32), jnp.zeros((n, N, Q, V), f32))
    m, l, acc = jax.lax.fori_loop(0, visits, visit, init)
    m, l, acc = (jnp.moveaxis(x, 1, 2).reshape((Tc, N) + x.shape[3:]) for x in (m, l, acc))
    seen_T = (query_nQ & (len_n > 0)[:, None]).reshape(Tc, 1)
    return jnp.where(seen_T, m, _NEG_INF), jnp.where(seen_T, l, 0.0), jnp.where(seen_T[..., None], acc, 0.0)


def _over_chunk(q_nope_TNK, q_pe_TNP, ckv_TR, k_pe_TP, w_uk_NRK, w_uv_NVR, row_M, pos_T, valid_T, G: int, dt):
    """The chunk region's attention over its own new tokens, keys and values expanded per head (for many
    queries per key that is the cheaper form: K + P + V per query, key and head, against 2R + P absorbed):
    -> the online-softmax state (m, l [T, N], acc [T, N, V]) after each query's row's new tokens up to its
    position. Visited in tiles of CHUNK_TILE tokens (whole blocks): query tile i visits key tiles from the
    one holding its first row's first block up to itself (a row's blocks are consecutive; keys of other rows
    are masked), so a long chunk runs as a few large products and tiles of earlier rows are skipped.
    q_nope [T, N, K] and q_pe [T, N, P] scaled; ckv [T, R]; k_pe [T, P]; row_M the blocks' rows.

    Laid out as the rectangular step's expanded attention (k2jax.ops.attention.attend_expanded): head-major
    ([N, T, ...]: XLA:CPU runs heads in the middle as many small products), the rope columns beside the
    nope ones (one score product over K + P, not a second pass over the scores), and optimization barriers
    between the stages, which XLA:CPU may otherwise fuse into its matmuls."""
    Tc, N, K = q_nope_TNK.shape
    P = q_pe_TNP.shape[-1]
    Q = _tile(Tc, G)
    n = Tc // Q
    f32 = jnp.float32
    barrier = jax.lax.optimization_barrier
    k_NTK = barrier(jnp.einsum("TR,NRK->NTK", ckv_TR, w_uk_NRK, preferred_element_type=f32).astype(dt))
    v_NTV = barrier(jnp.einsum("TR,NVR->NTV", ckv_TR, w_uv_NVR, preferred_element_type=f32).astype(dt))
    q_NTH = jnp.concatenate([q_nope_TNK, q_pe_TNP], -1).transpose(1, 0, 2)
    k_NTH = jnp.concatenate([k_NTK, jnp.broadcast_to(k_pe_TP[None].astype(dt), (N, Tc, P))], -1)

    def tiles(x):  # [N, T, ...] -> [n, N, Q, ...]
        return jnp.moveaxis(x.reshape((x.shape[0], n, Q) + x.shape[2:]), 1, 0)

    def flat_tiles(x):
        return x.reshape((n, Q) + x.shape[1:])

    row_T = jnp.repeat(row_M, G)
    row_nQ, pos_nQ, valid_nQ = flat_tiles(row_T), flat_tiles(pos_T), flat_tiles(valid_T)

    def sees(q_rows, q_pos, k_rows, k_pos, k_valid):  # [1, queries, keys]: a row's keys up to the query
        return (k_valid[None, :] & (k_rows[None, :] == q_rows[:, None]) & (k_pos[None, :] <= q_pos[:, None]))[None]

    if n <= UNROLL_TILES:  # a short region: each query tile against every key up to its end, one product each
        outs = []
        for i in range(n):
            end = (i + 1) * Q
            s_NQS = barrier(jnp.einsum("NQH,NSH->NQS", q_NTH[:, i * Q:end], k_NTH[:, :end],
                                       preferred_element_type=f32))
            see_1QS = sees(row_nQ[i], pos_nQ[i], row_T[:end], pos_T[:end], valid_T[:end])
            s_NQS = jnp.where(see_1QS, s_NQS, _NEG_INF)
            m_NQ = s_NQS.max(-1)
            p_NQS = jnp.where(see_1QS, jnp.exp(s_NQS - m_NQ[..., None]), 0.0)
            l_NQ = p_NQS.sum(-1)
            # The probabilities normalised before they are rounded to dt, as a plain softmax would be (the
            # model's own forward: a prompt's scores then follow it to float32 rounding), then scaled back.
            p_NQS = barrier((p_NQS / jnp.where(l_NQ > 0, l_NQ, 1.0)[..., None]).astype(dt))
            acc_NQV = barrier(jnp.einsum("NQS,NSV->NQV", p_NQS, v_NTV[:, :end], preferred_element_type=f32))
            outs.append((m_NQ, l_NQ, acc_NQV * l_NQ[..., None]))
        m, l, acc = (jnp.concatenate([o[k] for o in outs], 1) for k in range(3))  # [N, Tc, ...]
        return jnp.moveaxis(m, 0, 1), jnp.moveaxis(l, 0, 1), jnp.moveaxis(acc, 0, 1)

    q, k, v = tiles(q_NTH), tiles(k_NTH), tiles(v_NTV)
    first_M = jnp.argmax(row_M[None, :] == row_M[:, None], axis=1)  # each block's row's first block
    lo_n = (first_M[::Q // G] * G) // Q  # the key tile of each query tile's first row's first block
    lo_n = jnp.where(valid_nQ.any(1), lo_n, n)  # a padding tile visits nothing

    def one_tile(i):
        def visit(j, st):
            m, l, acc = st
            s_NQZ = barrier(jnp.einsum("NQH,NZH->NQZ", q[i], k[j], preferred_element_type=f32))
            see_1QZ = sees(row_nQ[i], pos_nQ[i], row_nQ[j], pos_nQ[j], valid_nQ[j])
            s_NQZ = jnp.where(see_1QZ, s_NQZ, _NEG_INF)
            m_new = jnp.maximum(m, s_NQZ.max(-1))
            p_NQZ = jnp.where(see_1QZ, jnp.exp(s_NQZ - m_new[..., None]), 0.0)
            corr = jnp.exp(m - m_new)
            pv_NQV = barrier(jnp.einsum("NQZ,NZV->NQV", barrier(p_NQZ.astype(dt)), v[j],
                                        preferred_element_type=f32))
            return m_new, l * corr + p_NQZ.sum(-1), acc * corr[..., None] + pv_NQV

        V = v.shape[-1]
        init = (jnp.full((N, Q), _NEG_INF, f32), jnp.zeros((N, Q), f32), jnp.zeros((N, Q, V), f32))
        return jax.lax.fori_loop(lo_n[i], i + 1, visit, init)

    m, l, acc = jax.lax.map(one_tile, jnp.arange(n))  # [n, N, Q, ...]
    return (jnp.moveaxis(m, 1, 2).reshape(Tc, N), jnp.moveaxis(l, 1, 2).reshape(Tc, N),
            jnp.moveaxis(acc, 1, 2).reshape(Tc, N, -1))
