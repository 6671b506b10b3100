"""Per-row sampling for the jitted steps: OpenAI / vLLM settings, one value per row, every value traced.

A batch's rows each carry their own settings (a dict of arrays, `default_rows` / `set_row` on the host), so
requests with any mix of settings share one compiled step; only the shapes (B, V) are static.

Processing order (vLLM's): float32 logits -> logit_bias (added) -> min_tokens (the row's stop ids are -inf
while step < min_tokens) -> grammar bitmask (a 0 bit is -inf) -> repetition penalty over the ids seen in the
prompt or the output (a logit > 0 is divided by r, else multiplied) -> frequency and presence penalties over
the output counts -> temperature -> logprobs -> top_k, top_p, min_p truncation -> the draw.

Cost: the step runs every token over V = 163,840 ids, so the work a batch does depends on what its rows ask:
the penalties (which read the [B, V] counts and prompt mask) run only when some row is penalised; the
selection of each row's K = TOP_K_SELECT best ids (in rounds of 16: XLA:GPU's selection kernel takes no more)
only when some row wants top logprobs or truncates by top_k / top_p; the random draw (Gumbel-max over
[B, V]) only when some row samples; and the full-vocabulary sort only when some sampling row's truncation is
not settled by its K best ids: a top_k above K, or a top_p whose mass the K best ids do not reach (a flat
distribution). min_p needs no sort: it is a threshold relative to the row's best logit. `sorted_cutoff` is
the plain form of the truncation, `selected_cutoff` the fast one (tested equal).

Letters: B rows, V vocabulary, W bitmask words (ceil(V / 32)), J top logprobs, K selected candidates,
I logit_bias entries, Z stop ids.
"""

from __future__ import annotations

import math
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

MAX_TOP_LOGPROBS = 20  # OpenAI's cap on top_logprobs
MAX_LOGIT_BIAS = 300  # OpenAI's cap on logit_bias entries (static width of the per-row bias arrays)
MAX_STOP_IDS = 16  # stop ids suppressed while min_tokens is not reached
TOP_K_SELECT = 64  # ids selected per row (lax.top_k) to settle top_k / top_p without a full sort
GREEDY_BELOW = 1e-5  # a temperature below this is greedy (vLLM's epsilon): dividing by it would overflow
MAX_PENALTY = 2.0  # OpenAI's range for presence and frequency penalties: [-2, 2]
MAX_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]

_K = max(TOP_K_SELECT, MAX_TOP_LOGPROBS)  # the candidates one selection gives both uses
_PIECE = 16  # XLA:GPU's fast TopK kernel takes k <= 16; a larger k may be lowered to a full sort


def default_rows(B: int) -> dict[str, np.ndarray]:
    """Host-side per-row settings for B rows, all greedy and neutral.

    temperature f32 [B] (0 = greedy), top_k i32 [B] (0 = all), top_p f32 [B] (1 = all), min_p f32 [B]
    (0 = off), seed u32 [B], step i32 [B] (tokens generated so far: the draw's key is
    fold_in(PRNGKey(seed), step), and min_tokens compares with it), presence f32 [B], frequency f32 [B],
    repetition f32 [B] (1 = off), min_tokens i32 [B], stop_ids i32 [B, MAX_STOP_IDS] (-1 = none),
    bias_ids i32 [B, MAX_LOGIT_BIAS] (-1 = none), bias_vals f32 [B, MAX_LOGIT_BIAS], and n_top i32 [B]: how
    many of top_ids / top_logprobs to fill (default all MAX_TOP_LOGPROBS; 0 where a request wants none lets
    a batch where no row wants any skip the selection).
    """
    if not isinstance(B, (int, np.integer)) or B < 1:
        raise ValueError(f"B must be a positive integer, got {B!r}")
    return {
        "temperature": np.zeros(B, np.float32), "top_k": np.zeros(B, np.int32), "top_p": np.ones(B, np.float32),
        "min_p": np.zeros(B, np.float32), "seed": np.zeros(B, np.uint32), "step": np.zeros(B, np.int32),
        "presence": np.zeros(B, np.float32), "frequency": np.zeros(B, np.float32),
        "repetition": np.ones(B, np.float32), "min_tokens": np.zeros(B, np.int32),
        "stop_ids": np.full((B, MAX_STOP_IDS), -1, np.int32), "bias_ids": np.full((B, MAX_LOGIT_BIAS), -1, np.int32),
        "bias_vals": np.zeros((B, MAX_LOGIT_BIAS), np.float32), "n_top": np.full(B, MAX_TOP_LOGPROBS, np.int32),
    }


