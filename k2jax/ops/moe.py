"""Routed-expert dispatch: which rows go through which expert's SwiGLU, and the weighted sum back.

Letters: T tokens (batch and positions flattened), D model, E routed experts, K top-k, F expert hidden,
M = T*K (token, expert) assignments, C rows per expert (capacity) or per tile.

- `moe_dense`: every expert on every token, masked by the router weights. Obviously correct, E/K times the
  work; the reference the fast paths are tested against.
- `moe_grouped`: dropless dispatch. Assignments are sorted by expert and each expert's rows run through its
  own weights only. On GPU/TPU the sorted rows go to `jax.lax.ragged_dot`, the grouped-matmul primitive.
  XLA:CPU has no real kernel for it, so `grouped_moe` (the XLA:CPU workaround) runs one batched matmul over
  every expert's first C rows (C sized for a balanced load) and a loop over tiles for what a hot expert has
  beyond C; for decode-sized batches (no more assignments than experts) it loops over the chosen experts
  instead, each read once for all the rows (float8 experts gather theirs: see grouped_dispatch). Given
  every layer's stacks [L, E, ...] and a layer index (`layer=`, as the model's scan over the layers holds
  its params), it reads that layer's experts straight out of the stacks, a block of experts at a time
  (XLA:CPU copies any slice feeding a matmul: a scan's slice of a layer's stack would be copied whole; see
  grouped_moe).
- Expert parallelism (experts sharded over devices, tokens exchanged under shard_map): k2jax.ops.expert_parallel.

Every path takes the expert stacks as plain arrays or as k2jax.ops.quant.QuantizedWeight (FP8 / INT4), which
run in the activations' dtype and are dequantized inside the step, at most one layer's chosen experts at a
time: the decode loop and a tile dequantize their one expert; the float8 decode gathers the chosen
experts' values and scales and dequantizes only those; a block of the batched matmul dequantizes its block
of experts; the ragged and dense paths dequantize the layer's stack they read.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from k2jax.ops.gmm import grouped_matmul
from k2jax.ops.quant import compute_dtype, is_quantized, materialize


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OutputMajor:
    """A gate or up projection held output-major: w_FD [..., F, D], the transpose of the params' [..., D, F]
    (a runtime's XLA:CPU copy of them, k2jax.nn.model.expert_views). XLA:CPU's dot of a few rows per expert
    reads [F, D] weights faster than [D, F]: bench config, bf16, 64 experts x 8 rows x 1024 -> 256 with the
    weights out of cache, 2.0 vs 3.1 ms; in one run, a 16-row decode step 115 -> 101 ms, 15 rows beside a
    256-token chunk 303 -> 282 ms. Indexing it (tree.map) indexes w_FD."""

    w_FD: jax.Array


def _up_project(eq: str, x, w):
    """einsum(eq, x, w) for eq "...D,...DF->...F" (w [..., D, F]), or its output-major form for OutputMajor
    w, in float32 and back to x's dtype."""
    if isinstance(w, OutputMajor):
        rhs = eq.split("->")[0].split(",")[1]
        eq, w = eq.replace(rhs, rhs[:-2] + rhs[-1] + rhs[-2], 1), w.w_FD
    return jnp.einsum(eq, x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def _swiglu(x, gate, up, down):
    """x [..., C, D] with weights [..., D, F] (or OutputMajor), [..., F, D] (the same leading batch axes, e.g.
    experts)."""
    f32 = jnp.float32
    gate, up, down = (materialize(w, x.dtype) for w in (gate, up, down))
    g = _up_project("...CD,...DF->...CF", x, gate)
    u = _up_project("...CD,...DF->...CF", x, up)
    return jnp.einsum("...CF,...FD->...CD", jax.nn.silu(g) * u, down, preferred_element_type=f32).astype(x.dtype)


def moe_dense(x_TD, idx_TK, weight_TK, gate_EDF, up_EDF, down_EFD):
    """Reference: every expert on every token; unchosen experts get weight 0. Returns [T, D]."""
    E = gate_EDF.shape[0]
    x_TD = x_TD.astype(compute_dtype(gate_EDF, x_TD))
    combine_TE = jnp.zeros((x_TD.shape[0], E), jnp.float32).at[
        jnp.arange(x_TD.shape[0])[:, None], idx_TK].add(weight_TK)
    y_ETD = jax.vmap(lambda g, u, d: _swiglu(x_TD, g, u, d))(gate_EDF, up_EDF, down_EFD)
    return jnp.einsum("ETD,TE->TD", y_ETD.astype(jnp.float32), combine_TE).astype(x_TD.dtype)


def moe_grouped(x_TD, idx_TK, weight_TK, gate_EDF, up_EDF, down_EFD, *, impl="tiled", tile=None, capacity=None,
                stacks=None, layer=None):
    """Dropless grouped dispatch (see the module docstring). Returns [T, D]; equals moe_dense.

    tile, capacity: the CPU path's static sizes (see grouped_moe); None picks them from the shapes.
    stacks, layer: optionally every layer's expert stacks (gate, up, down: [L, E, D, F], [L, E, D, F],
    [L, E, F, D]) and a traced layer index, with gate/up/down their layer `layer` (a scan's slice of them).
    The CPU path ("tiled") then computes the values out of the stacks, never reading the slice (see
    grouped_moe: XLA:CPU copies it whole), and the derivatives as without the stacks, for x, the weights and
    gate/up/down: none go to the stacks, whose per-layer gradients a scan adds up best through its slices.
    Each of gate, up, down in stacks may also be a sequence of the L layers' own arrays (zero-copy views of
    a stack, which a runtime can make outside its jitted steps: k2jax.nn.model.expert_views): a switch on the
    layer then reads its arrays in place, with no copy at all.
    """
    T, K = idx_TK.shape
    x_TD = x_TD.astype(compute_dtype(gate_EDF, x_TD))
    if impl not in ("ragged", "gmm"):
        if stacks is not None:
            return _from_stacks(tile, capacity, x_TD, idx_TK, weight_TK, (gate_EDF, up_EDF, down_EFD),
                                tuple(stacks), layer)
        return grouped_moe(x_TD, idx_TK, weight_TK, gate_EDF, up_EDF, down_EFD, tile=tile, capacity=capacity)
    flat_M = idx_TK.reshape(-1)
    order_M = jnp.argsort(flat_M, stable=True)
    sizes_E = jnp.bincount(flat_M, length=gate_EDF.shape[0])
    y_sorted_MD = _ragged_swiglu(x_TD[order_M // K], sizes_E, gate_EDF, up_EDF, down_EFD, kernel=impl == "gmm")
    y_MD = jnp.zeros_like(y_sorted_MD).at[order_M].set(y_sorted_MD)
    return _combine(y_MD.reshape(T, K, -1), weight_TK).astype(x_TD.dtype)


def _from_stacks(tile, capacity, x_TD, idx_TK, weight_TK, layer_w, stacks, layer):
    """grouped_moe of layer `layer` read out of the stacks; differentiated (the forward included) as
    grouped_moe of layer_w, that layer's own arrays. See moe_grouped."""
    E = layer_w[0].shape[0]

    def stacked(x_TD, idx_TK, weight_TK, stacks, layer):
        run = grouped_dispatch(idx_TK, weight_TK, E, capacity=capacity, tile=tile, float8=_float8(layer_w))
        if isinstance(stacks[0], (tuple, list)):  # each layer's own arrays: a switch reads them in place
            branches = [lambda x_TD, ws=ws: run(x_TD, ws) for ws in zip(*stacks)]
            return jax.lax.switch(layer, branches, x_TD)
        return run(x_TD, stacks, layer=layer)

    def plain(x_TD, idx_TK, weight_TK, *w):
        return grouped_moe(x_TD, idx_TK, weight_TK, *w, tile=tile, capacity=capacity)

    return layer_from_stacks(stacked, plain, x_TD, idx_TK, weight_TK, layer_w, stacks, layer)


def layer_from_stacks(stacked, plain, x_TD, idx_TK, weight_TK, layer_w, stacks, layer):
    """One layer's routed experts computed out of every layer's stacks, stacked(x, idx, weight, stacks,
    layer), and differentiated, the forward included, as plain(x, idx, weight, *layer_w) of that layer's
    own arrays (gate, up, down): no derivative goes to the stacks (a scan adds its per-layer gradients up
    best through its slices), nor to quantized experts (frozen). The CPU grouped path and the TPU
    expert-parallel one both read the stacks this way."""

    @jax.custom_vjp
    def run(x_TD, idx_TK, weight_TK, layer_w, stacks, layer):
        return stacked(x_TD, idx_TK, weight_TK, stacks, layer)

    def fwd(x_TD, idx_TK, weight_TK, layer_w, stacks, layer):
        frozen = is_quantized(layer_w[0])

        def fn(x_TD, weight_TK, *w):
            return plain(x_TD, idx_TK, weight_TK, *(layer_w if frozen else w))

        return jax.vjp(fn, x_TD, weight_TK, *(() if frozen else layer_w))

    def bwd(vjp, dy_TD):
        dx_TD, dweight_TK, *dw = vjp(dy_TD)
        return dx_TD, None, dweight_TK, tuple(dw) if dw else None, None, None

    run.defvjp(fwd, bwd)
    return run(x_TD, idx_TK, weight_TK, layer_w, stacks, layer)


def _combine(y_TKD, weight_TK):
    """Σ_k w_k y_k in float32 -> [T, D]."""
    return (y_TKD.astype(jnp.float32) * weight_TK[..., None]).sum(1)


def _ragged_swiglu(x_MD, sizes_E, gate_EDF, up_EDF, down_EFD, kernel=False, platform=None, layer=None):
    """SwiGLU of rows sorted by expert (sizes [E]) -> [M, D]; rows past Σ sizes give 0. kernel: quantized
    experts through k2jax.ops.gmm's grouped matmul (read in place, dequantized in VMEM on a TPU; platform
    as grouped_matmul takes it) rather than dequantized whole for ragged_dot. layer: with kernel, the weights
    are every layer's stacks [L, E, ...] and the kernel reads this layer's tiles out of them."""
    if kernel:
        g = grouped_matmul(x_MD, gate_EDF, sizes_E, platform=platform, layer=layer)
        u = grouped_matmul(x_MD, up_EDF, sizes_E, platform=platform, layer=layer)
        return grouped_matmul(jax.nn.silu(g) * u, down_EFD, sizes_E, platform=platform, layer=layer)
    if layer is not None:
        raise ValueError("_ragged_swiglu reads a layer out of stacks through the kernel path only")
    f32 = jnp.float32
    gate_EDF, up_EDF, down_EFD = (materialize(w, x_MD.dtype) for w in (gate_EDF, up_EDF, down_EFD))
    g = jax.lax.ragged_dot(x_MD, gate_EDF, sizes_E, preferred_element_type=f32).astype(x_MD.dtype)
    u = jax.lax.ragged_dot(x_MD, up_EDF, sizes_E, preferred_element_type=f32).astype(x_MD.dtype)
    h = jax.nn.silu(g) * u
    return jax.lax.ragged_dot(h, down_EFD, sizes_E, preferred_element_type=f32).astype(x_MD.dtype)


def default_sizes(M: int, E: int) -> tuple[int, int]:
    """(capacity, tile) for M assignments over E experts, both static.

    Capacity: enough that a balanced load (a trained router's) rarely overflows, mean + 2 standard
    deviations of a binomial load rounded up to 8 rows, so the batched matmul does nearly all the work.
    Tile: the next power of two above the capacity, at most 32 rows. An untrained router's load is skewed
    (bench config, random weights: the busiest expert gets 1.5-2.2x the mean, or 3.5-4.7x with the parity
    tests' random correction bias) and its hot experts overflow by tens to hundreds of rows; each overflowing
    expert's weights are taken once for all its tiles (see _tile_loop), so small tiles waste little on
    padding. Measured forwards (bf16, 1 x 512), tiles of 16 / 32 / 64 / 128 rows: 593 / 585 / 608 / 632 ms
    on the milder skew, 760 / 704 / 663 / 688 ms on the stronger one.

    Up to one assignment per two experts (2 M <= E; float8 experts' decode, which runs no decode loop): no
    capacity, tiles of 4 rows only, which read only the experts chosen, where the batched matmul reads all.
    """
    if 2 * M <= E:  # (float8 experts' decode: see grouped_dispatch)
        return 0, 4
    mean = M / E
    capacity = 8 * -(-int(mean + 2 * mean**0.5) // 8)
    return capacity, min(32, 1 << (capacity - 1).bit_length())


# Bytes of expert weights (the three projections, in the dtype the matmuls read) that one step of the blocked
# batched matmul copies out of a layer stack; see grouped_moe. Small blocks make small matmuls and many loop
# steps; large ones fall out of the cache before their matmuls read them. Measured forwards (bench config,
# bf16, 1 x 512; 1.5 MiB per expert; a 2-core AMD EPYC, 1 MiB L2 per core, 32 MiB L3), medians of 7 to 11 in one
# run, by experts per block: 1 / 2 / 4 / 8 / 16 / 32 / 64 took 256 / 258 / 234 / 248 / 263 / 282 / 281 ms; the
# per-layer views, with no copy at all, 237 ms. A rerun: 2 / 4 / 8 took 258 / 246 / 257 ms, the views 244 ms.
BLOCK_BYTES = 8 << 20


def experts_per_block(E: int, ws, dtype, block_bytes: int | None = None) -> int:
    """The largest divisor of E whose experts' weights (ws: gate, up, down [..., E, D, F], read in `dtype`
    when quantized) take at most block_bytes (default BLOCK_BYTES); at least 1."""
    block_bytes = BLOCK_BYTES if block_bytes is None else block_bytes
    per_expert = sum(math.prod(w.shape[-2:]) * jnp.dtype(dtype if is_quantized(w) else w.dtype).itemsize
                     for w in ws)
    n = max(1, min(E, block_bytes // per_expert))
    while E % n:
        n -= 1
    return n


def grouped_moe(x_TD, idx_TK, weight_TK, gate_EDF, up_EDF, down_EFD, *, capacity=None, tile=None,
                out_dtype=None, layer=None, block=None):
    """Σ_k w_k · SwiGLU_{idx_k}(x) for XLA:CPU, which has no grouped matmul kernel. x [T, D], idx/weight
    [T, K] -> [T, D] in out_dtype (default x's). idx == E (an expert held elsewhere; expert parallelism)
    adds nothing.

    - Each expert's first `capacity` rows go to an [E, C, D] buffer and one batched matmul per projection
      runs all experts at once. The outputs are gathered back per token, weighted and summed in one pass.
    - Rows past an expert's capacity (a hot expert; dropless) are padded per expert to whole tiles of `tile`
      rows, and a loop visits only the tiles that hold rows, each a small SwiGLU with its tile's expert,
      added into its tokens' outputs. Its trip count is the number of such tiles, usually 0.
    - With no more assignments than experts (decode, and speculative decoding's verifying steps) and capacity
      left to None, a loop over the experts chosen runs all the rows through each (see _looped_moe): the
      batched matmul would read every expert for a few rows, where the loop reads each chosen one once.

    layer: None, or a traced int with the weights every layer's stacks [L, E, ...] (the params as a scan over
    the layers holds them). XLA:CPU copies any slice of a larger array that feeds a matmul into a buffer of
    its own: the scan's slice of a layer's experts would copy the layer's whole stack, every forward (the
    bench config's 7 MoE layers: about 40% more time in the routed experts than with one array per layer).
    Given the stacks and the layer, every path reads only what it needs, straight out of them: the decode
    loop and a tile slice their one expert, and the batched matmul runs in a loop over
    blocks of experts (`block` experts per step, default: as many as fit BLOCK_BYTES), each block sliced out
    of the stack right before its matmul, so that the copy stays in cache and the matmul reads it there.
    Quantized experts run in blocks too (also one layer's own), each block dequantized right before its
    matmuls: at most a block of experts is ever dequantized at once.
    """
    E = gate_EDF.shape[0 if layer is None else 1]
    run = grouped_dispatch(idx_TK, weight_TK, E, capacity=capacity, tile=tile,
                           float8=_float8((gate_EDF, up_EDF, down_EFD)))
    return run(x_TD, (gate_EDF, up_EDF, down_EFD), layer=layer, block=block, out_dtype=out_dtype)


def _float8(ws) -> bool:
    """Whether the experts hold float8 values (FP8 QuantizedWeight): XLA:CPU slices them as bytes (_as_bytes)."""
    return any(_is_float8(a.dtype) for a in jax.tree.leaves(ws))


def _is_float8(dtype) -> bool:
    return jnp.dtype(dtype).itemsize == 1 and jnp.issubdtype(dtype, jnp.floating)


def grouped_dispatch(idx_TK, weight_TK, E: int, *, capacity=None, tile=None, float8: bool = False):
    """grouped_moe in two steps: the routing's index work here, once; the returned
    `run(x_TD, (gate, up, down), layer=None, block=None, out_dtype=None) -> [T, D]` does the expert work, so
    that several sets of experts can share one dispatch (one per branch of a switch over layers).

    float8 (the experts hold float8 values): no decode loop. Its slice of an expert is taken as bytes, and
    XLA:CPU hoists that view of the whole stack out of the loop into a copy (a decode step's temp memory
    was 0.56 of a bf16 layer of experts; gathered, under a quarter). Decode-sized batches then gather the
    chosen experts' weights (4 M <= E) or run tiles only (2 M <= E, see default_sizes)."""
    T, K = idx_TK.shape
    M = T * K
    if capacity is None and M <= E and not float8:
        chosen_U, n_chosen = chosen_experts(idx_TK, E)

        def run_looped(x_TD, ws, layer=None, block=None, out_dtype=None):
            y_TD = _looped_moe(x_TD, idx_TK, weight_TK, chosen_U, n_chosen, tuple(ws), layer)
            return y_TD.astype(x_TD.dtype if out_dtype is None else out_dtype)

        return run_looped
    if capacity is None and 4 * M <= E:
        def run_gathered(x_TD, ws, layer=None, block=None, out_dtype=None):
            y_TD = _gathered_moe(x_TD, idx_TK, weight_TK, tuple(ws), layer)
            return y_TD.astype(x_TD.dtype if out_dtype is None else out_dtype)

        return run_gathered
    auto_c, auto_t = default_sizes(M, E)
    C = auto_c if capacity is None else capacity
    tile = auto_t if tile is None else tile

    flat_M = idx_TK.reshape(-1)
    order_M = jnp.argsort(flat_M, stable=True)  # sorted position -> assignment
    e_sorted_M = jnp.minimum(flat_M[order_M], E - 1)
    here_M = flat_M[order_M] < E  # sorted last: the assignments held elsewhere
    sizes_E = jnp.bincount(flat_M, length=E + 1)[:E]
    rank_sorted_M = jnp.arange(M) - (jnp.cumsum(sizes_E) - sizes_E)[e_sorted_M]
    tok_sorted_M = (order_M // K).astype(jnp.int32)

    # Capacity part: slot e*C + rank; rows past capacity get slot E*C and take no part.
    in_cap_M = here_M & (rank_sorted_M < C)
    if C:
        slot_sorted_M = jnp.where(in_cap_M, e_sorted_M * C + rank_sorted_M, E * C)
        src_EC = jnp.full(E * C + 1, T, jnp.int32).at[slot_sorted_M].set(tok_sorted_M)[:E * C].reshape(E, C)
        slot_TK = jnp.zeros(M, jnp.int32).at[order_M].set(slot_sorted_M.astype(jnp.int32)).reshape(T, K)

    # Overflow part: at most M - C rows, over at most min(E, M // (C + 1)) experts (static bound on tiles).
    over_rows = M - C if C else M
    over_experts = min(E, M // (C + 1))
    overflow = over_rows > 0 and over_experts > 0
    if overflow:
        n_tiles = -(-(over_rows + over_experts * (tile - 1)) // tile)
        padded_E = -(-jnp.maximum(sizes_E - C, 0) // tile) * tile
        pad_end_E = jnp.cumsum(padded_E)
        pos_sorted_M = jnp.where(here_M & ~in_cap_M, (pad_end_E - padded_E)[e_sorted_M] + rank_sorted_M - C,
                                 n_tiles * tile)
        src_nC = jnp.full(n_tiles * tile, T, jnp.int32).at[pos_sorted_M].set(
            tok_sorted_M, mode="drop").reshape(n_tiles, tile)
        w_nC = jnp.zeros(n_tiles * tile, jnp.float32).at[pos_sorted_M].set(
            weight_TK.reshape(-1)[order_M], mode="drop").reshape(n_tiles, tile)
        # searchsorted(pad_end_E, starts, side="right") as a count: under shard_map, jax 0.7's searchsorted
        # refuses a query that does not vary over the manual axes while pad_end_E does.
        starts_n = jnp.arange(n_tiles) * tile
        tile_expert = jnp.minimum(jnp.sum(pad_end_E[None, :] <= starts_n[:, None], axis=1), E - 1)
        tiles_E = padded_E // tile
        # The experts with tiles, in order (their tiles are consecutive), for the forward's loop over them.
        run_expert = jnp.argsort((tiles_E == 0).astype(jnp.int32), stable=True).astype(jnp.int32)
        plan = dict(expert_n=tile_expert, n_active=pad_end_E[-1] // tile, run_expert=run_expert,
                    n_runs=jnp.sum(tiles_E > 0), first_E=(pad_end_E - padded_E) // tile, tiles_E=tiles_E)

    def run(x_TD, ws, layer=None, block=None, out_dtype=None):
        D = x_TD.shape[1]
        x_ext = jnp.concatenate([x_TD, jnp.zeros((1, D), x_TD.dtype)])  # row T: zeros, for empty slots
        y_TD = jnp.zeros_like(x_TD, jnp.float32)  # like x: under shard_map it varies as the loop's adds do
        if C:
            # One layer's own plain arrays: one batched matmul reads them in place. A stack: blocks (see
            # above); quantized ones too, each block dequantized in turn (never the whole layer at once).
            whole = layer is None and not is_quantized(ws[0])
            n = E if whole else (block or experts_per_block(E, ws, x_TD.dtype))
            y_SD = _blocked_swiglu(x_ext, src_EC, ws, layer, n).reshape(E * C, D)
            # A gather, a select and a weighted sum: one pass, nothing [T, K, D] materialised.
            got_TKD = jnp.where((slot_TK < E * C)[..., None], y_SD[jnp.minimum(slot_TK, E * C - 1)], 0)
            y_TD = _combine(got_TKD, weight_TK)
        if overflow:
            y_ext = jnp.concatenate([y_TD, jnp.zeros((1, D), jnp.float32)])  # row T: where padding rows add
            y_TD = _tile_loop(x_ext, y_ext, src_nC, w_nC, plan, layer, *ws)[:T]
        return y_TD.astype(x_TD.dtype if out_dtype is None else out_dtype)

    return run


# Expert weights come as one layer's arrays [E, ...] (layer None) or as every layer's stacks [L, E, ...] with
# a traced layer index; plain or QuantizedWeight (values and scales indexed alike). One layer's arrays reach
# the matmuls as they are (no reshape or slice of them when whole), so that differentiating through them
# keeps the arrays themselves as residuals: a scan then passes its own per-layer slices on, copying nothing.

def _expert_slice(w, layer, start, n: int):
    """Experts start..start+n of (layer `layer` of) w -> [n, ...]: one dynamic slice, which XLA fuses into
    the copy that feeds the matmul."""
    def take(a):
        if layer is None:
            return jax.lax.dynamic_slice_in_dim(a, start, n)
        return jax.lax.dynamic_slice(a, (layer, start) + (0,) * (a.ndim - 2), (1, n) + a.shape[2:])[0]

    return jax.tree.map(_as_bytes(take), w)


def _expert(w, layer, e):
    """Expert(s) e (an int or an index array) of (layer `layer` of) w."""
    return jax.tree.map(_as_bytes(lambda a: a[_at(layer, e)]), w)


def _as_bytes(take):
    """take(a), a float8 array taken as its bytes. XLA:CPU runs a slice or gather of float8 on a float16
    copy of its whole operand: of a whole layer stack of FP8 expert values, hoisted out of the loop over
    layers (every layer's experts in float16 at once, twice the FP8 bytes). As bytes it holds one uint8 copy
    of the stack instead. Measured on the bench config's two MoE layers:
    temp memory of a forward 1 x 512 from 2.5 to 1.5 bf16 layers of experts."""
    def fn(a):
        if not _is_float8(a.dtype):
            return take(a)
        return jax.lax.bitcast_convert_type(take(jax.lax.bitcast_convert_type(a, jnp.uint8)), a.dtype)

    return fn


def _at(layer, e):
    return e if layer is None else (layer, e)


def _blocked_swiglu(x_ext, src_EC, ws, layer, n: int):
    """SwiGLU of each expert's rows: x_ext rows src_EC [E, C] through layer `layer`'s expert e -> [E, C, D].
    n == E: one batched matmul per projection; else a loop over blocks of n experts, each block's weights
    sliced out of the stacks right before its matmuls (see grouped_moe)."""
    E, C = src_EC.shape
    if n == E:
        return _swiglu(x_ext[src_EC], *(w if layer is None else _expert_slice(w, layer, 0, E) for w in ws))

    def block(b, y_ECD):
        start = b * n
        w = [_expert_slice(s, layer, start, n) for s in ws]
        y_nCD = _swiglu(x_ext[jax.lax.dynamic_slice_in_dim(src_EC, start, n)], *w)
        return jax.lax.dynamic_update_slice_in_dim(y_ECD, y_nCD, start, 0)

    return jax.lax.fori_loop(0, E // n, block, jnp.zeros((E, C, x_ext.shape[1]), x_ext.dtype))


def chosen_experts(idx_TK, E: int):
    """The experts that idx [T, K] chooses, each once, ascending -> (ids [T*K], padded with E; their count).
    Ids >= E (held elsewhere) are not chosen."""
    flat_M = jnp.sort(idx_TK.reshape(-1))
    first_M = jnp.concatenate([jnp.ones(1, bool), flat_M[1:] != flat_M[:-1]]) & (flat_M < E)
    return jnp.sort(jnp.where(first_M, flat_M, E)), jnp.sum(first_M)


ROWS_MIN = 4  # rows per matmul at least: with fewer, XLA:CPU converts bf16 weights to float32 first


@jax.custom_vjp
def _looped_moe(x_TD, idx_TK, weight_TK, chosen_U, n_chosen, ws, layer):
    """Decode-sized grouped_moe: a loop over the n_chosen experts chosen_U[:n_chosen] (chosen_experts), each
    taken once out of (layer `layer` of) the weights and run over every row, its output scaled per row by
    that expert's router weight (0 where the row did not choose it). It reads what the step needs, each
    chosen expert once, whatever the rows share: speculative decoding's verifying step feeds a row's drafts
    after its last token, whose experts mostly repeat (demo model, "Once upon a time": 8 experts per layer
    for one token, 12.2 for five in a row). Measured on the demo config (bf16, XLA:CPU, one row): a
    verifying step of five tokens about 40 -> 17-20 ms against the batched matmul over every expert, a
    one-token decode step 10.6 ms either way against gathering each assignment's expert; the 8 demo prompts
    decoded together 8.9 -> 6.3 s (bench/speculative.py). Differentiated as _gathered_moe (the same sum,
    each assignment's expert gathered), whose loop-free form reverse-mode takes."""
    T, D = x_TD.shape
    R = max(T, ROWS_MIN)
    x_RD = jnp.pad(x_TD, [(0, R - T), (0, 0)])
    f32 = jnp.float32

    def per_expert(u, y_TD):
        e = chosen_U[u]
        w_T = jnp.sum(jnp.where(idx_TK == e, weight_TK, 0.0), axis=1)
        gate, up, down = (_expert(w, layer, e) for w in ws)
        return y_TD + _swiglu(x_RD, gate, up, down)[:T].astype(f32) * w_T[:, None]

    return jax.lax.fori_loop(0, n_chosen, per_expert, jnp.zeros((T, D), f32)).astype(x_TD.dtype)


def _looped_moe_fwd(x_TD, idx_TK, weight_TK, chosen_U, n_chosen, ws, layer):
    return (_looped_moe(x_TD, idx_TK, weight_TK, chosen_U, n_chosen, ws, layer),
            (x_TD, idx_TK, weight_TK, ws, layer))


def _looped_moe_bwd(res, dy_TD):
    x_TD, idx_TK, weight_TK, ws, layer = res
    frozen = is_quantized(ws[0])

    def plain(x_TD, weight_TK, *w):
        return _gathered_moe(x_TD, idx_TK, weight_TK, ws if frozen else w, layer)

    _, vjp = jax.vjp(plain, x_TD, weight_TK, *(() if frozen else ws))
    dx_TD, dweight_TK, *dws = vjp(dy_TD)
    return dx_TD, None, dweight_TK, None, None, None if frozen else tuple(dws), None


_looped_moe.defvjp(_looped_moe_fwd, _looped_moe_bwd)


def _gathered_moe(x_TD, idx_TK, weight_TK, ws, layer):
    """Decode-sized grouped_moe as a gather (float8 experts' decode, and the form _looped_moe is
    differentiated as): each token's K experts' weights gathered from layer `layer` of the stacks, the
    router weights scaling the hidden units so that the down projection also sums the experts. Rows are
    padded to ROWS_MIN (R). idx == E (held elsewhere) adds nothing."""
    T, D = x_TD.shape
    K = idx_TK.shape[1]
    f32, dt = jnp.float32, x_TD.dtype
    E = jax.tree.leaves(ws[0])[0].shape[0 if layer is None else 1]
    idx_TK, weight_TK = jnp.minimum(idx_TK, E - 1), jnp.where(idx_TK < E, weight_TK, 0.0)
    x_TKRD = jnp.broadcast_to(jnp.pad(x_TD[:, None, None], [(0, 0), (0, 0), (0, ROWS_MIN - 1), (0, 0)]),
                              (T, K, ROWS_MIN, D))
    # Quantized stacks: the chosen experts' values and scales are gathered, then only those dequantized.
    gate_TKDF, up_TKDF, down_TKFD = (materialize(_expert(w, layer, idx_TK), dt) for w in ws)
    g_TKRF = _up_project("TKRD,TKDF->TKRF", x_TKRD, gate_TKDF)
    u_TKRF = _up_project("TKRD,TKDF->TKRF", x_TKRD, up_TKDF)
    h_TKRF = ((jax.nn.silu(g_TKRF) * u_TKRF).astype(f32) * weight_TK[:, :, None, None]).astype(dt)
    y_TRD = jnp.einsum("TKRF,TKFD->TRD", h_TKRF, down_TKFD, preferred_element_type=f32)
    return y_TRD[:, 0].astype(dt)


@jax.custom_vjp
def _tile_loop(x_ext, y_ext, src_nC, w_nC, plan, layer, gate_EDF, up_EDF, down_EFD):
    """y_ext[src[j]] += w[j] · SwiGLU_{expert[j]}(x_ext[src[j]]) for the first n_active tiles j (C rows each),
    with the experts of (layer `layer` of) the weights (see _expert_slice); y float32. plan (ints, see
    grouped_dispatch): expert_n, n_active; and the experts with tiles, run_expert[:n_runs], each with its
    tiles first_E[e] .. first_E[e] + tiles_E[e].

    Loops visit only the active tiles and gather/scatter their rows themselves, so nothing sized by the
    static tile bound is materialised: one over the experts with tiles, which takes each expert's weights
    once (copied on XLA:CPU, dequantized if quantized), and within it one over the expert's tiles. Its own
    backward pass (below) adds each tile's weight gradient into its expert's slot: differentiating the loop
    directly would add a zero-padded gradient of all experts' weights on every tile. Quantized weights are
    frozen: no gradient for them (None).
    """
    f32 = jnp.float32

    def per_expert(r, y):
        e = plan["run_expert"][r]
        w = [materialize(_expert(ws, layer, e), x_ext.dtype) for ws in (gate_EDF, up_EDF, down_EFD)]

        def per_tile(j, y):
            src_C = src_nC[j]
            return y.at[src_C].add(_swiglu(x_ext[src_C], *w).astype(f32) * w_nC[j][:, None])

        first = plan["first_E"][e]
        return jax.lax.fori_loop(first, first + plan["tiles_E"][e], per_tile, y)

    return jax.lax.fori_loop(0, plan["n_runs"], per_expert, y_ext)


def _tile_loop_fwd(x_ext, y_ext, src_nC, w_nC, plan, layer, gate_EDF, up_EDF, down_EFD):
    out = _tile_loop(x_ext, y_ext, src_nC, w_nC, plan, layer, gate_EDF, up_EDF, down_EFD)
    return out, (x_ext, src_nC, w_nC, plan, layer, gate_EDF, up_EDF, down_EFD)


def _tile_loop_bwd(res, dy_ext):
    x_ext, src_nC, w_nC, plan, layer, gate_EDF, up_EDF, down_EFD = res
    f32, dt = jnp.float32, x_ext.dtype
    expert_n = plan["expert_n"]

    def mm(eq, a, b):
        return jnp.einsum(eq, a, b, preferred_element_type=f32)

    def body(j, carry):
        dx_ext, dw_nC, dgate, dup, ddown = carry
        e, src_C = expert_n[j], src_nC[j]
        x_CD, dy_CD = x_ext[src_C], dy_ext[src_C]
        gate_DF, up_DF, down_FD = (materialize(_expert(w, layer, e), dt) for w in (gate_EDF, up_EDF, down_EFD))
        # Recompute the forward in the same dtypes as _swiglu.
        g_CF = mm("CD,DF->CF", x_CD, gate_DF).astype(dt).astype(f32)
        u_CF = mm("CD,DF->CF", x_CD, up_DF).astype(dt).astype(f32)
        sig_CF = jax.nn.sigmoid(g_CF)
        h_CF = ((g_CF * sig_CF).astype(dt).astype(f32) * u_CF).astype(dt)
        out_CD = mm("CF,FD->CD", h_CF, down_FD).astype(dt).astype(f32)
        dw_C = (dy_CD * out_CD).sum(-1)
        dout_CD = (dy_CD * w_nC[j][:, None]).astype(dt)
        dh_CF = mm("CD,FD->CF", dout_CD, down_FD)
        dg_CF = (dh_CF * u_CF * sig_CF * (1 + g_CF * (1 - sig_CF))).astype(dt)
        du_CF = (dh_CF * g_CF * sig_CF).astype(dt)
        dx_CD = mm("CF,DF->CD", dg_CF, gate_DF) + mm("CF,DF->CD", du_CF, up_DF)
        dx_ext, dw_nC = dx_ext.at[src_C].add(dx_CD.astype(dt)), dw_nC.at[j].set(dw_C)
        if frozen:
            return dx_ext, dw_nC, dgate, dup, ddown
        at = _at(layer, e)
        return (dx_ext, dw_nC, dgate.at[at].add(mm("CD,CF->DF", x_CD, dg_CF)),
                dup.at[at].add(mm("CD,CF->DF", x_CD, du_CF)), ddown.at[at].add(mm("CF,CD->FD", h_CF, dout_CD)))

    frozen = is_quantized(gate_EDF)
    dws = (() if frozen else
           (jnp.zeros_like(gate_EDF, f32), jnp.zeros_like(up_EDF, f32), jnp.zeros_like(down_EFD, f32)))
    init = (jnp.zeros_like(x_ext), jnp.zeros_like(w_nC)) + (dws or (None, None, None))
    dx_ext, dw_nC, dgate, dup, ddown = jax.lax.fori_loop(0, plan["n_active"], body, init)
    if frozen:
        return dx_ext, dy_ext, None, dw_nC, None, None, None, None, None
    return (dx_ext, dy_ext, None, dw_nC, None, None, dgate.astype(gate_EDF.dtype), dup.astype(up_EDF.dtype),
            ddown.astype(down_EFD.dtype))


_tile_loop.defvjp(_tile_loop_fwd, _tile_loop_bwd)
