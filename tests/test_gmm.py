"""The quantized grouped matmul kernel (k2jax.ops.gmm): run in Pallas' interpreter on CPU against its plain
form (the whole stack dequantized, then ragged_dot), and compiled by the TPU compiler (Mosaic, with its
VMEM limits) for v5p and v6e, where it must read its weights once."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k2jax.aot import hlo
from k2jax.aot.topology import has_libtpu
from k2jax.ops.gmm import TILES, Tiles, fit_tiles, gmm, gmm_reference, visits
from k2jax.ops.quant import dequantize_weight, held_shapes, quantize_weight

SMALL = Tiles(tm=16, ti=256, tn=256, sub=128)  # several row, input and output tiles on small shapes


def _weight(fmt, E, I, O, seed=0):
    w = np.random.default_rng(seed).standard_normal((E, I, O)).astype(np.float32) * 0.05
    return jax.tree.map(jnp.asarray, quantize_weight(w, fmt, 1, 1))


def _stack(fmt, L, E, I, O, seed=0):
    """Every layer's experts [L, E, I, O]: plain float32, or quantized with two lead dims."""
    w = np.random.default_rng(seed).standard_normal((L, E, I, O)).astype(np.float32) * 0.05
    return jnp.asarray(w) if fmt == "plain" else jax.tree.map(jnp.asarray, quantize_weight(w, fmt, 1, 2))


def _plain(x, w, sizes):
    """Row by row in numpy float64: each row times its group's dequantized weight; rows past Σ sizes 0."""
    wd = np.asarray(dequantize_weight(w, jnp.float32) if hasattr(w, "fmt") else w, np.float64)
    x = np.asarray(x, np.float64)
    out = np.zeros((x.shape[0], wd.shape[-1]))
    row = 0
    for e, n in enumerate(np.asarray(sizes)):
        out[row:row + n] = x[row:row + n] @ wd[e]
        row += n
    return out


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
@pytest.mark.parametrize("sizes", [
    [7, 0, 20, 3, 6],      # a tile spanning groups, an empty group, rows past the sum in the last tile
    [0, 0, 5, 0, 0],       # one group, whole tiles past the sum (tail visits write zeros)
    [0, 0, 0, 0, 0],       # nothing routed here
    [40, 0, 0, 0, 0],      # one group filling every row
    [1, 1, 1, 1, 36],      # four one-row groups in one tile
])
def test_kernel_equals_the_plain_form_in_interpret_mode(fmt, sizes):
    E, I, O, M = 5, 512, 768, 40
    w = _weight(fmt, E, I, O)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((M, I)), jnp.float32)
    sizes = jnp.asarray(sizes, jnp.int32)
    y = gmm(x, w, sizes, tiles=SMALL, interpret=True)
    assert y.shape == (M, O) and y.dtype == jnp.float32
    want = _plain(x, w, sizes)
    np.testing.assert_allclose(np.asarray(y), want, atol=2e-5 * np.abs(want).max() + 1e-6)
    np.testing.assert_allclose(np.asarray(y), np.asarray(gmm_reference(x, w, sizes)), atol=1e-5, rtol=1e-5)
    # and in bf16 (the model's dtype), against the reference in bf16
    yb = gmm(x.astype(jnp.bfloat16), w, sizes, tiles=SMALL, interpret=True)
    rb = gmm_reference(x.astype(jnp.bfloat16), w, sizes)
    assert yb.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(yb, np.float32), np.asarray(rb, np.float32), atol=0.02 * np.abs(want).max())