def slot_settings(slots: int) -> dict[str, np.ndarray]:
    """The settings a runtime keeps per slot on the device (k2jax.runtime.runner), all neutral: default_rows
    but the step (the tokens a row has generated, which each step's input carries)."""
    return {k: v for k, v in default_rows(slots).items() if k != "step"}


def set_row(rows: dict, i: int, *, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, step=0,
            presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, min_tokens=0, stop_ids=(),
            logit_bias=(), top_logprobs=MAX_TOP_LOGPROBS, vocab_size: int | None = None) -> None:
    """Write row i of `rows` (from default_rows) in place; every field of the row is overwritten.

    top_k: 0 or -1 = all (vLLM's -1 accepted). seed: any integer, taken modulo 2**32. logit_bias: a mapping
    or an iterable of (token id, bias), at most MAX_LOGIT_BIAS entries, each id once, bias in [-100, 100].
    stop_ids: at most MAX_STOP_IDS ids (the end-of-sequence id included), suppressed while step < min_tokens.
    top_logprobs: how many top entries the row's result fills (0..MAX_TOP_LOGPROBS). With vocab_size, token
    ids are also checked against it (without it, an id >= V is ignored on the device).
    Raises ValueError naming the bad setting.
    """
    B = rows["temperature"].shape[0]
    if not isinstance(i, (int, np.integer)) or not 0 <= i < B:
        raise ValueError(f"row index must be in [0, {B}), got {i!r}")
    _check_range("temperature", temperature, 0.0, math.inf)
    if not isinstance(top_k, (int, np.integer)) or isinstance(top_k, bool) or top_k < -1:
        raise ValueError(f"top_k must be an integer >= -1 (-1 or 0: all), got {top_k!r}")
    _check_range("top_p", top_p, 0.0, 1.0, low_open=True)
    _check_range("min_p", min_p, 0.0, 1.0)
    _check_range("presence_penalty", presence_penalty, -MAX_PENALTY, MAX_PENALTY)
    _check_range("frequency_penalty", frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
    _check_range("repetition_penalty", repetition_penalty, 0.0, math.inf, low_open=True)
    for name, v in (("seed", seed), ("step", step), ("min_tokens", min_tokens), ("top_logprobs", top_logprobs)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
            raise ValueError(f"{name} must be an integer, got {v!r}")
    if step < 0 or step >= 2**31:
        raise ValueError(f"step must be in [0, 2**31), got {step}")
    if min_tokens < 0 or min_tokens >= 2**31:
        raise ValueError(f"min_tokens must be in [0, 2**31), got {min_tokens}")
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs}")
    stop = list(stop_ids)
    if len(stop) > MAX_STOP_IDS:
        raise ValueError(f"stop_ids holds {len(stop)} ids, at most {MAX_STOP_IDS} allowed")
    for t in stop:
        _check_id("stop_ids", t, vocab_size)
    pairs = list(logit_bias.items() if isinstance(logit_bias, Mapping) else logit_bias)
    if len(pairs) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias holds {len(pairs)} entries, at most {MAX_LOGIT_BIAS} allowed")
    seen = set()
    for pair in pairs:
        if len(pair) != 2:
            raise ValueError(f"logit_bias entries must be (token id, bias) pairs, got {pair!r}")
        t, v = pair
        _check_id("logit_bias", t, vocab_size)
        if int(t) in seen:
            raise ValueError(f"logit_bias: token id {int(t)} is given twice")
        seen.add(int(t))
        _check_range(f"logit_bias[{int(t)}]", v, -MAX_BIAS, MAX_BIAS)

    rows["temperature"][i] = temperature
    rows["top_k"][i] = max(top_k, 0)
    rows["top_p"][i] = top_p
    rows["min_p"][i] = min_p
    rows["seed"][i] = int(seed) % 2**32
    rows["step"][i] = step
    rows["presence"][i] = presence_penalty
    rows["frequency"][i] = frequency_penalty
    rows["repetition"][i] = repetition_penalty
    rows["min_tokens"][i] = min_tokens
    rows["stop_ids"][i] = -1
    rows["stop_ids"][i, :len(stop)] = stop
    rows["bias_ids"][i] = -1
    rows["bias_vals"][i] = 0.0
    if pairs:
        rows["bias_ids"][i, :len(pairs)] = [int(t) for t, _ in pairs]
        rows["bias_vals"][i, :len(pairs)] = [float(v) for _, v in pairs]
    rows["n_top"][i] = top_logprobs


def _check_range(name, v, lo, hi, low_open=False):
    ok = isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) and math.isfinite(v)
    if not ok or v > hi or v < lo or (low_open and v == lo):
        raise ValueError(f"{name} must be a number in {'(' if low_open else '['}{lo}, {hi}], got {v!r}")


