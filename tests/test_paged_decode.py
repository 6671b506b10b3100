"""A decode step's attention over the paged cache read in place (k2jax.ops.paged.PagedContext.decode_in_place,
the TPU path): the Pallas kernel run in its interpreter on CPU, on one device and on a mesh whose data-parallel
shards each hold their own part of the pool, against XLA's form (the cached tokens gathered, then the model's
attention over them and the new token: the path off TPU). And when it applies: never with the heads split
over a mesh axis, nor for rows that do not split like the pool."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k2jax.ops.attention import attend_with_prefix
from k2jax.ops.paged import PagedCache, PagedContext, quantize_latents
from k2jax.sharding import make_mesh, use_mesh

L, Y, W, R, P, N, K, V = 2, 4, 3, 32, 8, 4, 16, 16
C = R + P


def _cache(B, shards, quantized, pad, lengths, shard_axes=()):
    """B rows over `shards` parts of the pool (each its trash page, then its rows' W pages, in a shuffled
    order), random latents everywhere (what rows do not hold must not be read)."""
    per, local = B // shards, 1 + (B // shards) * W
    rng = np.random.default_rng(0)
    x = rng.standard_normal((L, shards * local, Y, C)).astype(np.float32)
    x[..., R:] *= 3.0
    table = np.zeros((B, W), np.int32)
    for s in range(shards):
        ids = 1 + rng.permutation(per * W)
        table[s * per:(s + 1) * per] = s * local + ids.reshape(per, W)
    if quantized:
        q, sc = quantize_latents(jnp.asarray(x), R)
        pages, scales = q, {"g": jnp.swapaxes(sc, -1, -2).reshape(L, shards * local, 2 * Y)}
    else:
        pages, scales = jnp.asarray(x, jnp.bfloat16), {}
    pages = jnp.pad(pages, [(0, 0)] * 3 + [(0, pad)])
    return PagedCache({"g": pages}, scales, jnp.asarray(table), jnp.asarray(lengths, jnp.int32), P, shard_axes,
                      None, pad)


def _step(B, valid, N=N, K=K, V=V):
    rng = np.random.default_rng(1)
    bf = jnp.bfloat16
    return (jnp.asarray(rng.standard_normal((B, 1, N, K)), bf), jnp.asarray(rng.standard_normal((B, 1, N, P)), bf),
            jnp.asarray(rng.standard_normal((B, 1, R)), bf), jnp.asarray(rng.standard_normal((B, 1, P)), bf),
            jnp.asarray(rng.standard_normal((R, N, K + V)) * 0.2, bf), jnp.asarray(valid)[:, None])


def _both(cache, step):
    """(in place, gathered) outputs [B, 1, N, V] as float32."""
    ctx = PagedContext(cache, "g", jnp.asarray(1), jnp.bfloat16)
    scale = K ** -0.5

    def in_place(*a):
        return ctx.decode_in_place(*a, scale=scale, interpret=True)

    def gathered(*a):
        return attend_with_prefix(*a, scale, jnp.bfloat16, "auto", ctx.read())

    return [np.asarray(jax.jit(f)(*step), np.float32) for f in (in_place, gathered)]


@pytest.mark.parametrize("quantized", [False, True], ids=["bf16-pool", "fp8-pool"])
@pytest.mark.parametrize("pad", [0, 8])
def test_one_device(quantized, pad):
    """Lengths 0 (the new token alone), 4 (a page boundary), 7 and 12 (a full table); row 4's token is
    padding (kv_valid False): it sees its cache only; a padding row with nothing cached gets 0, not NaN."""
    lengths = [0, 4, 7, 12, 9, 0]
    valid = [True, True, True, True, False, False]
    got, want = _both(_cache(6, 1, quantized, pad, lengths), _step(6, valid))
    assert np.isfinite(got).all()
    # Row 5 sees no key: XLA's softmax averages the masked keys (a finite -inf), the kernel gives 0; neither
    # reaches a real token.
    np.testing.assert_allclose(got[:5], want[:5], rtol=3e-2, atol=3e-2)
    assert not np.abs(got[5]).any()
    # Not a vacuous match: the other layer's pages (the stack reversed) give other outputs.
    cache = _cache(6, 1, quantized, pad, lengths)
    other = cache.replace(pages={"g": cache.pages["g"][::-1]},
                          scales={k: v[::-1] for k, v in cache.scales.items()})
    assert np.abs(_both(other, _step(6, valid))[0][1:4] - got[1:4]).max() > 0.05


@pytest.mark.parametrize("quantized", [False, True], ids=["bf16-pool", "fp8-pool"])
def test_each_shard_reads_its_own_part_of_the_pool(quantized):
    """Eight rows over a data=4 mesh (two per shard): each shard's kernel sees its part of the pool and its
    rows' tables shifted to it, and the result equals the gathered form of the whole pool."""
    mesh = make_mesh("data=4,expert=2")
    lengths = [3, 12, 0, 8, 5, 11, 1, 4]
    valid = [True] * 7 + [False]
    cache = _cache(8, 8, quantized, 0, lengths, ("data", "expert"))
    with use_mesh(mesh):
        assert cache.in_place(8, N)
        got, want = _both(cache, _step(8, valid))
    np.testing.assert_allclose(got, want, rtol=3e-2, atol=3e-2)


