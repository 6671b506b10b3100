"""Grouped matmul over expert stacks, quantized ones dequantized in VMEM: a Pallas TPU kernel.

Letters: M rows (each row belongs to one group: an expert's assignments, sorted by expert), E groups
(experts), I the contraction (input) dim, O the output dim.

    out[m, :] = x[m, :] @ dequantize(w)[group(m)]        x [M, I], w QuantizedWeight [E, I, O]

XLA:TPU fuses no dequantization into `ragged_dot` (nor into a plain dot with group scales): the weights are
first written to HBM in bf16 and read back, so a quantized decode step moves several times its weights'
bytes. Here each grid step loads a tile of the packed values and its scales into VMEM, dequantizes it there
and feeds the MXU: HBM sees the packed bytes once.

- The grid is (output tiles, visits, input tiles). A visit is a (row tile, group) pair with rows of that
  group in that tile, in row order (megablox's scheme): a tile spanning a group boundary is visited once
  per group, and each visit writes only its group's rows of the resident output block. Empty groups are
  never visited, so their weights are never read. The visit table is scalar-prefetched; the grid has a
  static bound of row tiles + E - 1 visits, and the spare ones repeat the last visit's blocks (no new DMA)
  and compute nothing.
- INT4 (values packed two per byte along O, low nibble first; bf16 scales per 32 inputs): a tile of packed
  bytes [ti, tn/2] holds O's even columns in its low nibbles and odd ones in its high nibbles. The two
  halves are dequantized and multiplied apart, and the scales' and the output's even / odd columns are
  taken and put back with exact one-hot matmuls (Mosaic has no lane-strided access).
- FP8 (e4m3 values, float32 scales per 128 x 128 block): an expert's scales come whole (tiny), a one-hot
  matmul spreads the tile's over its columns, and a tile dequantizes per 128 inputs.

- A layer of a stack: given every layer's stack [L, E, I, O] and a layer index, the index maps take the
  layer, so the kernel reads its tiles in place (a slice of the stack would be copied whole first: XLA:TPU
  passes no slice into a custom call). Plain (bf16) stacks go through the kernel this way too.

`gmm_reference` is the plain form (dequantize the whole stack, `ragged_dot`), which the kernel is tested
equal to, in interpret mode on CPU, and which stays XLA's path on other backends.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from k2jax.ops.quant import QuantizedWeight, dequantize_weight


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Rows, inputs and outputs per grid step (tm, ti, tn), the inputs dequantized at once inside a step
    (sub), and the scoped VMEM the kernel may use (bytes)."""

    tm: int = 512
    ti: int = 1024
    tn: int = 2048
    sub: int = 256
    vmem: int = 48 << 20


# Per TPU generation (k2jax.aot.topology's chip names): big input and output tiles, so that a decode step's
# few rows still move MiBs of weights per grid step (a step costs ~0.35 us of its own); `sub` bounds the
# float32 temporaries of dequantizing. Checked against VMEM by compiling for v5p and v6e (tests/test_gmm.py).
TILES = {"v5p": Tiles(), "v6e": Tiles(), "v5e": Tiles(ti=512, tn=1024, vmem=32 << 20), "v7x": Tiles()}


def gmm_reference(x_MI, w, sizes_E, out_dtype=None, layer=None):
    """The plain form: the whole stack dequantized to x's dtype, then `jax.lax.ragged_dot` with float32
    accumulation. x [M, I], w [E, I, O] (a QuantizedWeight or plain; with `layer`, every layer's stack
    [L, E, I, O], that layer's taken first), sizes [E] -> [M, O] in out_dtype (default x's); rows past
    Σ sizes give 0."""
    if layer is not None:
        w = jax.tree.map(lambda a: a[layer], w)
    wd = dequantize_weight(w, x_MI.dtype) if isinstance(w, QuantizedWeight) else w.astype(x_MI.dtype)
    y = jax.lax.ragged_dot(x_MI, wd, sizes_E.astype(jnp.int32), preferred_element_type=jnp.float32)
    return y.astype(x_MI.dtype if out_dtype is None else out_dtype)