def _check_id(name, t, vocab_size):
    if not isinstance(t, (int, np.integer)) or isinstance(t, bool) or t < 0 or (vocab_size is not None and
                                                                                t >= vocab_size):
        limit = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
        raise ValueError(f"{name}: token ids must be integers {limit}, got {t!r}")


def process_logits(logits_BV, rows, counts_BV=None, prompt_mask_BV=None, bitmask_BW=None):
    """float32 logits [B, V] after logit_bias, min_tokens, the grammar bitmask and the penalties, before the
    temperature (the module docstring has the order). Excluded ids are -inf.

    counts_BV int [B, V]: each id's count in the row's output so far (update_counts); prompt_mask_BV bool
    [B, V]: the ids in the row's prompt (mark_prompt); None for either = empty (no penalty from it).
    bitmask_BW int32 [B, ceil(V / 32)] in xgrammar's layout (bit j of word w allows id 32*w + j; bits past V
    are ignored); None = no mask. Ids in bias_ids / stop_ids outside [0, V) are ignored.
    """
    x_BV = jnp.asarray(logits_BV).astype(jnp.float32)
    B, V = x_BV.shape
    b_B1 = jnp.arange(B)[:, None]
    bias_ids_BI = jnp.asarray(rows["bias_ids"])
    x_BV = x_BV.at[b_B1, jnp.where(bias_ids_BI >= 0, bias_ids_BI, V)].add(
        jnp.asarray(rows["bias_vals"], jnp.float32), mode="drop")
    stop_BZ = jnp.asarray(rows["stop_ids"])
    early_B1 = (jnp.asarray(rows["step"]) < jnp.asarray(rows["min_tokens"]))[:, None]
    x_BV = x_BV.at[b_B1, jnp.where(early_B1 & (stop_BZ >= 0), stop_BZ, V)].set(-jnp.inf, mode="drop")
    if bitmask_BW is not None:
        x_BV = jnp.where(allowed_ids(bitmask_BW, V), x_BV, -jnp.inf)
    if counts_BV is None and prompt_mask_BV is None:
        return x_BV
    rep_B, freq_B, pres_B = (jnp.asarray(rows[k], jnp.float32) for k in ("repetition", "frequency", "presence"))
    if counts_BV is None:
        counts_BV = jnp.zeros((B, V), jnp.int32)
    if prompt_mask_BV is None:
        prompt_mask_BV = jnp.zeros((B, V), bool)

    def penalise(x_BV, counts_BV, prompt_BV):
        n_BV = counts_BV.astype(jnp.float32)
        seen_BV = prompt_BV | (counts_BV > 0)
        r_B1 = rep_B[:, None]
        x_BV = jnp.where(seen_BV, jnp.where(x_BV > 0, x_BV / r_B1, x_BV * r_B1), x_BV)
        return x_BV - (freq_B[:, None] * n_BV + pres_B[:, None] * (counts_BV > 0))

    # Only a batch with a penalised row reads the [B, V] counts and prompt mask (every other row is unchanged
    # by it: r = 1 and zero penalties are exact no-ops in float32).
    penalised = jnp.any((rep_B != 1) | (freq_B != 0) | (pres_B != 0))
    return jax.lax.cond(penalised, penalise, lambda x_BV, *_: x_BV, x_BV, jnp.asarray(counts_BV),
                        jnp.asarray(prompt_mask_BV, bool))


