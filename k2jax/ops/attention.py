"""MLA attention kernels: the plain expanded form and the two fast forms tested equal to it.

- `attend_expanded` (the reference): keys and values expanded per head from the latent, one [T, S] score
  matrix. Optimization barriers between its stages are an XLA:CPU workaround (see its docstring).
- `attend_blocked` (prefill): the expanded form, but queries and keys visited in blocks with an online
  softmax, so memory grows linearly with the prompt instead of holding the [T, T] score matrix; key blocks
  above the causal diagonal are skipped.
- `attend_absorbed` (decode): W_UK folded into the query and W_UV into the output (K2_REFERENCE.md §3), so a
  step reads the latent cache once and never expands it per head.
- `attend`: picks one of them from the shapes (the model calls it; no mode strings).
- `attend_split_tokens`: a lone row's chunk with its tokens split over the mesh (sequence parallel), each
  device attending its own queries over the gathered latents; `attend_with_prefix` takes it under a mesh.

Letters as in k2jax.nn.mla: B batch, T queries, S keys, N heads, K nope head dim, P rope head dim,
R kv_lora_rank, V value head dim, X = K + V. All return the per-head outputs [B, T, N, V] in the
cache's dtype; scores and softmax are float32. w_kv_b may be a QuantizedWeight: dequantized once per call
(R x N x (K+V), small), in the cache's dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from k2jax.ops.collectives import gather
from k2jax.ops.paged_mla import paged_mla
from k2jax.ops.quant import materialize
from k2jax.sharding import shard_index, split_specs

_NEG_INF = -1e30  # finite, so a row with nothing to attend to averages instead of giving NaN
DEFAULT_BLOCK = 256  # measured on XLA:CPU at 512 tokens: 256 beats 128 and 512 (no causal skip)


ATTENTION_IMPLS = ("auto", "plain")


def attend(q_nope_BTNK, q_pe_BTNP, ckv_BSR, k_pe_BSP, w_kv_b_RNX, kv_valid_BS, scale, impl: str = "auto"):
    """Causal attention of T new tokens over S = C + T keys: C cached ones (a prefix every new token may see,
    where kv_valid) and the T new ones (causally). The form follows from the shapes:

    - impl "plain": attend_expanded under the whole [T, S] mask (the reference);
    - "auto", no cache (C == 0): attend_blocked (tiles above the diagonal skipped);
    - "auto" with a cache: attend_absorbed when it takes fewer flops than expanding the keys, i.e. for
      T < R(K+V) / (2R - K - V) new tokens (decode: one per row; ~170 for Kimi K2, ~85 for the bench
      config, where XLA:CPU measured absorbed no slower than expanded up to 128-256 queries), and T is at most one
      block (absorbed holds its [T, S] scores whole: with small ranks, 2R <= K + V, it is always the
      cheaper in flops, and a long chunk over a long prefix would take memory quadratic in length);
      else attend_blocked.

    q_nope [B, T, N, K], q_pe [B, T, N, P], ckv [B, S, R], k_pe [B, S, P], w_kv_b [R, N, K + V],
    kv_valid [B, S] bool -> [B, T, N, V].
    """
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
    T, S = q_nope_BTNK.shape[1], ckv_BSR.shape[1]
    args = (q_nope_BTNK, q_pe_BTNP, ckv_BSR, k_pe_BSP, w_kv_b_RNX)
    if impl == "plain":
        return attend_expanded(*args, causal_mask(kv_valid_BS, T), scale)
    if S > T and T <= DEFAULT_BLOCK and absorbed_is_cheaper(T, ckv_BSR.shape[-1], q_nope_BTNK.shape[-1],
                                                            w_kv_b_RNX.shape[-1]):
        return attend_absorbed(*args, causal_mask(kv_valid_BS, T), scale)
    return attend_blocked(*args, kv_valid_BS, scale)


def attend_with_prefix(q_nope_BTNK, q_pe_BTNP, ckv_BTR, k_pe_BTP, w_kv_b_RNX, kv_valid_BT, scale, dtype,
                       impl: str = "auto", prefix=None, kv_b_stack=None):
    """`attend` over a cached prefix and the T new tokens: the prefix (ckv [B, S, R], k_pe [B, S, P], valid
    [B, S], in any dtype; k2jax.ops.paged.PagedCache.read) first, then the new tokens' own latents (ckv [B, T,
    R], k_pe [B, T, P], kv_valid [B, T]), all in `dtype`. prefix None: the new tokens alone. -> [B, T, N, V].
    kv_b_stack: (the layers' plain kv_b_proj stack, this layer's index), read in place where the tokens are
    split over the mesh (attend_split_tokens); w_kv_b elsewhere."""
    spec = split_specs(("batch", "length", None, None), q_nope_BTNK.shape)
    if impl == "auto" and spec is not None and spec[1] is not None and ckv_BTR.shape[1] > 1:
        return attend_split_tokens(q_nope_BTNK, q_pe_BTNP, ckv_BTR, k_pe_BTP, w_kv_b_RNX, kv_valid_BT, scale,
                                   dtype, spec, prefix, kv_b_stack)
    ckv_BSR, k_pe_BSP, valid_BS = ckv_BTR, k_pe_BTP, kv_valid_BT.astype(bool)
    if prefix is not None:
        c_ckv_BSR, c_k_pe_BSP, c_valid_BS = prefix
        ckv_BSR = jnp.concatenate([c_ckv_BSR.astype(dtype), ckv_BTR], 1)
        k_pe_BSP = jnp.concatenate([c_k_pe_BSP.astype(dtype), k_pe_BTP], 1)
        valid_BS = jnp.concatenate([c_valid_BS, valid_BS], 1)
    return attend(q_nope_BTNK, q_pe_BTNP, ckv_BSR, k_pe_BSP, w_kv_b_RNX, valid_BS, scale, impl)


def kv_b_halves(w_kv_b, K: int, dtype):
    """(W_UK [R, N, K], W_UV [R, N, V]) in `dtype` from w_kv_b [R, N, K + V], or from such a pair as it is
    (attend_split_tokens reads each half out of the layers' stack by its own product: a copy of the layer's
    slice, which two readers of one slice make, is not written)."""
    if isinstance(w_kv_b, tuple):
        return tuple(materialize(w, dtype) for w in w_kv_b)
    w_kv_b = materialize(w_kv_b, dtype)
    return w_kv_b[..., :K], w_kv_b[..., K:]


def stack_halves(stack_LRNX, layer, K: int, dtype):
    """(W_UK [R, N, K], W_UV [R, N, V]) of layer `layer` of a plain kv_b_proj stack [L, R, N, K + V], each half
    sliced out of the stack by itself, so that its own product reads it there (kv_b_halves)."""
    return stack_LRNX[layer, ..., :K].astype(dtype), stack_LRNX[layer, ..., K:].astype(dtype)


def causal_mask(kv_valid_BS, T: int):
    """[B, T, S] bool: new token t (key index S - T + t) sees key s iff s <= S - T + t and kv_valid[b, s]."""
    S = kv_valid_BS.shape[1]
    causal_TS = jnp.arange(S)[None, :] <= (S - T) + jnp.arange(T)[:, None]
    return kv_valid_BS.astype(bool)[:, None, :] & causal_TS[None]


def absorbed_is_cheaper(T: int, R: int, K: int, X: int) -> bool:
    """Whether absorbed attention takes fewer flops than expanded for T queries: per (query, key) and head it
    costs 2R + P against K + P + V expanded, but expanding costs R(K + V) per key and head (X = K + V)."""
    return T * (2 * R - X) < R * X


def attend_expanded(q_nope_BTNK, q_pe_BTNP, ckv_BSR, k_pe_BSP, w_kv_b_RNX, mask_BTS, scale):
    """Attention with keys and values expanded per head from the latent (W_UK, W_UV applied to ckv).

    Returns the per-head outputs [B, T, N, V]. Scores and softmax in float32.

    Laid out head-major ([B, N, ...]) with the scale folded into the query and optimization barriers
    between the stages: XLA:CPU otherwise fuses the scale, the mask or a transposed output into the
    matmuls and falls off its fast matmul kernels (measured 3-5x slower on the bench config).
    """
    K, P = q_nope_BTNK.shape[-1], q_pe_BTNP.shape[-1]
    f32, dt = jnp.float32, ckv_BSR.dtype
    w_kv_b_RNX = materialize(w_kv_b_RNX, dt)
    barrier = jax.lax.optimization_barrier
    kv_BNSX = barrier(jnp.einsum("BSR,RNX->BNSX", ckv_BSR, w_kv_b_RNX, preferred_element_type=f32).astype(dt))
    k_nope_BNSK, v_BNSV = kv_BNSX[..., :K], kv_BNSX[..., K:]
    q_BTNH = jnp.concatenate([q_nope_BTNK, q_pe_BTNP.astype(q_nope_BTNK.dtype)], -1)
    q_BNTH = (q_BTNH.transpose(0, 2, 1, 3).astype(f32) * scale).astype(dt)
    k_BNSH = jnp.concatenate([k_nope_BNSK, jnp.broadcast_to(k_pe_BSP[:, None].astype(dt),
                                                            k_nope_BNSK.shape[:3] + (P,))], -1)
    scores_BNTS = barrier(jnp.einsum("BNTH,BNSH->BNTS", q_BNTH, k_BNSH, preferred_element_type=f32))
    scores_BNTS = jnp.where(mask_BTS[:, None, :, :], scores_BNTS, _NEG_INF)
    probs_BNTS = barrier(jax.nn.softmax(scores_BNTS, axis=-1).astype(dt))
    out_BNTV = barrier(jnp.einsum("BNTS,BNSV->BNTV", probs_BNTS, v_BNSV, preferred_element_type=f32))
    return out_BNTV.astype(dt).transpose(0, 2, 1, 3)


def attend_absorbed(q_nope_BTNK, q_pe_BTNP, ckv_BSR, k_pe_BSP, w_kv_b_RNX, mask_BTS, scale):
    """Attention straight on the latent cache: q_lat = q_nope·W_UK, scores = q_lat·ckv + q_pe·k_pe,
    o_lat = P·ckv, out = o_lat·W_UVᵀ. Same result as attend_expanded on the same inputs.

    Heads and queries share one row axis, M = N·T (head-major), with the scale folded into the query: every
    head attends to the same latent keys, so each stage is one plain matmul of M rows against the cache. (Kept
    as [T, N] apart, XLA:CPU ran the stages as many small products: measured on the bench config, one layer
    over 4096 cached keys, 64 queries 71 -> 26-34 ms, 128 queries 156 -> 56-63 ms; decode unchanged.)

    q_nope [B, T, N, K], q_pe [B, T, N, P] (rotated), ckv [B, S, R] (normalised), k_pe [B, S, P] (rotated),
    w_kv_b [R, N, K + V], mask [B, T, S] (True = may attend) -> [B, T, N, V].
    """
    B, T, N, K = q_nope_BTNK.shape
    f32, dt = jnp.float32, ckv_BSR.dtype
    w_uk_RNK, w_uv_RNV = kv_b_halves(w_kv_b_RNX, K, dt)
    q_lat_BNTR = jnp.einsum("BTNK,RNK->BNTR", q_nope_BTNK, w_uk_RNK, preferred_element_type=f32)
    q_lat_BMR = (q_lat_BNTR * scale).astype(dt).reshape(B, N * T, -1)
    q_pe_BMP = (q_pe_BTNP.transpose(0, 2, 1, 3).astype(f32) * scale).astype(dt).reshape(B, N * T, -1)
    scores_BMS = (jnp.einsum("BMR,BSR->BMS", q_lat_BMR, ckv_BSR, preferred_element_type=f32)
                  + jnp.einsum("BMP,BSP->BMS", q_pe_BMP, k_pe_BSP.astype(dt), preferred_element_type=f32))
    scores_BNTS = jnp.where(mask_BTS[:, None], scores_BMS.reshape(B, N, T, -1), _NEG_INF)
    probs_BMS = jax.nn.softmax(scores_BNTS, axis=-1).astype(dt).reshape(B, N * T, -1)
    o_lat_BMR = jnp.einsum("BMS,BSR->BMR", probs_BMS, ckv_BSR, preferred_element_type=f32).astype(dt)
    return jnp.einsum("BNTR,RNV->BTNV", o_lat_BMR.reshape(B, N, T, -1), w_uv_RNV,
                      preferred_element_type=f32).astype(dt)


def attend_blocked(q_nope_BTNK, q_pe_BTNP, ckv_BSR, k_pe_BSP, w_kv_b_RNX, kv_valid_BS, scale,
                   block: int = DEFAULT_BLOCK, unroll_blocks: int = 4):
    """Causal attention of T new tokens over S = C + T keys: C cached keys (a prefix every new token may see)
    and the T new tokens themselves (causally), in [block × block] tiles with an online softmax.

    Keys and values are expanded per head once ([B, N, S, X], linear in S); the score tiles are the only
    quadratic work and are never held together. Key tiles above the causal diagonal are skipped (a cond in a
    fixed-length scan, so the kernel is differentiable and serves training too); tiles of the cached prefix
    are always visited (kv_valid masks what a row does not hold). New token t (key index C + t) sees key s
    iff s <= C + t and kv_valid[b, s]. Equals attend_expanded under that mask on every query row that sees at
    least one key (padding rows see none; what they get does not reach the real rows).

    Up to `unroll_blocks` query blocks (short prompts; the bench forward's 512 tokens) the blocks are unrolled
    instead: each query block against the keys up to its diagonal with a plain softmax, no loop and no online
    rescaling (measured 8.0 -> 5.8 ms per layer at 512 tokens, bench config, bf16).

    q_nope [B, T, N, K], q_pe [B, T, N, P], ckv [B, S, R], k_pe [B, S, P], w_kv_b [R, N, K + V],
    kv_valid [B, S] bool -> [B, T, N, V]. C = S - T is static (from the shapes).
    """
    B, T, N, K = q_nope_BTNK.shape
    S = ckv_BSR.shape[1]
    C = S - T  # cached keys before the new ones
    P, V = q_pe_BTNP.shape[-1], w_kv_b_RNX.shape[-1] - K
    f32, dt = jnp.float32, ckv_BSR.dtype
    w_kv_b_RNX = materialize(w_kv_b_RNX, dt)
    block = min(block, T)
    nq = -(-T // block)
    barrier = jax.lax.optimization_barrier  # XLA:CPU workaround (see attend_expanded)

    # Head-major, the scale folded into the query; [nope; rope] on one axis, so one matmul gives a score tile.
    kv_BNSX = barrier(jnp.einsum("BSR,RNX->BNSX", ckv_BSR, w_kv_b_RNX, preferred_element_type=f32).astype(dt))
    q_BNTH = jnp.concatenate([q_nope_BTNK, q_pe_BTNP.astype(q_nope_BTNK.dtype)], -1).transpose(0, 2, 1, 3)
    q_BNTH = (q_BNTH.astype(f32) * scale).astype(dt)
    k_BNSH = jnp.concatenate([kv_BNSX[..., :K], jnp.broadcast_to(k_pe_BSP[:, None].astype(dt), (B, N, S, P))], -1)
    kv_valid_BS = kv_valid_BS.astype(bool)
    if nq <= unroll_blocks:
        return _unrolled_blocks(q_BNTH, k_BNSH, kv_BNSX[..., K:], kv_valid_BS, block, C)

    # Key tiles laid out so that tile boundaries fall on the new tokens' query blocks: the cached prefix is
    # front-padded to whole tiles (padding keys invalid), so tile j >= nc holds new keys of query block j - nc.
    nc = -(-C // block)
    front, back = nc * block - C, nq * block - T

    def tiles(x, n):  # [B, N, n * block, X] -> [n, B, N, block, X]
        return jnp.moveaxis(x.reshape(B, N, n, block, x.shape[-1]), 2, 0)

    def padded(x):  # keys [B, N, S, X] -> [B, N, (nc + nq) * block, X]
        return jnp.pad(x, [(0, 0), (0, 0), (front, back), (0, 0)])

    q_nBNcH = tiles(jnp.pad(q_BNTH, [(0, 0), (0, 0), (0, back), (0, 0)]), nq)
    k_nBNcH, v_nBNcV = barrier((tiles(padded(k_BNSH), nc + nq), tiles(padded(kv_BNSX[..., K:]), nc + nq)))
    valid_nBc = jnp.moveaxis(jnp.pad(kv_valid_BS, [(0, 0), (front, back)]).reshape(B, nc + nq, block), 1, 0)
    offs = jnp.arange(block)

    def query_block(i):
        q_BNcH = q_nBNcH[i]

        def visit(carry, j):
            m_BNc, l_BNc, acc_BNcV = carry
            s_BNcc = jnp.einsum("BNTH,BNSH->BNTS", q_BNcH, k_nBNcH[j], preferred_element_type=f32)
            # Positions in the padded key axis: query t of block i sits at nc*block + i*block + t.
            see_Bcc = valid_nBc[j][:, None, :] & ((nc + i) * block + offs[:, None] >= j * block + offs[None, :])
            s_BNcc = jnp.where(see_Bcc[:, None], s_BNcc, _NEG_INF)
            m_new = jnp.maximum(m_BNc, s_BNcc.max(-1))
            corr = jnp.exp(m_BNc - m_new)
            p_BNcc = jnp.exp(s_BNcc - m_new[..., None])
            pv_BNcV = jnp.einsum("BNTS,BNSV->BNTV", p_BNcc.astype(dt), v_nBNcV[j], preferred_element_type=f32)
            return m_new, l_BNc * corr + p_BNcc.sum(-1), acc_BNcV * corr[..., None] + pv_BNcV

        def key_block(carry, j):
            # Key tiles above the diagonal are fully masked: skipped, not computed.
            return jax.lax.cond(j <= nc + i, visit, lambda c, _: c, carry, j), None

        init = (jnp.full((B, N, block), _NEG_INF, f32), jnp.zeros((B, N, block), f32),
                jnp.zeros((B, N, block, V), f32))
        (_, l_BNc, acc_BNcV), _ = jax.lax.scan(key_block, init, jnp.arange(nc + nq))
        return (acc_BNcV / l_BNc[..., None]).astype(dt)

    out_nBNcV = jax.lax.map(query_block, jnp.arange(nq))
    return jnp.moveaxis(out_nBNcV, 0, 2).reshape(B, N, nq * block, V)[:, :, :T].transpose(0, 2, 1, 3)


def _unrolled_blocks(q_BNTH, k_BNSH, v_BNSV, kv_valid_BS, block, C):
    """attend_blocked's short-prompt form: query block i (new tokens start..end) against the C cached keys
    and the new keys up to its end, plain softmax (scores [B, N, block, <= S] in float32) -> [B, T, N, V]."""
    T = q_BNTH.shape[2]
    f32, dt = jnp.float32, v_BNSV.dtype
    outs = []
    for start in range(0, T, block):
        end = min(T, start + block)
        s_BNcS = jnp.einsum("BNTH,BNSH->BNTS", q_BNTH[:, :, start:end], k_BNSH[:, :, :C + end],
                            preferred_element_type=f32)
        see_BcS = kv_valid_BS[:, None, :C + end] & (C + jnp.arange(start, end)[:, None] >= jnp.arange(C + end)[None, :])
        s_BNcS = jnp.where(see_BcS[:, None], s_BNcS, _NEG_INF)
        p_BNcS = jax.nn.softmax(s_BNcS, axis=-1).astype(dt)
        outs.append(jnp.einsum("BNTS,BNSV->BNTV", p_BNcS, v_BNSV[:, :, :C + end], preferred_element_type=f32))
    return jnp.concatenate(outs, 2).astype(dt).transpose(0, 2, 1, 3)


def attend_split_tokens(q_nope_BTNK, q_pe_BTNP, ckv_BTR, k_pe_BTP, w_kv_b_RNX, kv_valid_BT, scale, dtype,
                        spec, prefix=None, kv_b_stack=None):
    """attend_with_prefix for T new tokens split over mesh axes (sequence parallel: a lone row's prompt
    chunk, whose rows cannot fill the batch axes; k2jax.sharding's "length" rule). spec: the PartitionSpec of
    q_nope [B, T, N, K] (batch, length, then heads whole).

    Under shard_map each device holds its t = T / n new tokens. It gathers every new token's latent (ckv and
    k_pe: R + P values per token, not the N heads' expanded keys and values) and attends its own t queries
    over the prefix (whole on every device) and the new keys: its own block of keys is rolled to the end,
    so that `attend` sees the keys before it as a prefix and its own causally, and the keys after it are
    masked out. Projections and norms stay on each device's own tokens (the caller's activations are
    split the same way). Equals attend_with_prefix on the whole arrays.

    kv_b_stack: (the layers' kv_b_proj stack [L, R, N, K + V], plain; the layer's index), which then stands for
    w_kv_b: each half is read out of the stack by its own product (see kv_b_halves)."""
    b_ax, t_ax = spec[0], spec[1]
    t_axes = (t_ax,) if isinstance(t_ax, str) else tuple(t_ax)
    mesh = jax.sharding.get_abstract_mesh()
    B, T = ckv_BTR.shape[:2]
    n = 1
    for a in t_axes:
        n *= mesh.shape[a]
    t = T // n
    K = q_nope_BTNK.shape[-1]
    w = materialize(w_kv_b_RNX, dtype) if kv_b_stack is None else kv_b_stack
    if prefix is None:
        prefix = (jnp.zeros((B, 0, ckv_BTR.shape[-1]), dtype), jnp.zeros((B, 0, k_pe_BTP.shape[-1]), dtype),
                  jnp.zeros((B, 0), bool))
    c_ckv_BCR, c_k_pe_BCP, c_valid_BC = prefix
    C = c_ckv_BCR.shape[1]

    def local(q_nope, q_pe, ckv, k_pe, valid, c_ckv, c_k_pe, c_valid, w):
        if kv_b_stack is not None:
            w = stack_halves(*w, K, dtype)
        d = shard_index(t_axes)  # this device's block of the new tokens
        whole = [gather(x, t_axes, axis=1) for x in (ckv, k_pe, valid)]
        keys = [jnp.concatenate([c.astype(x.dtype), x], 1) for c, x in zip((c_ckv, c_k_pe, c_valid), whole)]
        end = C + (d + 1) * t  # keys past this device's own block are not seen by any of its queries
        keys[2] = keys[2].astype(bool) & (jnp.arange(C + T) < end)[None, :]
        keys = [keys[0].astype(dtype), keys[1].astype(dtype), keys[2]]

        def plain(q_nope, q_pe, ckv, k_pe, valid, w, start):
            w = jnp.concatenate(w, -1) if isinstance(w, tuple) else w
            rolled = [jnp.roll(x, C + T - start - t, axis=1) for x in (ckv, k_pe, valid)]  # own block last
            return attend(q_nope, q_pe, *rolled[:2], w, rolled[2], scale)

        def kernel(q_nope, q_pe, ckv, k_pe, valid, w, start):
            return attend_own_block(q_nope, q_pe, ckv, k_pe, w, valid, scale, start)

        args = (q_nope, q_pe, *keys, w, end - t)
        if not absorbed_is_cheaper(t, ckv.shape[-1], K, w_kv_b_RNX.shape[-1]):
            return plain(*args)
        return _evaluated_by(lambda *a: jax.lax.platform_dependent(*a, tpu=kernel, default=plain), plain, *args)

    new, whole_prefix = P(b_ax, t_ax, None), P(b_ax, None, None)
    return jax.shard_map(
        local, mesh=mesh,
        in_specs=(P(b_ax, t_ax, None, None), P(b_ax, t_ax, None, None), new, new, P(b_ax, t_ax),
                  whole_prefix, whole_prefix, P(b_ax, None), jax.tree.map(lambda _: P(), w)),
        out_specs=P(b_ax, t_ax, None, None), check_vma=False,
    )(q_nope_BTNK, q_pe_BTNP, ckv_BTR.astype(dtype), k_pe_BTP.astype(dtype), kv_valid_BT.astype(bool),
      c_ckv_BCR, c_k_pe_BCP, c_valid_BC.astype(bool), w)


def _evaluated_by(fast, plain, *args):
    """fast(*args) where the value alone is taken, and plain's value and derivatives under differentiation (a
    Pallas kernel has no derivative rule; training takes the plain form)."""
    @jax.custom_vjp
    def run(*a):
        return fast(*a)

    def fwd(*a):
        return jax.vjp(plain, *a)

    def bwd(vjp, dy):
        return vjp(dy)

    run.defvjp(fwd, bwd)
    return run(*args)


# An invalid key's score is lowered by this much (a power of two: exact in bf16), so its softmax weight is 0.
_MASK = float(2 ** 15)
_LANES = 128


def attend_own_block(q_nope_BtNK, q_pe_BtNP, ckv_BSR, k_pe_BSP, w_kv_b_RNX, kv_valid_BS, scale, start,
                     *, page: int = 512, interpret: bool = False):
    """attend_split_tokens' attention on a TPU: a device's t new tokens, keys start .. start + t - 1 of the
    S keys (in position order), each seeing the valid keys before `start` and its own block's causally.
    Absorbed (decode's form: one latent key per token for all N·t query rows), so its [N·t, S] scores are
    never written to HBM:

    - the keys before `start` are read by the paged kernel (k2jax.ops.paged_mla), laid out as one row's pages
      of `page` keys each, with the online softmax in VMEM. The kernel sees every key below its length, so an
      invalid one (a hole in a cached prefix, padding) is masked by one more rope column: 1 in every query,
      -_MASK in that key, 0 in a valid one;
    - the own block is one [N·t, t] tile in XLA, and the two online-softmax states are merged.

    q_nope [B, t, N, K], q_pe [B, t, N, P], ckv [B, S, R], k_pe [B, S, P] (the compute dtype), w_kv_b
    [R, N, K + V], kv_valid [B, S] bool; start: a traced int -> [B, t, N, V]. Equals `attend` over the keys up
    to start + t (tests/test_attention.py, the kernel in Pallas' interpreter)."""
    B, t, N, K = q_nope_BtNK.shape
    S, R = ckv_BSR.shape[1:]
    P = q_pe_BtNP.shape[-1]
    dt, f32 = ckv_BSR.dtype, jnp.float32
    w_uk_RNK, w_uv_RNV = kv_b_halves(w_kv_b_RNX, K, dt)
    q_lat_BtNR = (jnp.einsum("BTNK,RNK->BTNR", q_nope_BtNK, w_uk_RNK, preferred_element_type=f32)
                  * scale).astype(dt)
    q_pe_BtNP = (q_pe_BtNP.astype(f32) * scale).astype(dt)
    Pa = -(-(P + 1) // _LANES) * _LANES  # the rope part and the mask column, to whole lanes
    mask_col = jnp.zeros((Pa - P,), dt).at[0].set(1)
    q_pe_a = jnp.concatenate([q_pe_BtNP, jnp.broadcast_to(mask_col, (B, t, N, Pa - P))], -1)
    bias_BS1 = jnp.where(kv_valid_BS, 0.0, -_MASK).astype(dt)[..., None]
    keys_BSC = jnp.concatenate([ckv_BSR, k_pe_BSP, bias_BS1, jnp.zeros((B, S, Pa - P - 1), dt)], -1)
    W = -(-S // page)
    pages_1AYC = jnp.pad(keys_BSC, [(0, 0), (0, W * page - S), (0, 0)]).reshape(1, B * W, page, R + Pa)
    table_BW = jnp.arange(B * W, dtype=jnp.int32).reshape(B, W)
    rows_B = jnp.arange(B, dtype=jnp.int32)
    m1, l1, acc1 = paged_mla(q_lat_BtNR, q_pe_a, rows_B, jnp.ones((B,), bool), pages_1AYC, None, 0, table_BW,
                             jnp.full((B,), start, jnp.int32), R, interpret=interpret)

    def own(x):
        return jax.lax.dynamic_slice_in_dim(x, start, t, axis=1)

    ckv_BtR = own(ckv_BSR)
    s_BtNt = (jnp.einsum("BTNR,BSR->BTNS", q_lat_BtNR, ckv_BtR, preferred_element_type=f32)
              + jnp.einsum("BTNP,BSP->BTNS", q_pe_BtNP, own(k_pe_BSP), preferred_element_type=f32))
    see_Bt1t = (own(kv_valid_BS)[:, None, :] & jnp.tri(t, dtype=bool)[None])[:, :, None, :]
    s_BtNt = jnp.where(see_Bt1t, s_BtNt, _NEG_INF)
    m2 = s_BtNt.max(-1)
    p_BtNt = jnp.where(see_Bt1t, jnp.exp(s_BtNt - m2[..., None]), 0.0)
    acc2 = jnp.einsum("BTNS,BSR->BTNR", p_BtNt.astype(dt), ckv_BtR, preferred_element_type=f32)
    m = jnp.maximum(m1, m2)
    a1, a2 = jnp.exp(m1 - m), jnp.exp(m2 - m)
    l = a1 * l1 + a2 * p_BtNt.sum(-1)
    o_lat_BtNR = (a1[..., None] * acc1 + a2[..., None] * acc2) / jnp.where(l > 0, l, 1.0)[..., None]
    return jnp.einsum("BTNR,RNV->BTNV", o_lat_BtNR.astype(dt), w_uv_RNV, preferred_element_type=f32).astype(dt)