def test_when_it_applies():
    mesh = make_mesh("data=4,tensor=2")
    cache = _cache(8, 4, False, 0, [1] * 8, ("data",))
    assert cache.in_place(8, N)  # no mesh: one shard
    with use_mesh(mesh):
        assert not cache.in_place(8, N)   # tensor=2 splits the 4 heads
        assert cache.in_place(8, 3)       # 3 heads: tensor=2 does not divide them, they stay whole
        assert not cache.in_place(2, 3)   # 2 rows do not split over data=4: the pool would be read whole


def test_kv_b_read_out_of_the_stack():
    """With the model's kv_b_proj stack in the cache (K2Model.forward hands it), the layer's W_UK and W_UV are
    taken from the stack at the context's layer (1 here), not from the weight passed in."""
    lengths, valid = [0, 4, 7, 12], [True] * 4
    cache = _cache(4, 1, False, 0, lengths)
    step = _step(4, valid)
    w = step[4]
    want = _both(cache, step)[0]
    stacked = cache.replace(kv_b={"g": jnp.stack([w[::-1], w])})
    wrong_w = step[:4] + (w * 0.5,) + step[5:]  # ignored: the stack's layer 1 is w
    ctx = PagedContext(stacked, "g", jnp.asarray(1), jnp.bfloat16)
    got = np.asarray(jax.jit(lambda *a: ctx.decode_in_place(*a, scale=K ** -0.5, interpret=True))(*wrong_w),
                     np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    other = PagedContext(stacked, "g", jnp.asarray(0), jnp.bfloat16)
    assert np.abs(np.asarray(other.decode_in_place(*wrong_w, scale=K ** -0.5, interpret=True), np.float32)
                  - want).max() > 0.05


@pytest.mark.parametrize("kv", [(128, 128), (256, 128), (16, 16)], ids=["K2", "two-K-blocks", "unaligned"])
def test_fp8_kv_b_read_out_of_the_stack(kv):
    """An fp8 kv_b_proj stack (Kimi-K2-Instruct's): where each 128 x 128 scale block covers whole columns of
    one head's K or V part (K2: K = V = 128), W_UK and W_UV are read as held, each block's scale taken after
    the product over K and onto the latent before the one over R (head_blocks); otherwise the layer is
    dequantized. Both against XLA's gathered form with the layer's weight dequantized to bf16, and the
    stack's layer (1), not the weight passed in, is the one used. The read-as-held form does not round the
    dequantized weight to bf16, so it is held to the float64 result at least as closely as the dequantizing
    form is."""
    from k2jax.ops.paged import head_blocks
    from k2jax.ops.quant import dequantize_weight, quantize_weight

    Kh, Vh = kv
    lengths, valid = [0, 4, 7, 12], [True] * 4
    cache = _cache(4, 1, False, 0, lengths)
    step = _step(4, valid, 2, Kh, Vh)
    rng = np.random.default_rng(5)
    w = rng.standard_normal((2, R, 2, Kh + Vh)).astype(np.float32) * 0.2
    w[1, :, 1] *= 4.0  # blocks of different scales
    stack = quantize_weight(w, "fp8", 1, 1)
    assert bool(head_blocks(stack, Kh)) == (kv != (16, 16))
    ctx = PagedContext(cache.replace(kv_b={"g": stack}), "g", jnp.asarray(1), jnp.bfloat16)
    got = np.asarray(jax.jit(lambda *a: ctx.decode_in_place(*a, scale=Kh ** -0.5, interpret=True))(*step),
                     np.float64)
    read = PagedContext(cache, "g", jnp.asarray(1), jnp.bfloat16).read()
    want = np.asarray(attend_with_prefix(*step[:4], dequantize_weight(stack[1], jnp.bfloat16), step[5],
                                         Kh ** -0.5, jnp.bfloat16, "auto", read), np.float64)
    with jax.enable_x64():
        f64 = [jnp.asarray(np.asarray(a, np.float64)) for a in step[:4]]
        exact = np.asarray(attend_with_prefix(*f64, jnp.asarray(dequantize_weight(stack[1], np.float32), jnp.float64),
                                              step[5], Kh ** -0.5, jnp.float64, "plain",
                                              jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), read)))
    assert np.abs(exact).max() > 1.0
    err, err_want = np.abs(got - exact).max(), np.abs(want - exact).max()
    assert err <= 1.25 * err_want + 0.01, (err, err_want)
    other = PagedContext(cache.replace(kv_b={"g": stack[::-1]}), "g", jnp.asarray(1), jnp.bfloat16)
    assert np.abs(np.asarray(other.decode_in_place(*step, scale=Kh ** -0.5, interpret=True), np.float64)
                  - exact).max() > 0.5