def allowed_ids(bitmask_BW, V: int):
    """bool [B, V] from an xgrammar bitmask int32 [B, W] (W = ceil(V / 32)): bit j of word w allows id
    32*w + j."""
    words_BW = jnp.asarray(bitmask_BW).astype(jnp.uint32)
    B, W = words_BW.shape
    if W * 32 < V:
        raise ValueError(f"bitmask_BW has {W} words per row, need ceil(V / 32) = {-(-V // 32)} for V = {V}")
    bits_BW32 = (words_BW[:, :, None] >> jnp.arange(32, dtype=jnp.uint32)) & 1
    return bits_BW32.reshape(B, W * 32)[:, :V].astype(bool)


def sample_rows(logits_BV, rows, counts_BV=None, prompt_mask_BV=None, bitmask_BW=None, draft_B=None):
    """One token per row, each row with its own settings (see default_rows), inside a jitted step.

    logits_BV [B, V] any float dtype; rows: the dict of default_rows (numpy or traced); counts_BV,
    prompt_mask_BV, bitmask_BW as process_logits takes them.
    -> dict(tokens [B] int32, logprob [B] f32, top_ids [B, MAX_TOP_LOGPROBS] int32,
            top_logprobs [B, MAX_TOP_LOGPROBS] f32, all_masked [B] bool).

    Greedy rows (temperature < GREEDY_BELOW, 0 included) take the argmax of the processed logits; sampling
    rows draw from softmax(processed / temperature) truncated to the ids that top_k (ties at the k-th value
    kept), top_p (applied within the top_k set: the smallest set of best ids whose mass reaches top_p, ties at
    its last value kept) and min_p (p >= min_p * p_max) all keep, with the key fold_in(PRNGKey(seed), step)
    (the same row, seed and step always draw the same token, whatever else is in the batch).

    Logprobs (a choice, documented): log_softmax of the processed logits divided by the temperature (1 for a
    greedy row), i.e. after bias, min_tokens, bitmask and penalties, but BEFORE the top_k / top_p / min_p
    truncation, so they are the model's scores under the request's constraints and temperature, not the
    probabilities of the truncated draw. `logprob` is the chosen token's; top_ids / top_logprobs are the
    row's n_top best of that same distribution, best first (equal values: lower id first); entries past
    n_top are id -1 and -inf.

    A row where every id is excluded (a grammar that allows nothing, say) gives token 0, logprob -inf, top
    entries (id 0.., -inf) and all_masked True: defined values, no NaN; the caller should end that request.

    draft_B int32 [B] (speculative decoding; -1, or any id outside [0, V), = none): a token proposed for this
    position, verified here,
    and the result also holds `accepted` [B] bool. A greedy row accepts it when it is the argmax (the token
    is the argmax either way). A sampling row accepts it with probability p(draft) under the truncated
    distribution (a uniform drawn with fold_in(key, 1)), else draws from that distribution without the draft
    (renormalised): the token is then distributed as without a draft, whatever was proposed (rejection
    sampling against a proposal that puts all its mass on the draft).
    """
    x_BV = process_logits(logits_BV, rows, counts_BV, prompt_mask_BV, bitmask_BW)
    B, V = x_BV.shape
    temp_B = jnp.asarray(rows["temperature"], jnp.float32)
    greedy_B = ~(temp_B >= GREEDY_BELOW)
    x_BV = x_BV / jnp.where(greedy_B, 1.0, temp_B)[:, None]

    max_B = jnp.max(x_BV, axis=-1)
    all_masked_B = max_B == -jnp.inf
    lse_B = _logsumexp(x_BV)  # 0 for an all-masked row: -inf - 0 = -inf for every id, no NaN

    top_k_B = jnp.asarray(rows["top_k"], jnp.int32)
    top_p_B = jnp.asarray(rows["top_p"], jnp.float32)
    min_p_B = jnp.asarray(rows["min_p"], jnp.float32)
    n_top_B = jnp.asarray(rows["n_top"], jnp.int32)
    sampling_B = ~greedy_B
    truncating_B = sampling_B & (((top_k_B > 0) & (top_k_B < V)) | (top_p_B < 1))
    K = min(_K, V)
    sel_vals_BK, sel_ids_BK = jax.lax.cond(
        jnp.any(n_top_B > 0) | jnp.any(truncating_B), lambda x_BV: top_values(x_BV, K),
        lambda x_BV: (jnp.full((B, K), -jnp.inf, jnp.float32), jnp.zeros((B, K), jnp.int32)), x_BV)

    def draw(x_BV):
        # Per row, the lowest kept value: every id at or above it stays (ties kept). The K best values
        # settle top_k and top_p for most rows; the whole vocabulary is sorted only when a sampling row's
        # top_k is above K, or its top_p needs more than the K best ids' mass.
        sel_cut_B, settled_B = selected_cutoff(sel_vals_BK, lse_B, top_k_B, top_p_B, V)
        cut_B = jax.lax.cond(jnp.any(sampling_B & ~settled_B), lambda x_BV: sorted_cutoff(x_BV, top_k_B, top_p_B),
                             lambda x_BV: sel_cut_B, x_BV)
        # min_p: p >= min_p * p_max, i.e. x >= max + log(min_p); the best id is never cut, so the order of
        # the truncations does not matter.
        cut_B = jnp.maximum(cut_B, jnp.where(min_p_B > 0, max_B + jnp.log(min_p_B), -jnp.inf))
        kept_BV = jnp.where(x_BV >= cut_B[:, None], x_BV, -jnp.inf)
        keys_B = jax.vmap(lambda s, t: jax.random.fold_in(jax.random.PRNGKey(s), t))(
            jnp.asarray(rows["seed"], jnp.uint32), jnp.asarray(rows["step"], jnp.int32))
        best_B = jnp.argmax(x_BV, axis=-1).astype(jnp.int32)
        accept_B = jnp.zeros(B, bool)
        if draft_B is not None:  # accept the draft with probability p(draft), else draw without it
            d_B1 = jnp.asarray(draft_B, jnp.int32)[:, None]
            has_B1 = (d_B1 >= 0) & (d_B1 < V)
            p_d_B = jnp.exp(jnp.take_along_axis(kept_BV, jnp.where(has_B1, d_B1, 0), axis=-1)[:, 0]
                            - _logsumexp(kept_BV))
            u_B = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1), ()))(keys_B)
            accept_B = has_B1[:, 0] & (u_B < p_d_B)
            kept_BV = jnp.where(has_B1 & (jnp.arange(V)[None] == d_B1), -jnp.inf, kept_BV)
        gumbel_BV = jax.vmap(lambda k: jax.random.gumbel(k, (V,), jnp.float32))(keys_B)
        drawn_B = jnp.argmax(kept_BV + gumbel_BV, axis=-1).astype(jnp.int32)  # Gumbel-max: from softmax(kept)
        if draft_B is not None:
            drawn_B = jnp.where(accept_B, draft_B, drawn_B)
            accept_B = jnp.where(greedy_B, best_B == draft_B, accept_B)
        return jnp.where(greedy_B, best_B, drawn_B), accept_B

    def greedy(x_BV):
        best_B = jnp.argmax(x_BV, axis=-1).astype(jnp.int32)
        return best_B, (jnp.zeros(B, bool) if draft_B is None else best_B == draft_B)

    tokens_B, accepted_B = jax.lax.cond(jnp.any(sampling_B), draw, greedy, x_BV)
    logprob_B = jnp.take_along_axis(x_BV, tokens_B[:, None], axis=-1)[:, 0] - lse_B
    J = min(MAX_TOP_LOGPROBS, K)
    shown_BJ = jnp.arange(MAX_TOP_LOGPROBS)[None, :J] < n_top_B[:, None]
    top_ids_BJ = jnp.where(shown_BJ, sel_ids_BK[:, :J], -1)
    top_lp_BJ = jnp.where(shown_BJ, sel_vals_BK[:, :J] - lse_B[:, None], -jnp.inf)
    if J < MAX_TOP_LOGPROBS:  # a vocabulary smaller than MAX_TOP_LOGPROBS (tests): pad to the fixed width
        top_ids_BJ = jnp.pad(top_ids_BJ, ((0, 0), (0, MAX_TOP_LOGPROBS - J)), constant_values=-1)
        top_lp_BJ = jnp.pad(top_lp_BJ, ((0, 0), (0, MAX_TOP_LOGPROBS - J)), constant_values=-jnp.inf)
    out = dict(tokens=tokens_B, logprob=logprob_B, top_ids=top_ids_BJ, top_logprobs=top_lp_BJ,
               all_masked=all_masked_B)
    return out if draft_B is None else out | {"accepted": accepted_B}