def fit_tiles(tiles: Tiles, M: int, I: int, O: int, fmt: str) -> Tiles:
    """`tiles` fitted to the problem: tm at most M (rounded up to 8); sub a multiple of the scale block; ti
    a multiple of sub and tn of 256 (an int4 tile's even and odd halves each whole 128-lane columns), the
    largest not above the asked ones that divide I and O, so that the weights are never padded (a copy of
    them); where none does (odd test shapes), the dims are padded."""
    block = 32 if fmt == "int4" else 128

    def largest(limit: int, step: int, dim: int) -> int:
        sizes = [n for n in range(step, max(limit, step) + 1, step) if dim % n == 0]
        return max(sizes) if sizes else min(max(limit, step), -(-dim // step) * step)

    sub = largest(tiles.sub, block, I)
    ti = largest(tiles.ti, sub, I)
    tn = largest(tiles.tn, 256, O)
    tm = min(tiles.tm, -(-M // 8) * 8)
    return Tiles(tm, ti, tn, sub, tiles.vmem)


def visits(sizes_E, M: int, tm: int):
    """The visit table for rows sorted by group, sizes_E rows each, in row tiles of tm (M a multiple of tm).

    Real visits: a (group, row tile) pair per tile holding rows of the group, in row order. Then tail
    visits: one per tile wholly past Σ sizes, which writes zeros there (no visit would touch it otherwise).
    The table has the static length tiles + E - 1 (never fewer than needed); the spare entries repeat the
    last. -> (group_V, tile_V: the output tile, x_tile_V: the tile of x read, counts [2]: real visits, real
    + tail), int32. Tail visits read the last real visit's blocks of x and w, so they cost no DMA."""
    E = sizes_E.shape[0]
    tiles = M // tm
    V = tiles + E - 1
    sizes = sizes_E.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first = starts // tm
    last = jnp.maximum(ends - 1, 0) // tm
    count_E = jnp.where(sizes > 0, last - first + 1, 0)
    cum = jnp.cumsum(count_E)
    real = cum[-1]
    used = -(-ends[-1] // tm)  # tiles holding some row
    everything = real + tiles - used
    v = jnp.arange(V, dtype=jnp.int32)
    r = jnp.minimum(v, jnp.maximum(real - 1, 0))  # the real visit v is, or the last real one
    group = jnp.minimum(jnp.sum(cum[None, :] <= r[:, None], axis=1), E - 1).astype(jnp.int32)
    x_tile = jnp.clip(first[group] + r - (cum - count_E)[group], 0, tiles - 1).astype(jnp.int32)
    tail_tile = used + jnp.minimum(v, jnp.maximum(everything - 1, 0)) - real
    tile = jnp.where(v < real, x_tile, jnp.where(everything > real, tail_tile, x_tile)).astype(jnp.int32)
    return group, jnp.clip(tile, 0, tiles - 1), x_tile, jnp.stack([real, everything]).astype(jnp.int32)


def _onehot(rows: int, cols: int, fn):
    """[rows, cols] float32 with 1 where fn(row, col) holds: an exact lane permutation as a matmul."""
    r = jax.lax.broadcasted_iota(jnp.int32, (rows, cols), 0)
    c = jax.lax.broadcasted_iota(jnp.int32, (rows, cols), 1)
    return jnp.where(fn(r, c), 1.0, 0.0)


def _exact(a, b):
    """a @ b in float32 where b is one-hot: every product is one value times 1, so HIGHEST keeps it."""
    return jax.lax.dot(a, b, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


_LANES = 256  # output columns per one-hot pick / put: keeps its matrices small ([256, 128] float32)


def _kernel(group_ref, tile_ref, x_tile_ref, count_ref, starts_ref, ends_ref, layer_ref, x_ref, v_ref, *refs,
            fmt: str, t: Tiles, n_in: int):
    del layer_ref  # read by the index maps only
    s_ref, out_ref, *acc = (None,) + refs if fmt == "plain" else refs
    n, vis, k = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    live = vis < count_ref[0]  # a real visit; tail visits (up to count_ref[1]) only write zeros
    f32 = jnp.float32
    chunks = t.tn // _LANES

    @pl.when(live & (k == 0))
    def _():
        for a in acc:
            a[...] = jnp.zeros_like(a)

    @pl.when(live)
    def _():
        cdt = x_ref.dtype
        if fmt == "plain":
            acc[0][...] += jnp.dot(x_ref[...], v_ref[...].astype(cdt), preferred_element_type=f32)
            return
        half = t.tn // 2
        block = 32 if fmt == "int4" else 128
        g = t.sub // block  # scale rows per sub-tile
        rows_k = t.ti // block
        s_k = s_ref[pl.ds(pl.multiple_of(k * rows_k, rows_k), rows_k), :].astype(f32)  # this input tile's
        if fmt == "fp8":  # the tile's columns' scales, [rows_k, tn]: an exact one-hot matmul spreads them
            s_k = _exact(s_k, _onehot(s_k.shape[1], t.tn, lambda r, c: r == n * (t.tn // 128) + (c >> 7)))  # c >> 7: c // 128 without Mosaic's sign
        if fmt == "int4":
            # the scales of O's even and odd columns, [rows_k, tn/2] each (one-hot matmuls: exact)
            pick = [_onehot(_LANES, _LANES // 2, lambda r, c, o=o: r == 2 * c + o) for o in (0, 1)]
            s_k = [jnp.concatenate([_exact(s_k[:, c * _LANES:(c + 1) * _LANES], p) for c in range(chunks)], 1)
                   for p in pick]
        for j in range(t.ti // t.sub):  # a few sub-tiles, unrolled: static slices of the scales
            rows = slice(j * t.sub, (j + 1) * t.sub)
            x = x_ref[:, rows]
            if fmt == "int4":
                packed = v_ref[rows, :].astype(jnp.int32)
                for a, shift, sc in ((acc[0], 0, s_k[0]), (acc[1], 4, s_k[1])):
                    q = ((packed >> shift) & 0xF).astype(f32) - 8.0
                    w = (q.reshape(g, 32, half) * sc[j * g:(j + 1) * g][:, None, :]).reshape(t.sub, half)
                    a[...] += jnp.dot(x, w.astype(cdt), preferred_element_type=f32)
            else:
                q = v_ref[rows, :].astype(f32)
                w = (q.reshape(g, 128, t.tn) * s_k[j * g:(j + 1) * g][:, None, :]).reshape(t.sub, t.tn)
                acc[0][...] += jnp.dot(x, w.astype(cdt), preferred_element_type=f32)

    @pl.when((vis >= count_ref[0]) & (vis < count_ref[1]) & (k == n_in - 1))
    def _():
        out_ref[...] = jnp.zeros_like(out_ref)

    @pl.when(live & (k == n_in - 1))
    def _():
        if fmt == "int4":  # put the even and odd columns back in place: [tm, tn/2] x2 -> [tm, tn]
            h = _LANES // 2
            put = [_onehot(h, _LANES, lambda r, c, o=o: c == 2 * r + o) for o in (0, 1)]
            y = jnp.concatenate([_exact(acc[0][:, c * h:(c + 1) * h], put[0])
                                 + _exact(acc[1][:, c * h:(c + 1) * h], put[1]) for c in range(chunks)], 1)
        else:
            y = acc[0][...]
        g = group_ref[vis]
        row = tile_ref[vis] * t.tm + jax.lax.broadcasted_iota(jnp.int32, (t.tm, 1), 0)
        mine = (row >= starts_ref[g]) & (row < ends_ref[g])
        first = (vis == 0) | (tile_ref[jnp.maximum(vis - 1, 0)] != tile_ref[vis])
        before = jnp.where(first, jnp.zeros_like(out_ref[...]), out_ref[...])
        out_ref[...] = jnp.where(mine, y.astype(out_ref.dtype), before)


def _varying_struct(shape, dtype, *like):
    """A ShapeDtypeStruct that, under shard_map, varies over the manual mesh axes any of `like` varies over
    (pallas_call must be told). jax >= 0.9 names it manual_axis_type, earlier releases vma."""
    vma = frozenset().union(*(getattr(jax.typeof(a), "vma", frozenset()) for a in like))
    manual = getattr(jax.sharding, "ManualAxisType", None)
    if manual is not None:
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=manual(varying=vma))
    return jax.ShapeDtypeStruct(shape, dtype, vma=vma)


def gmm(x_MI, w, sizes_E, *, layer=None, tiles: Tiles | None = None, out_dtype=None, interpret=False):
    """x [M, I] (rows sorted by group), w [E, I, O]: a QuantizedWeight ("int4" or "fp8", in_ndim 1) or a plain
    array, sizes [E] (Σ ≤ M) -> [M, O] in out_dtype (default x's); rows past Σ sizes give 0. Equals
    gmm_reference.

    layer: None, or a traced int with w every layer's stack [L, E, I, O] (as the params hold them): the
    kernel then reads that layer's tiles straight out of the stack. XLA:TPU copies a slice of the stack into
    a buffer of its own before a kernel or `ragged_dot` reads it (a layer's local experts written and read
    again every step); the index maps take the layer instead, so HBM sees only the tiles used.

    tiles: default TILES["v5p"]; fitted to the shapes (fit_tiles). interpret: run the kernel in Pallas'
    interpreter (CPU tests)."""
    quantized = isinstance(w, QuantizedWeight)
    lead = 1 if layer is None else 2
    fmt = w.fmt if quantized else "plain"
    if (quantized and (fmt not in ("int4", "fp8") or w.lead_ndim != lead or w.in_ndim != 1)) or \
            (not quantized and w.ndim != lead + 2):
        want = "[E, I, O]" if layer is None else "[L, E, I, O] (with a layer)"
        got = f"{fmt} with lead {w.lead_ndim}, in {w.in_ndim} dims" if quantized else f"shape {w.shape}"
        raise ValueError(f"gmm takes a {want} plain, int4 or fp8 weight, got {got}")
    M, I = x_MI.shape
    E, I_w, O = w.shape[-3:]
    if I_w != I:
        raise ValueError(f"gmm: x has {I} inputs, the weight {I_w}")
    out_dtype = x_MI.dtype if out_dtype is None else out_dtype
    t = fit_tiles(tiles or TILES["v5p"], M, I, O, fmt)
    Mp, Ip, Op = -(-M // t.tm) * t.tm, -(-I // t.ti) * t.ti, -(-O // t.tn) * t.tn
    if layer is not None and (Ip, Op) != (I, O):  # odd shapes (tests): padding would copy the whole stack
        w, layer = jax.tree.map(lambda a: a[layer], w), None
    at = jnp.zeros((1,), jnp.int32) if layer is None else jnp.reshape(layer, (1,)).astype(jnp.int32)
    lead_pad = ((0, 0),) * (1 if layer is None else 2)
    x = jnp.pad(x_MI, ((0, Mp - M), (0, Ip - I)))
    sizes = sizes_E.astype(jnp.int32)
    values, scales = (w.values, w.scales) if quantized else (w, None)
    acc = [pltpu.VMEM((t.tm, t.tn), jnp.float32)]
    v_block = (t.ti, t.tn)
    if fmt == "int4":
        values = jnp.pad(values, lead_pad + ((0, Ip - I), (0, (Op - O) // 2)), constant_values=0x88)
        scales = jnp.pad(scales, lead_pad + ((0, (Ip - I) // 32), (0, Op - O)))
        s_block = (Ip // 32, t.tn)  # a column block's scales whole: read once per group and column block
        v_block = (t.ti, t.tn // 2)
        acc = [pltpu.VMEM((t.tm, t.tn // 2), jnp.float32)] * 2
    elif fmt == "fp8":
        values = jnp.pad(values, lead_pad + ((0, Ip - I), (0, Op - O)))
        if layer is not None:  # the layer's scales (a few KiB) taken first: padding the stack's would copy it
            scales = scales[at[0]]
        # columns padded to whole 128 lanes (a few KiB): the spreading matmul then contracts over whole lanes
        lanes = -(-(Op // 128) // 128) * 128
        scales = jnp.pad(scales, ((0, 0), (0, Ip // 128 - scales.shape[-2]), (0, lanes - scales.shape[-1])))
        s_block = (Ip // 128, lanes)  # an expert's scales whole (tiny): read once per group
    else:
        values = jnp.pad(values, lead_pad + ((0, Ip - I), (0, Op - O)))
    group, tile, x_tile, counts = visits(sizes, Mp, t.tm)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    n_out, n_in, n_vis = Op // t.tn, Ip // t.ti, group.shape[0]
    lead_block = (None,) * (1 if layer is None else 2)

    def k_at(v, k, counts):  # tail and spare visits stay on the last real visit's blocks: no DMA
        return jnp.where(v < counts[0], k, n_in - 1)

    def expert(v, group, at):  # the block's leading indices: (expert,) or (layer, expert)
        return (group[v],) if layer is None else (at[0], group[v])

    def x_map(n, v, k, group, tile, x_tile, counts, starts, ends, at):
        return x_tile[v], k_at(v, k, counts)

    def w_map(n, v, k, group, tile, x_tile, counts, starts, ends, at):
        return expert(v, group, at) + (k_at(v, k, counts), n)

    s_lead = lead_block if fmt == "int4" else (None,)  # fp8: the layer's own scales (above)

    def s_map(n, v, k, group, tile, x_tile, counts, starts, ends, at):
        if fmt == "fp8":
            return group[v], 0, 0
        return expert(v, group, at) + (0, n)

    def o_map(n, v, k, group, tile, x_tile, counts, starts, ends, at):
        return tile[v], n

    in_specs = [pl.BlockSpec((t.tm, t.ti), x_map), pl.BlockSpec(lead_block + v_block, w_map)]
    operands = [x, values]
    if quantized:
        in_specs.append(pl.BlockSpec(s_lead + s_block, s_map))
        operands.append(scales)
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=7, grid=(n_out, n_vis, n_in), in_specs=in_specs,
        out_specs=pl.BlockSpec((t.tm, t.tn), o_map), scratch_shapes=acc)
    x_bytes = jnp.dtype(x.dtype).itemsize
    # the weights read: one layer's (a stack's other layers are never touched)
    w_bytes = sum(a.size * a.dtype.itemsize // (a.shape[0] if a.ndim == 4 else 1) for a in operands[1:])
    cost = pl.CostEstimate(
        flops=2 * Mp * Ip * Op, transcendentals=0,
        bytes_accessed=int(w_bytes + n_out * Mp * Ip * x_bytes + Mp * Op * jnp.dtype(out_dtype).itemsize))
    y = pl.pallas_call(
        functools.partial(_kernel, fmt=fmt, t=t, n_in=n_in),
        out_shape=_varying_struct((Mp, Op), out_dtype, x, values, group), grid_spec=spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary"),
                                             vmem_limit_bytes=t.vmem),
        cost_estimate=cost, interpret=interpret,
    )(group, tile, x_tile, counts, starts, ends, at, *operands)
    return y if (Mp, Op) == (M, O) else y[:M, :O]


def grouped_matmul(x_MI, w, sizes_E, out_dtype=None, platform: str | None = None, layer=None):
    """x [M, I] @ w[group] for rows sorted by group (sizes [E]) -> [M, O] in out_dtype (default x's), as
    the MoE's "gmm" path runs it. A QuantizedWeight (fp8 / int4), or any weight given as every layer's stack
    with a `layer` index (w [L, E, I, O]), goes to the Pallas kernel where the program runs on a TPU: compiled
    by Mosaic there, Pallas' interpreter on CPU (tests), the plain form elsewhere (GPUs). platform: the one
    the program is lowered for when the caller knows it (the expert-parallel path, from its mesh's devices:
    "tpu" compiles the kernel, anything else takes the plain form); None: chosen at lowering
    (lax.platform_dependent). A plain weight of one layer is `ragged_dot` everywhere."""
    out_dtype = x_MI.dtype if out_dtype is None else out_dtype
    if not isinstance(w, QuantizedWeight) and layer is None:
        y = jax.lax.ragged_dot(x_MI, w.astype(x_MI.dtype), sizes_E.astype(jnp.int32),
                               preferred_element_type=jnp.float32)
        return y.astype(out_dtype)
    if platform == "tpu":
        return gmm(x_MI, w, sizes_E, layer=layer, out_dtype=out_dtype)
    if platform is not None:
        return gmm_reference(x_MI, w, sizes_E, out_dtype=out_dtype, layer=layer)
    return jax.lax.platform_dependent(
        x_MI, w, sizes_E,
        tpu=lambda x, w, s: gmm(x, w, s, layer=layer, out_dtype=out_dtype),
        cpu=lambda x, w, s: gmm(x, w, s, layer=layer, out_dtype=out_dtype, interpret=True),
        default=lambda x, w, s: gmm_reference(x, w, s, out_dtype=out_dtype, layer=layer))
