"""Log-probabilities of given tokens (a prompt's, for scoring) from final hidden states, on the device.

The logits of every position of a long chunk ([B, T, V] float32: 2.7 GB for Kimi K2 at 4096 tokens) are
never made whole: `token_logprobs` runs the head over blocks of positions (at most ROWS_PER_BLOCK rows of
[*, V] at a time), and keeps per position only the target's log-softmax value, its rank and the J best.
`token_logprobs_reference` is the plain form (the whole [B, T, V] log_softmax), tested equal.

Letters: B rows, T positions, D model, V vocabulary, J top entries.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k2jax.ops.matmul import einsum
from k2jax.ops.quant import materialize
from k2jax.sharding import local_size

# Rows (positions x batch rows) of logits one block holds: 128 x V float32 is 84 MB for Kimi K2's vocabulary.
ROWS_PER_BLOCK = 128
# Where the head's vocabulary is split over devices a device holds 1/n of each row's logits: a block takes up
# to this many times the rows, so that each device reads its part of the head fewer times per chunk (Kimi
# K2 on 64 chips, a lone 8192-token prompt: 8 reads of a 37 MB part, not 64).
SPLIT_ROWS = 8


def token_logprobs(h_BTD, head_DV, targets_BT, top: int) -> dict:
    """Scores of `targets_BT` (the token each position predicts; < 0: none) under logits h_BTD @ head_DV.

    h_BTD: the final (normed) hidden states; head_DV: the output head (a plain or quantized weight).
    -> {"logprob" [B, T] f32 (the target's log-softmax value; 0 where target < 0), "rank" [B, T] i32 (1 + the
    ids with a higher logit; 0 where none), "top_ids" [B, T, J] i32, "top_logprobs" [B, T, J] f32 (the J best
    ids, best first; equal values: lower id first)}. Positions run in blocks of at most ROWS_PER_BLOCK rows
    (times the devices the vocabulary is split over, up to SPLIT_ROWS)."""
    B, T, D = h_BTD.shape
    V = head_DV.shape[-1]
    blk = _block(B, T, min(SPLIT_ROWS, V // local_size("vocab", V)))
    nb = T // blk
    # Block n holds positions n, n + nb, n + 2·nb, ... (t positions, strided): where a lone row's positions
    # are split over the chips (sequence parallel), each block then takes a few rows of every chip, read in
    # place. Consecutive blocks would each lie on one chip, and a loop step's slice of the split axis makes
    # XLA gather the whole [T, D] (Kimi K2, 8192 positions on 64 chips: 224 MiB, 64 times per step).
    h_NBtD = h_BTD.reshape(B, blk, nb, D).transpose(2, 0, 1, 3)  # N blocks; t positions in a block
    tg_NBt = targets_BT.reshape(B, blk, nb).transpose(2, 0, 1)

    def one(args):
        h_BtD, tg_Bt = args
        return _scores(einsum("BTD,DV->BTV", h_BtD, head_DV, jnp.float32), tg_Bt, top)

    out = jax.lax.map(one, (h_NBtD, tg_NBt))
    return jax.tree.map(lambda x: jnp.moveaxis(x, 0, 2).reshape(B, T, *x.shape[3:]), out)


def token_logprobs_reference(h_BTD, head_DV, targets_BT, top: int) -> dict:
    """token_logprobs in one piece: log_softmax over the whole [B, T, V] logits."""
    logits = jnp.einsum("BTD,DV->BTV", h_BTD.astype(jnp.float32), materialize(head_DV, jnp.float32))
    return _scores(logits, targets_BT, top)


def _scores(logits_BTV, targets_BT, top: int) -> dict:
    lp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
    has_BT = targets_BT >= 0
    idx_BT1 = jnp.where(has_BT, targets_BT, 0)[..., None]
    own_BT1 = jnp.take_along_axis(lp_BTV, idx_BT1, axis=-1)
    rank_BT = 1 + (lp_BTV > own_BT1).sum(-1, dtype=jnp.int32)
    top_lp, top_ids = jax.lax.top_k(lp_BTV, top)  # ties: the lower index first
    return {"logprob": jnp.where(has_BT, own_BT1[..., 0], 0.0), "rank": jnp.where(has_BT, rank_BT, 0),
            "top_ids": top_ids.astype(jnp.int32), "top_logprobs": top_lp}


def _block(B: int, T: int, split: int = 1) -> int:
    """Positions per block: the largest divisor of T with at most ROWS_PER_BLOCK · split rows over the B rows
    (split: the devices each row's logits are spread over, at most SPLIT_ROWS)."""
    most = max(1, ROWS_PER_BLOCK * split // B)
    return max(d for d in range(1, min(T, most) + 1) if T % d == 0)