def top_values(x_BV, n: int):
    """The n best values of each row and their ids, best first, equal values lower id first: ([B, n] f32,
    [B, n] int32). Taken in rounds of lax.top_k(., 16), the ids picked so far masked out between rounds, so
    that on GPU each round is XLA's selection kernel rather than a sort of the row. Where a row has fewer
    than n finite values, the -inf entries' ids are arbitrary (possibly repeated)."""
    B, V = x_BV.shape
    b_B1 = jnp.arange(B)[:, None]
    vals, ids = [], []
    for start in range(0, n, _PIECE):
        v_BP, i_BP = jax.lax.top_k(x_BV, min(_PIECE, n - start))
        vals.append(v_BP)
        ids.append(i_BP.astype(jnp.int32))
        if start + _PIECE < n:
            x_BV = x_BV.at[b_B1, i_BP].set(-jnp.inf)
    return jnp.concatenate(vals, axis=1), jnp.concatenate(ids, axis=1)


def sorted_cutoff(x_BV, top_k_B, top_p_B):
    """The lowest value each row keeps under top_k (0 or >= V = all) then top_p (1 = all), float32 [B], by a
    sort of the whole vocabulary: keep an id while the mass before it (within the top_k set, renormalised) is
    below top_p; the best id always stays. Rows that cut nothing get their lowest value. The plain form:
    selected_cutoff gives the same from the K best values where they settle it."""
    B, V = x_BV.shape
    sorted_BV = -jnp.sort(-x_BV, axis=-1)
    k_B = jnp.where((top_k_B > 0) & (top_k_B < V), top_k_B, V)
    in_k_BV = jnp.arange(V)[None] < k_B[:, None]
    z_BV = jnp.where(in_k_BV, sorted_BV, -jnp.inf)
    p_BV = jnp.exp(z_BV - _logsumexp(z_BV)[:, None])
    # top_p = 1 keeps all explicitly: in float32 the running mass reaches 1.0 before the tail does
    keep_BV = in_k_BV & ((jnp.cumsum(p_BV, axis=-1) - p_BV < top_p_B[:, None]) | (top_p_B >= 1)[:, None])
    keep_BV = keep_BV.at[:, 0].set(True)
    return jnp.min(jnp.where(keep_BV, sorted_BV, jnp.inf), axis=-1)