@pytest.mark.parametrize("fmt", ["plain", "int4", "fp8"])
def test_a_layer_read_out_of_the_stack_equals_that_layers_own_weight(fmt):
    """Given every layer's stack and a traced layer index, the kernel reads that layer's tiles in place
    (index maps over the layer): the product equals the layer's own weight's, for plain weights too."""
    L, E, I, O, M = 3, 4, 256, 512, 24
    stack = _stack(fmt, L, E, I, O)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((M, I)), jnp.float32)
    sizes = jnp.asarray([5, 0, 12, 4], jnp.int32)
    run = jax.jit(lambda x, w, s, layer: gmm(x, w, s, layer=layer, tiles=SMALL, interpret=True))
    for layer in (0, 2):
        own = jax.tree.map(lambda a: a[layer], stack)
        y = run(x, stack, sizes, jnp.int32(layer))
        want = _plain(x, own, sizes)
        np.testing.assert_allclose(np.asarray(y), want, atol=2e-5 * np.abs(want).max() + 1e-6)
        ref = gmm_reference(x, stack, sizes, layer=jnp.int32(layer))
        np.testing.assert_allclose(np.asarray(ref), want, atol=2e-5 * np.abs(want).max() + 1e-6)
    # a plain weight of one layer runs through the kernel too
    y = gmm(x, own, sizes, tiles=SMALL, interpret=True)
    np.testing.assert_allclose(np.asarray(y), want, atol=2e-5 * np.abs(want).max() + 1e-6)


def test_odd_shapes_are_padded_not_refused():
    """Dims no tile divides (I 96 for int4, O 200): padded inside, the result sliced back."""
    w = _weight("int4", 3, 96, 200, seed=2)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((13, 96)), jnp.float32)
    sizes = jnp.asarray([4, 0, 8], jnp.int32)
    y = gmm(x, w, sizes, tiles=SMALL, interpret=True)
    np.testing.assert_allclose(np.asarray(y), _plain(x, w, sizes), atol=1e-4)


def test_visit_table():
    """Rows [0,7) group 0, [7,27) group 2, [27,30) group 3 in tiles of 8 over 48 rows: real visits (0,0),
    (2,0), (2,1), (2,2), (2,3), (3,3), then tail visits of tiles 4 and 5; spare entries repeat the last."""
    group, tile, x_tile, counts = visits(jnp.asarray([7, 0, 20, 3], jnp.int32), 48, 8)
    assert counts.tolist() == [6, 8]
    assert group.tolist()[:6] == [0, 2, 2, 2, 2, 3] and x_tile.tolist()[:6] == [0, 0, 1, 2, 3, 3]
    assert tile.tolist() == [0, 0, 1, 2, 3, 3, 4, 5, 5]
    assert x_tile.tolist()[6:] == [3, 3, 3]  # tail and spare visits read the last real visit's x tile


def test_fit_tiles_never_pads_kimi_k2_weights():
    for I, O in ((7168, 2048), (2048, 7168)):
        for fmt in ("int4", "fp8"):
            t = fit_tiles(TILES["v5p"], 384, I, O, fmt)
            assert I % t.ti == 0 and O % t.tn == 0 and t.ti % t.sub == 0 and t.tn % 256 == 0, (I, O, fmt, t)
            assert t.tm == 384


def test_rejects_what_it_cannot_run():
    w = _weight("int4", 2, 64, 256)
    with pytest.raises(ValueError, match="inputs"):
        gmm(jnp.zeros((4, 32)), w, jnp.asarray([2, 2]), interpret=True)
    plain = quantize_weight(np.zeros((64, 256), np.float32), "int4")  # no expert axis
    with pytest.raises(ValueError, match=r"\[E, I, O\]"):
        gmm(jnp.zeros((4, 64)), plain, jnp.asarray([2, 2]), interpret=True)
    with pytest.raises(ValueError, match=r"\[L, E, I, O\] \(with a layer\)"):  # a layer needs a stack
        gmm(jnp.zeros((4, 64)), w, jnp.asarray([2, 2]), layer=jnp.int32(0), interpret=True)


# --- compiled for TPUs by libtpu (Mosaic enforces the scoped VMEM limit) --------------------------------------

