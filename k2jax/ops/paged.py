"""The paged latent KV cache: a pool of pages per layer group, and per row a page table and a length.

Per token and layer the cache holds only the normalised latent ckv [R] and the rotated shared rotary key
k_pe [P] (K2_REFERENCE.md §3: 576 values for Kimi K2, nothing per head), side by side: C = R + P values. A
pool {group: [L, A, Y, C]} holds A pages of Y tokens for every layer of a group (dense_layers, moe_layers);
row b of a batch owns the pages its table lists (page_table[b, w] holds its tokens w*Y .. w*Y + Y - 1) and
holds lengths[b] tokens. Rows read and write at their own positions: there is no shared index, and no row
is copied to decode it. Page 0 (of each shard's part of the pool, below) is the trash page: table entries a
row does not use point there, and the new tokens of padding positions are written there; nothing reads it
unmasked.

On a TPU each token's C values are padded with zeros to a multiple of 128 (`pad` trailing columns): a pool
whose minor dim is 576 is laid out pages-minor by the TPU compiler once it holds more than about a thousand
pages (128-wide tiles would pad 576 to 640 in the natural layout), and every step then copied the whole pool
three times to and from the layouts its gathers and scatters use (measured by the ahead-of-time compile,
k2jax.aot). A [.., 640] pool keeps its natural layout at any size, in the same bytes that layout takes.

A float8 pool holds e4m3 values with a float32 scale per token and part (ckv, k_pe), amax / 448 each: scales
[L, A, 2 * Y], a page's Y latent scales then its Y rope-key scales. (Held [L, A, Y, 2], the TPU lays them out
pages-minor, and a gather of the rows' pages' scales first copied the whole array to another layout.) Reads
dequantize only the pages they gather.

On a mesh the pool's page axis is split over `shard_axes` (the batch's mesh axes, k2jax.sharding's "batch"
rule, as the cache's maker chose them): each data-parallel shard owns a contiguous part of the pool, with its
own trash page first, and a row's pages lie in its shard's part. Page tables hold global page ids. A batch
whose rows those axes divide (rows in shard order, as NamedSharding splits them) reads and writes under
shard_map, so no chip reads another chip's pages; any other batch (its rows replicated, e.g. a lone
request) reads and writes the sharded pool by global id and leaves the partitioning to the compiler.

Letters: L layers, A pages in the pool, Y tokens per page, W pages per row (table width), B rows, T new
tokens per row, S = W * Y cached positions per row, C = R + P, R kv_lora_rank, P rope head dim.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from k2jax.ops.attention import attend_with_prefix, stack_halves
from k2jax.ops.collectives import gather
from k2jax.ops.paged_mla import paged_mla
from k2jax.ops.quant import is_quantized, materialize
from k2jax.sharding import cutting_axes, logical_to_spec, per_shard, shard_index, split_axes

E4M3_MAX = 448.0
TRASH_PAGE = 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedCache:
    """pages {group: [L, A, Y, C + pad]} (bf16 / f32 / e4m3); scales {group: [L, A, 2 * Y]} float32 for an e4m3
    pool, else {}; page_table [B, W] int32 (global page ids); lengths [B] int32; rope_dim P and shard_axes
    (the mesh axes the pool's pages are split over) static."""

    pages: dict
    scales: dict
    page_table: jax.Array
    lengths: jax.Array
    rope_dim: int = dataclasses.field(metadata=dict(static=True))
    shard_axes: tuple = dataclasses.field(default=(), metadata=dict(static=True))
    read_pages: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    pad: int = dataclasses.field(default=0, metadata=dict(static=True))  # zero columns after each token's C
    # The groups' kv_b_proj stacks {group: [L, R, N, K + V]} (plain, or fp8 QuantizedWeight; values only), as the
    # model hands them for a step (K2Model.forward): a decode step reads a layer's W_UK and W_UV out of them in
    # place (see PagedContext.decode_in_place, head_blocks).
    kv_b: dict = dataclasses.field(default_factory=dict)

    @property
    def page_size(self) -> int:
        return next(iter(self.pages.values())).shape[2]

    @property
    def num_pages(self) -> int:
        return next(iter(self.pages.values())).shape[1]

    @property
    def quantized(self) -> bool:
        return bool(self.scales)

    def replace(self, **changes) -> "PagedCache":
        return dataclasses.replace(self, **changes)

    def positions(self, T: int):
        """The positions [B, T] of T new tokens per row: lengths[b] + t."""
        return self.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]

    def context(self, group: str, layer, dtype):
        """What layer `layer` of `group` attends over (k2jax.nn.block): its PagedContext (for a step that
        reads no cached token, read_pages 0, a first prompt chunk: no prefix, and the layer's kv_b_proj read
        out of the stack where its tokens are split over the mesh)."""
        return PagedContext(self, group, layer, dtype)

    def in_place(self, B: int, N: int) -> bool:
        """Whether a step of B rows of N heads can read the pool in place, each shard its own part (the
        kernel's shard_map): the rows split like the pool (or there is one shard), and no mesh axis splits
        the heads, which the kernel would otherwise gather."""
        mesh = jax.sharding.get_abstract_mesh()
        if not mesh.shape:
            return True

        def split(axes):
            return [a for a in axes if mesh.shape.get(a, 1) > 1]

        heads = logical_to_spec(("heads",), (N,), dict(mesh.shape))[0]
        heads = () if heads is None else (heads,) if isinstance(heads, str) else heads
        return not split(heads) and (bool(split_axes(self.shard_axes, B)) or not split(self.shard_axes))

    def attend_pages(self, group: str, layer, q_lat_BgNR, q_pe_BgNP, interpret: bool = False):
        """The online-softmax state (m, l [B, g, N], acc [B, g, N, R], float32) of row b's g queries (absorbed
        and scaled: q_lat [B, g, N, R], q_pe [B, g, N, P]) over the row's cached tokens, read in place by the
        Pallas kernel (k2jax.ops.paged_mla), each data-parallel shard over its own part of the pool. See
        `in_place` for when it applies. interpret: Pallas' interpreter (CPU tests)."""
        pages, scales = self.pages[group], self.scales.get(group)
        R = q_lat_BgNR.shape[-1]

        def local(first, table_BW, lengths_B, q_lat, q_pe, layer, pages, *scales):
            B = table_BW.shape[0]
            return paged_mla(q_lat, q_pe, jnp.arange(B, dtype=jnp.int32), jnp.ones((B,), bool), pages,
                             scales[0] if scales else None, layer, table_BW - first, lengths_B, R, self.pad,
                             interpret=interpret)

        extra = () if scales is None else (scales,)
        table_BW = self.page_table if self.read_pages is None else self.page_table[:, :self.read_pages]
        return self._per_shard(local, (table_BW, self.lengths, q_lat_BgNR, q_pe_BgNP, layer, pages) + extra,
                               (0, 0, 0, 0, None, 1) + (1,) * len(extra), (0, 0, 0))

    def read(self, group: str, layer, dtype):
        """Layer `layer` (a traced index into the group's stack) of every row's cached tokens ->
        (ckv [B, S, R], k_pe [B, S, P] in `dtype`, valid [B, S] bool: position s < lengths[b])."""
        pages, scales = self.pages[group], self.scales.get(group)
        C = pages.shape[-1] - self.pad
        R = C - self.rope_dim

        def local(first, table_BW, layer, pages, *scales):
            B, W = table_BW.shape
            x_BWYC = gather_latents(pages, scales[0] if scales else None, layer, table_BW - first, C, R, dtype)
            return (x_BWYC.reshape(B, W * x_BWYC.shape[2], -1),)

        extra = () if scales is None else (scales,)
        table_BW = self.page_table if self.read_pages is None else self.page_table[:, :self.read_pages]
        (x_BSC,) = self._per_shard(local, (table_BW, layer, pages) + extra, (0, None, 1) + (1,) * len(extra),
                                   (0,))
        S = x_BSC.shape[1]
        valid_BS = jnp.arange(S)[None, :] < self.lengths[:, None]
        return x_BSC[..., :R], x_BSC[..., R:], valid_BS

    def append(self, new: dict, count_B) -> "PagedCache":
        """The cache with each row's first count_B[b] new tokens written at positions lengths[b] + t, and
        lengths advanced by count. new: {group: {"ckv": [L, B, T, R], "k_pe": [L, B, T, P]}}; the other
        new tokens (padding) go to the trash page. Donate the cache to write in place."""
        Y = self.page_size
        pages, scales = dict(self.pages), dict(self.scales)
        for g, kv in new.items():
            x_LBTC = jnp.concatenate([kv["ckv"], kv["k_pe"].astype(kv["ckv"].dtype)], -1)
            if self.quantized:
                R = kv["ckv"].shape[-1]
                x_LBTC, s_LBT2 = quantize_latents(x_LBTC, R)
            else:
                x_LBTC, s_LBT2 = x_LBTC.astype(pages[g].dtype), None
            if self.pad:
                x_LBTC = jnp.pad(x_LBTC, [(0, 0)] * 3 + [(0, self.pad)])

            if x_LBTC.shape[2] >= Y:  # a prompt chunk: whole pages at a time (see write_pages)
                out = self._write_pages(x_LBTC, s_LBT2, count_B, pages[g], scales.get(g) if s_LBT2 is not None
                                        else None)
                pages[g] = out[0]
                if s_LBT2 is not None:
                    scales[g] = out[1]
                continue

            def local(first, table_BW, lengths_B, count_B, x_LBTC, pages, *quant):
                T = x_LBTC.shape[2]
                table_BW = table_BW - first
                pos_BT = lengths_B[:, None] + jnp.arange(T)[None, :]
                real_BT = jnp.arange(T)[None, :] < count_B[:, None]
                w_BT = jnp.minimum(pos_BT // Y, table_BW.shape[1] - 1)
                page_BT = jnp.where(real_BT, jnp.take_along_axis(table_BW, w_BT, axis=1), TRASH_PAGE)
                slot_BT = jnp.where(real_BT, pos_BT % Y, 0)
                out = (pages.at[:, page_BT, slot_BT].set(x_LBTC),)
                if quant:  # (scales, new scales)
                    out += (set_scales(quant[0], page_BT, slot_BT, quant[1]),)
                return out

            quant = () if s_LBT2 is None else (scales[g], s_LBT2)
            out = self._per_shard(local, (self.page_table, self.lengths, count_B, x_LBTC, pages[g]) + quant,
                             (0, 0, 0, 1, 1) + (1,) * len(quant), (1,) * (1 + bool(quant)))
            pages[g] = out[0]
            if quant:
                scales[g] = out[1]
        return self.replace(pages=pages, scales=scales, lengths=self.lengths + count_B.astype(jnp.int32))

    def _write_pages(self, x_LBTC, s_LBT2, count_B, pages, scales):
        """append's writes of a chunk of T >= page_size tokens a row: write_pages on each shard's part of the
        pool. The rows split like the pool: per_shard. Otherwise (a lone row) every shard takes the whole
        chunk, gathered along the slice's rings where its tokens are split over the pool's axes (sequence
        parallel), and writes the pages it holds (the others go to its trash page)."""
        quant = () if scales is None else (scales, s_LBT2)
        args = (self.page_table, self.lengths, count_B, x_LBTC, pages) + quant
        if split_axes(self.shard_axes, args[0].shape[0]) or not self._pool_axes():
            return self._per_shard(lambda first, *a: write_pages(first, *a), args, (0, 0, 0, 1, 1) + (1,) * len(quant),
                                   (1,) * (1 + bool(quant)))
        mesh = jax.sharding.get_abstract_mesh()
        axes = self._pool_axes()
        shards = math.prod(mesh.shape[a] for a in axes)
        t_axes = cutting_axes(logical_to_spec(("length",), (x_LBTC.shape[2],), dict(mesh.shape))[0], dict(mesh.shape))

        def local(table_BW, lengths_B, count_B, x_LBTC, pages, *quant):
            shard = shard_index(axes)
            if t_axes:
                x_LBTC = gather(x_LBTC, t_axes, 2)
                quant = quant and (quant[0], gather(quant[1], t_axes, 2))
            return write_pages(shard * (self.num_pages // shards), table_BW, lengths_B, count_B, x_LBTC, pages,
                               *quant)

        pool = P(None, axes, None, None)
        x = P(None, None, t_axes or None, None)
        in_specs = (P(), P(), P(), x, pool) + ((P(None, axes, None), x) if quant else ())
        out_specs = (pool,) + ((P(None, axes, None),) if quant else ())
        return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)

    def _pool_axes(self) -> tuple[str, ...]:
        """The mesh axes that split the pool's pages (the cache's shard axes present on the mesh)."""
        return cutting_axes(self.shard_axes, dict(jax.sharding.get_abstract_mesh().shape))

    def _per_shard(self, fn, args, dims, out_dims):
        """fn(first, *args) per shard of the pool (k2jax.sharding.per_shard) when the rows (args[0], a [B, ...]
        array) split over shard_axes, `first` = the global id of the shard's first page; otherwise fn(0, *args)
        on the whole arrays: global page ids, and the compiler partitions the gathers and scatters."""
        axes = split_axes(self.shard_axes, args[0].shape[0])
        shards = math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in axes) if axes else 1
        return per_shard(lambda shard, *xs: fn(shard * (self.num_pages // shards), *xs), args, dims, out_dims, axes)


@dataclasses.dataclass(frozen=True)
class PagedContext:
    """One layer's view of a PagedCache, handed to the attention (k2jax.nn.mla)."""

    cache: PagedCache
    group: str
    layer: jax.Array
    dtype: jnp.dtype

    def read(self):
        """The layer's cached tokens, gathered: PagedCache.read (None when the step reads none)."""
        return None if self.cache.read_pages == 0 else self.cache.read(self.group, self.layer, self.dtype)

    def attend(self, q_nope_BTNK, q_pe_BTNP, ckv_BTR, k_pe_BTP, w_kv_b_RNX, kv_valid_BT, scale, impl="auto"):
        """The T new tokens' attention over the cached tokens and themselves -> [B, T, N, V].

        XLA's form (the reference, and the path off TPU): the cached tokens gathered (`read`), then
        k2jax.ops.attention.attend_with_prefix. On a TPU a decode step (T = 1, impl "auto", `in_place`) reads
        the pool in place instead: `decode_in_place`, the Pallas kernel."""
        B, T, N, _ = q_nope_BTNK.shape
        args = (q_nope_BTNK, q_pe_BTNP, ckv_BTR, k_pe_BTP, w_kv_b_RNX, kv_valid_BT)

        stack = self.cache.kv_b.get(self.group)
        in_stack = None if stack is None or is_quantized(stack) else (stack, self.layer)

        def gathered(*args):
            return attend_with_prefix(*args, scale, self.dtype, impl, self.read(), kv_b_stack=in_stack)

        if T != 1 or impl != "auto" or not self.cache.in_place(B, N):
            return gathered(*args)
        return jax.lax.platform_dependent(*args, tpu=functools.partial(self.decode_in_place, scale=scale),
                                          default=gathered)

    def decode_in_place(self, q_nope_BTNK, q_pe_BTNP, ckv_BTR, k_pe_BTP, w_kv_b_RNX, kv_valid_BT, scale,
                        interpret: bool = False):
        """Absorbed attention (K2_REFERENCE.md §3) of each row's new tokens over its cached tokens, read in
        place by the kernel (PagedCache.attend_pages), and then over the row's one new token itself (seen where
        kv_valid): the two online-softmax states merged, W_UV applied. For T = 1; shapes as `attend`."""
        B, T, N, K = q_nope_BTNK.shape
        assert T == 1, T
        dt, f32 = self.dtype, jnp.float32
        stack = self.cache.kv_b.get(self.group)
        blocks = stack is not None and head_blocks(stack, K)
        if blocks:  # fp8, read as held: each 128 columns' block scale taken after the product over K
            q_lat_BTNR = sum(jnp.einsum("BTNk,RNk->BTNR", q_nope_BTNK[..., cols], values.astype(dt),
                                        preferred_element_type=f32) * s_NR
                             for cols, values, s_NR in head_blocks(stack, K, self.layer, "K"))
        else:
            if stack is None or is_quantized(stack):
                w_kv_b_RNX = materialize(w_kv_b_RNX if stack is None else stack[self.layer], dt)
                w_uk_RNK, w_uv_RNV = w_kv_b_RNX[..., :K], w_kv_b_RNX[..., K:]
            else:  # each half read out of the stack by its own product: no copy of the layer's (two readers
                w_uk_RNK, w_uv_RNV = stack_halves(stack, self.layer, K, dt)  # of one slice would make one)
            q_lat_BTNR = jnp.einsum("BTNK,RNK->BTNR", q_nope_BTNK, w_uk_RNK, preferred_element_type=f32)
        q_lat_BTNR = (q_lat_BTNR * scale).astype(dt)
        q_pe_BTNP = (q_pe_BTNP.astype(f32) * scale).astype(dt)
        ckv_BTR, k_pe_BTP = ckv_BTR.astype(dt), k_pe_BTP.astype(dt)
        m, l, acc = self.cache.attend_pages(self.group, self.layer, q_lat_BTNR, q_pe_BTNP, interpret)
        s_BTN = (jnp.einsum("BTNR,BTR->BTN", q_lat_BTNR, ckv_BTR, preferred_element_type=f32)
                 + jnp.einsum("BTNP,BTP->BTN", q_pe_BTNP, k_pe_BTP, preferred_element_type=f32))
        see_BTN = jnp.broadcast_to(kv_valid_BT.astype(bool)[..., None], s_BTN.shape)
        m_new = jnp.where(see_BTN, jnp.maximum(m, s_BTN), m)
        corr, p_BTN = jnp.exp(m - m_new), jnp.where(see_BTN, jnp.exp(s_BTN - m_new), 0.0)
        l = l * corr + p_BTN
        acc = (acc * corr[..., None]
               + p_BTN.astype(dt).astype(f32)[..., None] * ckv_BTR.astype(f32)[:, :, None, :])
        o_lat_BTNR = acc / jnp.where(l > 0, l, 1.0)[..., None]  # a padding row sees nothing: 0
        if blocks:  # each head's V block scale taken onto its latent before the product over R
            return jnp.concatenate([
                jnp.einsum("BTNR,RNv->BTNv", (o_lat_BTNR * s_NR).astype(dt), values.astype(dt),
                           preferred_element_type=f32)
                for _, values, s_NR in head_blocks(stack, K, self.layer, "V")], axis=-1).astype(dt)
        return jnp.einsum("BTNR,RNV->BTNV", o_lat_BTNR.astype(dt), w_uv_RNV, preferred_element_type=f32).astype(dt)


def head_blocks(stack, K: int, layer=None, half: str = "K"):
    """An fp8 kv_b_proj stack [L, R, N, K + V] whose 128 x 128 scale blocks each cover whole columns of one
    head's K or V part (K and K + V multiples of the block): its scale then varies with R and N only within
    each 128 columns of a head, so a product over K (W_UK) takes it after the dot, and one over R (W_UV) on
    the small latent before it, and the fp8 values are read in place as they are held. The TPU compiler
    fuses the convert to bf16, but no block scale, into a dot: dequantizing first writes the layer's weight
    out and reads it back (about 11 GiB a decode step for Kimi K2 on v5p-64).

    Without `layer`: whether `stack` is such a stack. With it: for `half` "K" or "V", the list of
    (the column slice within that half, the layer's fp8 values of those columns [R, N, 128], their scales
    [N, R] float32, as they broadcast over [B, T, N, R]), one per 128 columns."""
    if layer is None:
        bo = getattr(stack, "block", (0, 0))[1]
        return is_quantized(stack) and stack.fmt == "fp8" and bo and K % bo == 0 and stack.shape[-1] % bo == 0
    bi, bo = stack.block
    R, N, X = stack.shape[-3:]
    start, width = (0, K) if half == "K" else (K, X - K)
    out = []
    for c in range(start, start + width, bo):
        s_RN = jnp.repeat(stack.scales[layer].astype(jnp.float32), bi, axis=0)[:R, (jnp.arange(N) * X + c) // bo]
        out.append((slice(c - start, c - start + bo), stack.values[layer, :, :, c:c + bo], s_RN.T))
    return out


def gather_latents(pages_LAYC, scales_LA2Y, layer, ids, C: int, R: int, dtype):
    """Pages `ids` (any shape [...]) of layer `layer`, gathered (those only, not the layer's pool) and
    dequantized -> [..., Y, C] in dtype. pages [L, A, Y, C + pad]; scales [L, A, 2 * Y] (a page's latent
    scales, then its rope keys') or None for unquantized pages."""
    x_YC = pages_LAYC[layer, ids][..., :C]
    if scales_LA2Y is None:
        return x_YC.astype(dtype)
    s_Y2 = page_scales(scales_LA2Y[layer, ids])
    f32 = jnp.float32
    return jnp.concatenate([x_YC[..., :R].astype(f32) * s_Y2[..., :1],
                            x_YC[..., R:].astype(f32) * s_Y2[..., 1:]], -1).astype(dtype)


def page_scales(s_X):
    """Pages' scales as held, [..., 2 * Y] -> [..., Y, 2] (each token's latent and rope-key scale)."""
    return jnp.swapaxes(s_X.reshape(s_X.shape[:-1] + (2, s_X.shape[-1] // 2)), -1, -2)


def write_pages(first, table_BW, lengths_B, count_B, x_LBTC, pages_LAYC, scales_LA2Y=None, s_LBT2=None):
    """pages (and scales) with each row's first count_B[b] new tokens x [L, B, T, C] written at positions
    lengths[b] + t, a page at a time, in place (dynamic updates of [L, 1, Y, C]): first the pages the row's
    tokens fill whole, each a slice of x written as it is, then the two a row's tokens may fill in part (the
    page it ends its cache in, the one its tokens end in), each read, merged with its new tokens and written
    back. `first`: the global id of this part of the pool's first page; a page outside it, or one a row does
    not reach, is written to the trash page.

    For chunks (T >= Y): a scatter of the tokens made XLA:TPU copy the whole pool to another layout and back
    (pages-major, as the scatter wants), 2.4 GiB a lone 8192-token prompt on v5p:4x4x4; these updates keep the
    pool as it is laid out. set_scales and the scatter stay the form for a few tokens a row (decode)."""
    L, B, T, _ = x_LBTC.shape
    A, Y = pages_LAYC.shape[1:3]
    W = table_BW.shape[1]
    quantized = scales_LA2Y is not None

    def page_id(b, w, used):
        page = jnp.take(table_BW[b], jnp.clip(w, 0, W - 1)) - first
        return jnp.where(used & (w < W) & (page >= 0) & (page < A), page, TRASH_PAGE)

    def row(a, b):
        return jax.lax.dynamic_index_in_dim(a, b, 1, keepdims=False)

    def scales_row(s_LY2):  # [L, Y, 2] -> a page's row [L, 1, 2 * Y]: its latent scales, then its rope ones
        return s_LY2.transpose(0, 2, 1).reshape(L, 1, 2 * Y)

    def whole(i, state):  # row b's k-th page filled whole, from token head + k·Y on
        pages, scales = state
        b, k = i // (T // Y), i % (T // Y)
        start, count = lengths_B[b], count_B[b]
        head = (Y - start % Y) % Y  # the tokens that finish the page the row's cache ends in
        tok = head + k * Y
        page = page_id(b, (start + tok) // Y, tok + Y <= count)
        x_L1YC = jax.lax.dynamic_slice_in_dim(row(x_LBTC, b), tok, Y, axis=1)[:, None]
        pages = jax.lax.dynamic_update_slice_in_dim(pages, x_L1YC.astype(pages.dtype), page, axis=1)
        if quantized:
            s_L2Y = scales_row(jax.lax.dynamic_slice_in_dim(row(s_LBT2, b), tok, Y, axis=1))
            scales = jax.lax.dynamic_update_slice_in_dim(scales, s_L2Y, page, axis=1)
        return pages, scales

    def part(i, state):  # row b's page e (0: where its cache ends, 1: where its new tokens end), merged
        pages, scales = state
        b, e = i // 2, i % 2
        start, count = lengths_B[b], count_B[b]
        first_tok = ends_B2[b, e]  # the new token at the page's slot 0 (negative: the page began earlier)
        w = (start + first_tok) // Y
        tok_Y = first_tok + jnp.arange(Y)
        new_Y = (tok_Y >= 0) & (tok_Y < count)
        # page 0 when the row's cache ends mid-page; page 1 when the tokens end mid-page, unless page 0 is
        # that page and is merged already (page 0's merge takes every new token it holds)
        head_part = start % Y != 0
        used = jnp.where(e == 0, head_part, ((start + count) % Y != 0) & ~(head_part & (w == start // Y)))
        used = used & (count > 0)
        page = page_id(b, w, used)
        # The page's tokens lie in the row's edge slice e (see `edges`); slot y takes its row y + first_tok - at.
        idx_Y = jnp.clip(tok_Y - at_B2[b, e], 0, Y - 1)

        def slots(edges_B2LYX):
            return jnp.take(edges_B2LYX[b, e], idx_Y, axis=1)

        x_LYC = slots(x_edges)
        old = jax.lax.dynamic_slice_in_dim(pages, page, 1, axis=1)
        merged = jnp.where(new_Y[None, None, :, None], x_LYC[:, None].astype(pages.dtype), old)
        pages = jax.lax.dynamic_update_slice_in_dim(pages, merged, page, axis=1)
        if quantized:
            s_L2Y = scales_row(slots(s_edges))
            old_s = jax.lax.dynamic_slice_in_dim(scales, page, 1, axis=1)
            merged_s = jnp.where(jnp.concatenate([new_Y, new_Y])[None, None, :], s_L2Y, old_s)
            scales = jax.lax.dynamic_update_slice_in_dim(scales, merged_s, page, axis=1)
        return pages, scales

    # Each row's two edge slices of Y tokens (where its cache's page ends, where its tokens' page ends), taken
    # before the loops: picked out of x inside the loop, XLA:TPU wanted all of x in another layout than the
    # whole pages' slices read it in (one more copy of the chunk).
    ends_B2 = jnp.stack([lengths_B // Y, (lengths_B + count_B) // Y], -1) * Y - lengths_B[:, None]
    at_B2 = jnp.clip(ends_B2, 0, T - Y)

    def edges(a_LBTX):
        return jax.vmap(lambda a_LTX, at_2: jnp.stack([jax.lax.dynamic_slice_in_dim(a_LTX, at_2[i], Y, axis=1)
                                                        for i in range(2)]), in_axes=(1, 0))(a_LBTX, at_B2)

    x_edges = edges(x_LBTC)
    s_edges = edges(s_LBT2) if quantized else None
    state = jax.lax.fori_loop(0, B * (T // Y), whole, (pages_LAYC, scales_LA2Y))
    pages, scales = jax.lax.fori_loop(0, B * 2, part, state)
    return (pages,) if scales is None else (pages, scales)


def set_scales(scales_LA2Y, page, slot, s_2):
    """scales [L, A, 2 * Y] with each token's two scales s [L, ..., 2] written at its page and slot (page and
    slot [...], int32: the token's)."""
    Y = scales_LA2Y.shape[-1] // 2
    part = jnp.asarray([0, Y], slot.dtype)
    return scales_LA2Y.at[:, page[..., None], slot[..., None] + part].set(s_2)


def quantize_latents(x_LBTC, R: int):
    """x -> (e4m3 values, float32 scales [..., 2]): one scale per token for ckv (the first R values) and one
    for k_pe, amax / 448 each."""
    x = x_LBTC.astype(jnp.float32)
    amax = jnp.stack([jnp.abs(x[..., :R]).max(-1), jnp.abs(x[..., R:]).max(-1)], -1)
    s = jnp.maximum(amax, 1e-12) / E4M3_MAX
    q = jnp.concatenate([x[..., :R] / s[..., :1], x[..., R:] / s[..., 1:]], -1)
    return q.astype(jnp.float8_e4m3fn), s


def batch_axes(B: int, mesh=None) -> tuple[str, ...]:
    """The mesh axes a batch of B rows is split over (k2jax.sharding's "batch" rule with its fallback), on
    `mesh` or the current one; () without a mesh. The pool's page axis is split over the same axes."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if not mesh.shape:
        return ()
    entry = logical_to_spec(("batch",), (B,), dict(mesh.shape))[0]
    axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    return tuple(a for a in axes if mesh.shape[a] > 1)