def selected_cutoff(sel_vals_BK, lse_B, top_k_B, top_p_B, V: int):
    """sorted_cutoff's value from the K best values of each row (sel_vals_BK, best first, as lax.top_k gives
    them) and the row's log-sum-exp over all V ids (lse_B), where those settle it -> (cut [B] f32, settled
    [B] bool). Settled: the row cuts nothing (cut -inf), or its top_k is <= K, or (no top_k) its K best ids
    already hold top_p of the mass, so no id past them can be kept."""
    B, K = sel_vals_BK.shape
    k_B = jnp.where((top_k_B > 0) & (top_k_B < V), top_k_B, V)
    in_k_BK = jnp.arange(K)[None] < k_B[:, None]
    # the normaliser over the top_k set: the K best hold all of it when k <= K, else it is the whole row
    logz_B = jnp.where(k_B <= K, _logsumexp(jnp.where(in_k_BK, sel_vals_BK, -jnp.inf)), lse_B)
    p_BK = jnp.where(in_k_BK, jnp.exp(sel_vals_BK - logz_B[:, None]), 0.0)
    keep_BK = in_k_BK & ((jnp.cumsum(p_BK, axis=-1) - p_BK < top_p_B[:, None]) | (top_p_B >= 1)[:, None])
    keep_BK = keep_BK.at[:, 0].set(True)
    no_cut_B = (k_B >= V) & (top_p_B >= 1)
    empty_B = sel_vals_BK[:, 0] == -jnp.inf  # nothing to keep: any cut will do
    settled_B = no_cut_B | (k_B <= K) | ((k_B >= V) & (jnp.sum(p_BK, axis=-1) >= top_p_B)) | empty_B
    cut_B = jnp.where(no_cut_B, -jnp.inf, jnp.min(jnp.where(keep_BK, sel_vals_BK, jnp.inf), axis=-1))
    return cut_B, settled_B


