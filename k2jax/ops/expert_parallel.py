"""Expert-parallel routed experts under shard_map: tokens travel to the devices holding their experts.

Letters: T tokens (global), t tokens on one device, D model, K top-k, E experts, e experts on one device,
F expert hidden (f on one device, `tensor`-sharded), n devices on the `expert` axis, c pairs per destination
per round, R received rows, M (row, expert) slots, Q = t·K (token, expert) pairs.

Experts the `expert` axis does not divide (6 on expert=4) are replicated, by the params' own fallback
(k2jax.sharding): then nothing is exchanged and every device runs all experts on its own tokens; likewise an
expert hidden dim that `tensor` does not divide is whole on every rank, with no psum over `tensor`.

Tokens are split over (data, fsdp, expert); every `tensor` rank of a group holds the same tokens and computes
its slice f of each expert's hidden dim, so the partial down projections are summed over `tensor` at the end.
Two exchanges, both dropless and exact (they equal k2jax.ops.moe.moe_grouped up to float summation order):

- "all_to_all": each (token, expert) pair goes to the device holding the expert, with its router weight;
  the device returns w · Expert(x) for each pair, summed onto the token at home. XLA needs static shapes
  (and `ragged_all_to_all` does not exist on XLA:CPU), so the exchange runs in rounds of `c` pairs per
  (source, destination): one round when routing is balanced, more (all devices agree via pmax) when one
  device is hot. The worst case, everything to one device, takes ceil(t·min(K, e) / c) rounds.
  (A backend's ragged_all_to_all could send only the rows that exist in one round; not used yet.)
- "gather": all-gather the group's tokens, each device computes its own experts' share for all of them, and a
  reduce-scatter (psum_scatter) sums the shares back onto the tokens' devices. Sends (n-1)·t rows each way,
  one collective each, no sorting.

Choice ("auto"): the all-to-all's round capacity is c = min(t, ceil(1.25·t·K/n)). When c == t (n <= 1.25·K, or
decode-sized t where the ceiling reaches t) a round carries exactly the gather's rows plus the index tables
and sorting, and bench/sharded.py measured it slower: bench config, 8 simulated devices, K=8, prefill 1x512
gather 157 ms vs all-to-all 346 ms (another run: 175 vs 288); so "auto" takes "gather" there (Kimi K2 decode
on expert=64: t=1).
When c < t (n > 1.25·K, as on real slices: 64 expert devices, K=8) the all-to-all's dispatch moves c/t of
the gather's bytes and its combine returns the activation dtype instead of float32 (K=2 variant of the bench,
prefill: 564 + 560 KiB per device vs 903 + 1792 KiB), so "auto" takes "all_to_all". Simulated CPU devices
"send" by memcpy, and their times there are a wash (59 vs 63 ms; another run 154 vs 94): that half of the
choice rests on the bytes, to be re-measured on a real interconnect.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from k2jax.ops.moe import _ragged_swiglu, grouped_moe, layer_from_stacks
from k2jax.ops.quant import QuantizedWeight, compute_dtype, dequantize_shard, is_quantized, scale_partition
from k2jax.sharding import dividing_axes, logical_to_spec, shard_index

EP_MODES = ("auto", "all_to_all", "gather")
TOKEN_AXES = ("data", "fsdp", "expert")


def moe_expert_parallel(x_TD, idx_TK, weight_TK, gate_EDF, up_EDF, down_EFD, *, mesh=None, mode="auto",
                        impl="tiled", tile=64, capacity_factor=1.25, stacks=None, layer=None):
    """Routed experts on `mesh` (default: the current one from jax.set_mesh), weights sharded (expert on
    'expert', F on 'tensor'). x [T, D], idx/weight [T, K] (router output, global expert ids) -> [T, D].

    mode: one of EP_MODES (see the module docstring). impl: "tiled" (XLA:CPU), "ragged" (ragged_dot) or "gmm"
    (ragged, quantized experts through k2jax.ops.gmm's kernel) for the local grouped matmul.
    capacity_factor: (token, expert) pairs per round per destination = cap · t·K/n (at most t).

    The expert stacks may be QuantizedWeight: each device gets its experts' values and the scales of their
    blocks (k2jax.ops.quant.scale_partition); where a shard of F does not hold whole blocks (tiny dims), the
    scales come replicated and the device dequantizes its local shard once per call.

    stacks, layer: optionally every MoE layer's expert stacks (gate, up, down: [L, E, D, F], [L, E, D, F],
    [L, E, F, D], as the params hold them) and this layer's index (a traced int), gate/up/down being that
    layer's own arrays. The "gmm" path then reads the layer's experts straight out of the stacks (XLA:TPU
    copies a slice of a stack into a buffer of its own before a kernel reads it: in bf16 that is each
    layer's local experts written and read again, every step). Derivatives, and the forward under
    differentiation, are as without them, from gate/up/down. Ignored on other paths, and where a quantized
    stack's shards hold parts of its blocks.
    """
    if mode not in EP_MODES:
        raise ValueError(f"expert-parallel mode must be one of {EP_MODES}, got {mode!r}")
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    kw = dict(mesh=mesh, mode=mode, impl=impl, tile=tile, capacity_factor=capacity_factor)
    layer_w = (gate_EDF, up_EDF, down_EFD)
    if stacks is not None and impl == "gmm" and _in_place(tuple(stacks), layer_w, mesh):
        return _from_stacks(kw, x_TD, idx_TK, weight_TK, layer_w, tuple(stacks), layer)
    return _expert_parallel(x_TD, idx_TK, weight_TK, *layer_w, **kw)


def _in_place(stacks, layer_w, mesh) -> bool:
    """Whether the stacks can stand in for the layer's arrays: one more (layer) dim each, and no quantized
    shard holding part of a block (that one is dequantized per shard: see _local_weight)."""
    if any(len(s.shape) != len(w.shape) + 1 for s, w in zip(stacks, layer_w)):
        return False
    e_ax, f_ax = _weight_axes(layer_w[0].shape, mesh)
    specs = _weight_specs(stacks, e_ax, f_ax, mesh, stacked=True)
    return not any(is_quantized(s) and _split_blocks(s, sp) for s, sp in zip(stacks, specs))


def _weight_specs(ws, e_ax, f_ax, mesh, stacked: bool = False) -> tuple:
    """shard_map in_specs of (gate, up, down): experts over e_ax, the hidden dim over f_ax; with `stacked`,
    every layer's stacks, their layer dim whole on every device."""
    lead = (None,) if stacked else ()
    dims = ((e_ax, None, f_ax), (e_ax, None, f_ax), (e_ax, f_ax, None))
    return tuple(_weight_spec(w, P(*lead, *d), mesh) for w, d in zip(ws, dims))


def _from_stacks(kw, x_TD, idx_TK, weight_TK, layer_w, stacks, layer):
    """moe_expert_parallel of layer `layer` read out of the stacks; differentiated (the forward included) as
    moe_expert_parallel of layer_w, that layer's own arrays (k2jax.ops.moe.layer_from_stacks)."""
    def stacked(x_TD, idx_TK, weight_TK, stacks, layer):
        return _expert_parallel(x_TD, idx_TK, weight_TK, *stacks, layer=layer, **kw)

    def plain(x_TD, idx_TK, weight_TK, *w):
        return _expert_parallel(x_TD, idx_TK, weight_TK, *w, **kw)

    return layer_from_stacks(stacked, plain, x_TD, idx_TK, weight_TK, layer_w, stacks, layer)


def _weight_axes(shape, mesh):
    """(expert axis, tensor axis) the expert weights of logical `shape` ([.., E, D, F]) are split over, by the
    params' own rule (k2jax.sharding): experts the expert axis does not divide (6 on expert=4) are
    replicated, and then every device runs all experts for its own tokens (no exchange); an expert hidden
    dim that `tensor` does not divide is whole on every tensor rank (no psum)."""
    e_spec = logical_to_spec(("experts", None, "expert_mlp"), tuple(shape[-3:]), dict(mesh.shape))
    e_ax = "expert" if e_spec[0] == "expert" and "expert" in mesh.shape else None
    f_ax = "tensor" if e_spec[2] == "tensor" and "tensor" in mesh.shape else None
    return e_ax, f_ax


def _expert_parallel(x_TD, idx_TK, weight_TK, gate_EDF, up_EDF, down_EFD, *, mesh, mode, impl, tile,
                     capacity_factor, layer=None):
    """moe_expert_parallel's exchange; with `layer`, gate/up/down are every layer's stacks."""
    T, K = idx_TK.shape
    e_ax, f_ax = _weight_axes(gate_EDF.shape, mesh)
    n = mesh.shape["expert"] if e_ax else 1
    tok_axes = tuple(a for a in TOKEN_AXES if a in mesh.shape)
    groups = math.prod(mesh.shape[a] for a in tok_axes)
    pad = -T % groups  # padding tokens are zeros routed with weight 0, dropped at the end
    t = (T + pad) // groups
    c = max(1, min(t, math.ceil(capacity_factor * t * K / n)))
    if mode == "auto":
        mode = "gather" if c == t else "all_to_all"
    if _platform(mesh) == "tpu" and -(-c // 8) * 8 < t:
        # Whole tiles of 8 rows: a round's [n, c, D] rows then reshape to [n·c, D] in place. Otherwise XLA:TPU
        # lays every round's rows out again, in each dtype they take (c = 20 on Kimi K2's lone prompt).
        c = -(-c // 8) * 8
    x_TD = x_TD.astype(compute_dtype(gate_EDF, x_TD))
    if impl == "gmm":  # the kernel is compiled for the mesh's chips; elsewhere the plain form (see local_experts)
        impl = "gmm:tpu" if _platform(mesh) == "tpu" else "gmm:plain"
    # Padding rows route to K distinct experts (a row's experts are distinct: local_experts relies on it).
    x_TD, weight_TK = (jnp.pad(a, ((0, pad), (0, 0))) for a in (x_TD, weight_TK))
    idx_TK = jnp.concatenate([idx_TK, jnp.broadcast_to(jnp.arange(K, dtype=idx_TK.dtype), (pad, K))])
    t_ax = tok_axes if tok_axes else None

    w_specs = _weight_specs((gate_EDF, up_EDF, down_EFD), e_ax, f_ax, mesh, stacked=layer is not None)

    def local(x_tD, idx_tK, w_tK, layer, gate_eDf, up_eDf, down_efD):
        if layer is not None:  # the stacks, read in place by the kernel: not dequantized, not made to vary
            x_tD, w_tK = _vary_all(x_tD, w_tK)
            return _exchange(x_tD, idx_tK, w_tK, (gate_eDf, up_eDf, down_efD), layer)
        gate_eDf, up_eDf, down_efD = (_local_weight(w, spec, mesh, x_tD.dtype) for w, spec in
                                      zip((gate_eDf, up_eDf, down_efD), w_specs))
        # Under grad, an input replicated over a mesh axis (the experts over data, the tokens over tensor) has
        # its cotangent psum'd over that axis where it first meets a value that varies: made to vary over
        # every axis here, those psums run once, here. Otherwise they run inside the tile loop (its trip count,
        # k2jax.ops.moe.grouped_moe's active tiles, differs between devices): a psum over data there never
        # completes (some devices of its group stop looping earlier). Adding 0.0 changes no value, and XLA
        # folds the add away. (The all-to-all rounds' cond is safe: its predicate is pmax'd over all groups.)
        x_tD, w_tK, gate_eDf, up_eDf, down_efD = _vary_all(x_tD, w_tK, gate_eDf, up_eDf, down_efD)
        return _exchange(x_tD, idx_tK, w_tK, (gate_eDf, up_eDf, down_efD), None)

    def _exchange(x_tD, idx_tK, w_tK, ex, layer):
        if mode == "gather":
            y_tD = _gather_exchange(x_tD, idx_tK, w_tK, ex, e_ax, impl, tile, layer)
        else:
            y_tD = _all_to_all_exchange(x_tD, idx_tK, w_tK, ex, n, c, e_ax, tok_axes, impl, tile, layer)
        if f_ax:
            y_tD = jax.lax.psum(y_tD, f_ax)
        return y_tD.astype(x_tD.dtype)

    fn = jax.shard_map(local, mesh=mesh,
                       in_specs=(P(t_ax, None), P(t_ax, None), P(t_ax, None), P()) + w_specs,
                       out_specs=P(t_ax, None))
    y_TD = fn(x_TD, idx_TK, weight_TK, layer, gate_EDF, up_EDF, down_EFD)[:T]
    # The real tokens, split as far as T divides (k2jax.sharding's fallback). Left to the compiler, the slice's
    # sharding can be one jax 0.7-0.8 cannot name on the mesh (a ValueError when the jit's output is recovered).
    t_out = dividing_axes(tok_axes, T, dict(mesh.shape))
    return jax.lax.with_sharding_constraint(y_TD, NamedSharding(mesh, P(t_out or None, None)))


def _gather_exchange(x_tD, idx_tK, w_tK, ex, e_ax, impl, tile, layer=None):
    e = ex[0].shape[-3]
    if e_ax is None:
        return local_experts(x_tD, idx_tK, w_tK, *ex, impl=impl, tile=tile, layer=layer)
    me = jax.lax.axis_index(e_ax)
    x_gD, idx_gK, w_gK = (jax.lax.all_gather(a, e_ax, tiled=True) for a in (x_tD, idx_tK, w_tK))
    lid_gK = jnp.where(idx_gK // e == me, idx_gK - me * e, e)  # e = not on this device
    y_gD = local_experts(x_gD, lid_gK, w_gK, *ex, impl=impl, tile=tile, layer=layer)
    return jax.lax.psum_scatter(y_gD, e_ax, scatter_dimension=0, tiled=True)


def _all_to_all_exchange(x_tD, idx_tK, w_tK, ex, n, c, e_ax, tok_axes, impl, tile, layer=None):
    """Each (token, expert) pair travels as a row of its own, so a received row has exactly one local expert
    and a round's grouped matmul has n·c slots. (A row per (token, device) would carry up to min(K, e) of
    them: n·c·min(K, e) static slots, of which about 1.1 per row are real at K=8, e=6, so Kimi K2's lone
    8192-token prompt on 64 chips ran 7,680 slots a round for about 1,100.) A token with several experts on
    one device is sent once per expert (about 9% more rows there, in expectation)."""
    t, D = x_tD.shape
    K = idx_tK.shape[-1]
    e = ex[0].shape[-3]
    if e_ax is None:
        return local_experts(x_tD, idx_tK, w_tK, *ex, impl=impl, tile=tile, layer=layer)
    dest_Q = (idx_tK // e).reshape(-1)  # Q = t·K pairs, token-major
    hit_QN = dest_Q[:, None] == jnp.arange(n)[None, :]
    # pair_NS[d, s] = the s-th of my pairs bound for device d (t·K = none), laid out in rounds of c.
    rounds_max = -(-t * min(K, e) // c)  # a token's pairs for one device: at most min(K, e)
    rank_QN = jnp.where(hit_QN, jnp.cumsum(hit_QN, axis=0) - 1, rounds_max * c)
    pair_NS = jnp.full((n, rounds_max * c), t * K, jnp.int32).at[jnp.arange(n)[None, :], rank_QN].set(
        jnp.broadcast_to(jnp.arange(t * K, dtype=jnp.int32)[:, None], (t * K, n)), mode="drop")
    rounds = -(-hit_QN.sum(0).max() // c)
    rounds = jax.lax.pmax(rounds, tok_axes)  # every device runs the same rounds (the collectives must pair)
    x_pD = jnp.concatenate([x_tD, jnp.zeros((1, D), x_tD.dtype)])  # row t: the padding pair's token
    lid_pQ = jnp.concatenate([(idx_tK % e).reshape(-1), jnp.full((1,), e, idx_tK.dtype)])
    w_pQ = jnp.concatenate([w_tK.reshape(-1), jnp.zeros((1,), w_tK.dtype)])

    def one_round(acc_tD, r):
        sel_NC = jax.lax.dynamic_slice_in_dim(pair_NS, r * c, c, axis=1)
        tok_NC = sel_NC // K  # the padding pair t·K -> row t
        w_NC = w_pQ[sel_NC].astype(jnp.float32)  # the pairs' routing weights stay home (see below)
        x_NCD, lid_NC = (jax.lax.all_to_all(a, e_ax, 0, 0, tiled=True) for a in (x_pD[tok_NC], lid_pQ[sel_NC]))
        # Unweighted (weights of 1, which XLA folds away; shaped after the rows, so that they vary over the same
        # mesh axes): each pair's weight is applied at home, inside the sum below, rather than in a pass over
        # every returned row on the experts' side.
        ones_R1 = jnp.ones_like(x_NCD[..., :1], jnp.float32).reshape(n * c, 1)
        y_RD = local_experts(x_NCD.reshape(n * c, D), lid_NC.reshape(n * c, 1), ones_R1, *ex, impl=impl, tile=tile,
                             layer=layer)
        # Back in the activation dtype (half the bytes in bf16); the weighted sum over a token's pairs is float32.
        y_NCD = jax.lax.all_to_all(y_RD.astype(x_tD.dtype).reshape(n, c, D), e_ax, 0, 0, tiled=True)
        if t <= COMBINE_MATMUL_ROWS:  # one matmul with a [t, n·c] matrix of the weights reads the rows once
            w_tR = jnp.where(tok_NC.reshape(1, -1) == jnp.arange(t)[:, None], w_NC.reshape(1, -1), 0.0)
            return acc_tD + jnp.dot(w_tR, y_NCD.reshape(n * c, D).astype(jnp.float32),
                                    precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
        return acc_tD.at[tok_NC].add(y_NCD.astype(jnp.float32) * w_NC[..., None], mode="drop")

    acc_tD = _zeros((t, D), jnp.float32, x_tD, *ex)
    if layer is not None:
        # The stacks' path is never differentiated (layer_from_stacks), so its rounds are a while loop that
        # runs only the rounds needed: a compile's count then takes one round, the balanced case, and names
        # the loop's trip count as known only at run time (k2jax.aot.hlo).
        return jax.lax.while_loop(lambda rs: rs[1] < rounds, lambda rs: (one_round(*rs), rs[1] + 1),
                                  (acc_tD, jnp.int32(0)))[0]

    def step(acc_tD, r):  # differentiable: a scan of every possible round, those not needed skipped
        return jax.lax.cond(r < rounds, one_round, lambda a, _: a, acc_tD, r), None

    return jax.lax.scan(step, acc_tD, jnp.arange(rounds_max))[0]


def local_experts(x_RD, lid_RK, w_RK, gate_eDF, up_eDF, down_eFD, *, impl="tiled", tile=64, layer=None):
    """Σ_k w_k · Expert_{lid_k}(x) over this device's experts, float32 [R, D]; slots with lid == e (the
    number of local experts) belong elsewhere and add nothing. layer: on the "gmm" path, the weights are
    every layer's stacks [L, e, ...] and this layer's experts are read out of them."""
    if layer is not None and not impl.startswith("gmm"):
        raise ValueError(f"local_experts reads a layer out of stacks on the gmm path only, not {impl!r}")
    if not impl.startswith(("ragged", "gmm")):
        # How many rows each device gets is not known statically, so no batched capacity: tiles only.
        return grouped_moe(x_RD, lid_RK, w_RK, gate_eDF, up_eDF, down_eFD, capacity=0, tile=tile,
                           out_dtype=jnp.float32)
    R, K = lid_RK.shape
    e = gate_eDF.shape[-3]
    # "gmm:tpu": quantized experts read in place by the kernel, so no dequantized chunks. "gmm:plain" (a mesh
    # of other chips): the plain form, as grouped_matmul's platform; Pallas' interpreter cannot run inside
    # shard_map (jax 0.12), so CPU meshes take it too, and the kernel's numerics are tested outside.
    kernel = impl.startswith("gmm")
    chunk = e if kernel else dequant_chunk(gate_eDF, K)
    if chunk < e:
        return _ragged_in_chunks(x_RD, lid_RK, w_RK, (gate_eDF, up_eDF, down_eFD), chunk)
    M = R * min(K, e)  # a row's K experts are distinct: at most min(K, e) of them are here
    flat = lid_RK.reshape(-1)
    order_M = jnp.argsort(flat, stable=True)[:M]  # this device's slots first, grouped by expert
    sizes_e = jnp.bincount(flat, length=e + 1)[:e]
    y_MD = _ragged_swiglu(x_RD[order_M // K], sizes_e, gate_eDF, up_eDF, down_eFD, kernel,
                          "tpu" if impl == "gmm:tpu" else "plain", layer=layer)  # rows past Σ sizes: 0
    return _combine(y_MD, order_M, lid_RK, w_RK, e)


# Up to this many rows (decode's), the combine is one small matmul; beyond, each row gathers its slots.
COMBINE_MATMUL_ROWS = 256


def _combine(y_MD, order_M, lid_RK, w_RK, e: int):
    """Σ_k w_k · y[slot of (r, k)] over row r's local slots (lid < e), float32 [R, D], where the slots y [M, D]
    hold the rows' (r, k) in the order order_M (flat indices r * K + k; local ones first).

    The plain form (`_combine_plain`) scatters the M weighted slots onto their rows, and XLA:TPU writes and
    reads a float32 copy of all M slots for it: about 2.4 GiB per decode step of Kimi K2 on v5p `expert=64`
    (M = 384 slots for 64 rows). Here, for up to COMBINE_MATMUL_ROWS rows, the weights are laid out as a
    [R, M] matrix and the sum is one matmul that reads the slots once (float32 products, HIGHEST precision:
    the weights are not rounded to bf16). For more rows (a prompt's, where [R, M] would grow as R²), each row
    gathers its own J = min(K, e) local slots (a row's K experts are distinct) and sums them weighted."""
    R, K = lid_RK.shape
    M = y_MD.shape[0]
    local_M = lid_RK.reshape(-1)[order_M] < e
    if R <= COMBINE_MATMUL_ROWS:
        w_M = jnp.where(local_M, w_RK.reshape(-1)[order_M], 0.0).astype(jnp.float32)
        w_RM = jnp.zeros((R, M), jnp.float32).at[order_M // K, jnp.arange(M)].set(w_M)
        return jnp.dot(w_RM, y_MD.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST,
                       preferred_element_type=jnp.float32)
    if K == 1:  # one slot a row (the all-to-all exchange's rows): a row not local reads its own slot, past
        # the local ones, which holds 0, so no mask; weights of 1 (the exchange's) then fold away entirely
        slot_R = jnp.zeros((R,), jnp.int32).at[order_M].set(jnp.arange(M, dtype=jnp.int32))
        return w_RK.astype(jnp.float32) * y_MD[slot_R].astype(jnp.float32)
    J = min(K, e)
    slot_RK = jnp.zeros((R * K,), jnp.int32).at[order_M].set(jnp.arange(M, dtype=jnp.int32)).reshape(R, K)
    local_RK = lid_RK < e
    k_RJ = jnp.argsort(~local_RK, axis=1, stable=True)[:, :J]  # each row's local k's first
    live_RJ = jnp.take_along_axis(local_RK, k_RJ, axis=1)
    slot_RJ = jnp.where(live_RJ, jnp.take_along_axis(slot_RK, k_RJ, axis=1), 0)
    w_RJ = jnp.where(live_RJ, jnp.take_along_axis(w_RK, k_RJ, axis=1), 0.0).astype(jnp.float32)
    return (w_RJ[..., None] * y_MD[slot_RJ].astype(jnp.float32)).sum(1)


def _combine_plain(y_MD, order_M, lid_RK, w_RK, e: int):
    """_combine's plain form (the reference): each slot's weighted output scattered onto its row."""
    K = lid_RK.shape[1]
    local_M = lid_RK.reshape(-1)[order_M] < e
    w_M = jnp.where(local_M, w_RK.reshape(-1)[order_M], 0.0)
    return jnp.zeros((lid_RK.shape[0], y_MD.shape[1]), jnp.float32).at[order_M // K].add(
        y_MD.astype(jnp.float32) * w_M[:, None])


def dequant_chunk(w_eDF, K: int) -> int:
    """How many of a device's e experts the ragged path dequantizes at once: all of them for plain weights or
    e <= K; otherwise the largest divisor of e that is at most K (a row's top-k). XLA:TPU's ragged_dot takes
    no producer into its operands, so a QuantizedWeight is dequantized into a buffer of its own first: in
    chunks, no buffer exceeds one token's chosen experts (24 local experts of Kimi K2 on expert=16 would
    otherwise make 2 GB of bf16 and 4 GB of float32 copies per layer)."""
    e = w_eDF.shape[0]
    if not is_quantized(w_eDF) or e <= K:
        return e
    return max(d for d in range(1, K + 1) if e % d == 0)


def _ragged_in_chunks(x_RD, lid_RK, w_RK, ws, chunk: int):
    """local_experts' ragged path over the experts in chunks of `chunk` (a scan: one chunk's weights
    dequantized at a time); each chunk's call sees the other chunks' slots as held elsewhere."""
    e = ws[0].shape[0]
    n = e // chunk
    stacked = tuple(jax.tree.map(lambda a: a.reshape(n, chunk, *a.shape[1:]), w) for w in ws)

    def one(acc_RD, xs):
        c, w = xs
        lid = lid_RK - c * chunk
        lid = jnp.where((lid >= 0) & (lid < chunk), lid, chunk)
        return acc_RD + local_experts(x_RD, lid, w_RK, *w, impl="ragged"), None

    acc_RD, _ = jax.lax.scan(one, _zeros(x_RD.shape, jnp.float32, x_RD, lid_RK, w_RK, *ws),
                             (jnp.arange(n), stacked))
    return acc_RD


def _platform(mesh) -> str | None:
    """The platform of the mesh's devices ("tpu", "cpu", "gpu"): a concrete mesh's, an abstract mesh's
    abstract_device (inside jit), or the current concrete mesh's (jax.set_mesh, outside jit); None when no
    devices are known (older jax)."""
    if not isinstance(mesh, jax.sharding.Mesh):
        device = getattr(mesh, "abstract_device", None)  # an abstract mesh names its devices' platform
        if getattr(device, "platform", None):
            return device.platform
        try:
            mesh = jax.sharding.get_mesh()  # outside jit only
        except (AttributeError, ValueError, RuntimeError):
            return None
    if not isinstance(mesh, jax.sharding.Mesh) or not mesh.devices.size:
        return None
    return getattr(mesh.devices.flat[0], "platform", None)


def _weight_spec(w, spec, mesh):
    """shard_map in_spec of an expert stack: spec itself, or for a QuantizedWeight its values' and scales'."""
    if not is_quantized(w):
        return spec
    return QuantizedWeight(spec, P(*scale_partition(w, spec, dict(mesh.shape))), w.fmt, w.in_ndim)


def _local_weight(w, spec, mesh, dtype):
    """This device's expert weights: as given, unless a QuantizedWeight's values are split along a dim whose
    scales came replicated (the shard holds part of a block): then that shard dequantized to `dtype`, using
    the scales at its global offset."""
    if not is_quantized(w) or not _split_blocks(w, spec):
        return w
    lead, ni = w.lead_ndim, w.in_ndim
    vals = tuple(spec.values) + (None,) * (w.ndim - len(tuple(spec.values)))
    shape = w.shape  # the local logical shape
    offsets = []
    for i, group in enumerate((range(lead, lead + ni), range(lead + ni, len(shape)))):
        first = vals[group[0]]
        if first is None or spec.scales[lead + i] is not None:
            offsets.append(0)  # whole, or sharded with whole blocks: the local scales are the shard's own
            continue
        offsets.append(shard_index(first, mesh) * math.prod(shape[d] for d in group))
    return dequantize_shard(w, offsets, dtype)


def _split_blocks(w, spec) -> bool:
    """Whether some matrix dim of w is sharded in its values but replicated in its scales."""
    lead, ni = w.lead_ndim, w.in_ndim
    vals = tuple(spec.values) + (None,) * (w.ndim - len(tuple(spec.values)))
    firsts = (vals[lead], vals[lead + ni])
    return any(f is not None and spec.scales[lead + i] is None for i, f in enumerate(firsts))


def _vary_all(*arrays):
    """The arrays, each plus a zero that varies over the manual mesh axes of all of them. QuantizedWeights
    pass unchanged: they are frozen (no gradient), so no cotangent psum to place."""
    z = _zeros((), jnp.float32, *arrays)  # varies as all of them do, a QuantizedWeight's values included
    return tuple(a if is_quantized(a) else a + z.astype(a.dtype) for a in arrays)


def _zeros(shape, dtype, *like):
    """Zeros that vary over the same manual mesh axes as all of `like` (shard_map's cond branches and scan
    carries must agree on them); built from the values, so no version-specific typing API is needed."""
    z = jnp.zeros(shape, dtype)
    for a in jax.tree.leaves(like):  # a QuantizedWeight: its values and scales
        z = z + jnp.zeros_like(a, dtype, shape=())
    return z