needs_libtpu = pytest.mark.skipif(not has_libtpu() and os.environ.get("K2JAX_REQUIRE_TPU_AOT") != "1",
                                  reason="libtpu is not installed (pip install 'k2jax[tpu-aot]')")


def _compile(topology, fmt, M, I, O, E=6, L=None):
    """(traffic, the ideal bytes: one layer's weights and the rows in and out, parsed HLO) of gmm compiled
    for `topology`; with L, over every layer's stack [L, E, I, O] and a layer index."""
    from k2jax.aot.topology import load_topology

    dev = load_topology(topology).devices[0]
    sh = jax.sharding.SingleDeviceSharding(dev)
    shape = (E, I, O) if L is None else (L, E, I, O)
    held = (jax.ShapeDtypeStruct(shape, jnp.bfloat16) if fmt == "plain"
            else held_shapes(shape, fmt, 1, 1 if L is None else 2))
    w = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), held)
    x = jax.ShapeDtypeStruct((M, I), jnp.bfloat16, sharding=sh)
    sizes = jax.ShapeDtypeStruct((E,), jnp.int32, sharding=sh)
    layer = jax.ShapeDtypeStruct((), jnp.int32, sharding=sh)
    tiles = TILES[topology.split(":")[0]]
    fn = jax.jit(lambda x, w, s, layer: gmm(x, w, s, layer=None if L is None else layer, tiles=tiles))
    module = hlo.parse(fn.lower(x, w, sizes, layer).compile().as_text())
    weights = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(w)) // (L or 1)
    return hlo.traffic(module), weights + M * (I + O) * 2, module  # + the rows in and out, bf16


@needs_libtpu
@pytest.mark.parametrize("topology", ["v5p:2x2x1", "v6e:2x2"])
@pytest.mark.parametrize("fmt,bound", [("int4", 1.09), ("fp8", 1.09)])
def test_compiles_for_tpus_and_reads_the_weights_once(topology, fmt, bound):
    """Kimi K2's six local experts per chip on expert=64 (7168 x 2048 gate, 2048 x 7168 down) at a decode
    batch's rows: the compiled program moves about its arguments' bytes, the packed weights and the rows in
    and out (the kernel by its own estimate, which counts the rows read again for each output tile: 8% at
    384 rows of int4 down; fp8: plus its scales spread over the columns, 1/32 of the values, written then
    read), where XLA's dequantize-then-ragged_dot moves several times them."""
    for M, I, O in ((64, 7168, 2048), (384, 2048, 7168)):
        moved, ideal, _ = _compile(topology, fmt, M, I, O)
        assert moved.bytes <= bound * ideal, (topology, fmt, M, I, O, moved.bytes / ideal)


@needs_libtpu
@pytest.mark.parametrize("topology", ["v5p:2x2x1", "v6e:2x2"])
@pytest.mark.parametrize("fmt", ["plain", "int4", "fp8"])
def test_a_layer_of_the_stack_is_read_in_place_on_tpus(topology, fmt):
    """Kimi K2's 60 MoE layers' six local experts as the params hold them, [60, 6, 7168, 2048], and a traced
    layer: nothing outside the kernel holds a layer's weights (XLA:TPU would copy a slice of the stack into a
    buffer of its own: 168 MiB per matrix in bf16, written and read again every layer and step), and the
    program moves about one layer's weights and the rows."""
    M, I, O = 64, 7168, 2048
    moved, ideal, module = _compile(topology, fmt, M, I, O, L=60)
    layer_bytes = ideal - M * (I + O) * 2
    big = [(i.name, i.op, sum(a.nbytes for a in i.shapes)) for c in module.computations.values()
           for i in c.instructions.values() if i.op not in ("parameter", "custom-call", "get-tuple-element",
                                                             "tuple", "bitcast")
           and sum(a.nbytes for a in i.shapes) >= layer_bytes // 8]
    assert not big, big
    assert moved.bytes <= 1.1 * ideal, (topology, fmt, moved.bytes / ideal)