def _logsumexp(x_BX):
    """log(sum(exp(x))) over the last axis, [B]; 0 for a row with nothing finite (so x - it stays -inf)."""
    top_B = jnp.max(x_BX, axis=-1)
    top_B = jnp.where(top_B == -jnp.inf, 0.0, top_B)
    s_B = jnp.sum(jnp.exp(x_BX - top_B[:, None]), axis=-1)
    return jnp.where(s_B > 0, top_B + jnp.log(jnp.where(s_B > 0, s_B, 1.0)), 0.0)


def update_counts(counts_BV, tokens_B, live_B):
    """counts_BV int [B, V] + 1 at each live row's new token (the output counts the penalties read); rows
    that are not live (live_B bool [B] False) and ids outside [0, V) change nothing."""
    B, V = counts_BV.shape
    tokens_B = jnp.asarray(tokens_B)
    idx_B = jnp.where(jnp.asarray(live_B, bool) & (tokens_B >= 0), tokens_B, V)
    return counts_BV.at[jnp.arange(B), idx_B].add(1, mode="drop")


def mark_prompt(prompt_mask_BV, tokens_BT, valid_BT):
    """bool [B, V]: prompt_mask_BV, also True where row b's prompt tokens tokens_BT int [B, T] hold the id
    (only where valid_BT bool [B, T]; ids outside [0, V) ignored). Call once per prompt chunk; start from
    jnp.zeros((B, V), bool) for a new row."""
    B, V = prompt_mask_BV.shape
    tokens_BT = jnp.asarray(tokens_BT)
    idx_BT = jnp.where(jnp.asarray(valid_BT, bool) & (tokens_BT >= 0), tokens_BT, V)
    return jnp.asarray(prompt_mask_BV, bool).at[jnp.arange(B)[:, None], idx_BT].set(True, mode="drop")
