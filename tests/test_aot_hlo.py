"""Reading optimized HLO text (k2jax.aot.hlo): shapes and tiled layouts, loops and their trip counts, the
collectives with their bytes, and which buffers are a weight's data. On hand-written modules in the TPU
compiler's text form (no TPU needed), and on programs XLA:CPU compiles here."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k2jax.aot import hlo

# A layer loop of 60 trips (counter from 0, condition `i < 60`) holding a loop whose trip count is a loop
# value (known at run time only), each body with collectives; a weight (parameter 0, uint8 int4 values and
# parameter 1, its scales) sliced per layer and dequantized in a fusion, and tokens (parameter 2).
MODULE = """HloModule jit_step, entry_computation_layout={(u8[60,24,7168,1024]{3,2,1,0:T(32,128)(4,1)}, bf16[60,24,224,2048]{3,2,1,0:T(8,128)(2,1)}, bf16[16,7168]{1,0:T(8,128)(2,1)}, bf16[60,2049,64,576]{3,2,1,0:T(8,128)(2,1)})->bf16[16,7168]{1,0:T(8,128)(2,1)}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%dequant (p0: u8[24,7168,1024], p1: bf16[24,224,2048]) -> bf16[24,7168,2048] {
  %p0 = u8[24,7168,1024]{2,1,0} parameter(0)
  %p1 = bf16[24,224,2048]{2,1,0} parameter(1)
  %c = bf16[24,7168,1024]{2,1,0} convert(%p0)
  %r = bf16[24,7168,2048]{2,1,0} concatenate(%c, %c), dimensions={2}
  %b = bf16[24,7168,2048]{2,1,0} broadcast(%p1), dimensions={0,1,2}
  ROOT %m = bf16[24,7168,2048]{2,1,0} multiply(%r, %b)
}

%inner_cond (q: (s32[], s32[], bf16[16,7168])) -> pred[] {
  %q = (s32[], s32[], bf16[16,7168]) parameter(0)
  %i = s32[] get-tuple-element(%q), index=0
  %n = s32[] get-tuple-element(%q), index=1
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%inner_body (q: (s32[], s32[], bf16[16,7168])) -> (s32[], s32[], bf16[16,7168]) {
  %q = (s32[], s32[], bf16[16,7168]) parameter(0)
  %i = s32[] get-tuple-element(%q), index=0
  %n = s32[] get-tuple-element(%q), index=1
  %x = bf16[16,7168]{1,0} get-tuple-element(%q), index=2
  %a2a = bf16[16,7168]{1,0} all-to-all(%x), channel_id=3, replica_groups=[1,16]<=[16], dimensions={0}
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  ROOT %t = (s32[], s32[], bf16[16,7168]) tuple(%j, %n, %a2a)
}

%layer_cond (p: (s32[], u8[60,24,7168,1024], bf16[60,24,224,2048], bf16[16,7168])) -> pred[] {
  %p = (s32[], u8[60,24,7168,1024], bf16[60,24,224,2048], bf16[16,7168]) parameter(0)
  %k = s32[] constant(60)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %lt = pred[] compare(%i, %k), direction=LT
}

%layer_body (p: (s32[], u8[60,24,7168,1024], bf16[60,24,224,2048], bf16[16,7168])) -> (s32[], u8[60,24,7168,1024], bf16[60,24,224,2048], bf16[16,7168]) {
  %p = (s32[], u8[60,24,7168,1024], bf16[60,24,224,2048], bf16[16,7168]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %w = u8[60,24,7168,1024]{3,2,1,0} get-tuple-element(%p), index=1
  %s = bf16[60,24,224,2048]{3,2,1,0} get-tuple-element(%p), index=2
  %x = bf16[16,7168]{1,0} get-tuple-element(%p), index=3
  %zero = s32[] constant(0)
  %wl = u8[1,24,7168,1024]{3,2,1,0} dynamic-slice(%w, %i, %zero, %zero, %zero), dynamic_slice_sizes={1,24,7168,1024}
  %sl = bf16[1,24,224,2048]{3,2,1,0} dynamic-slice(%s, %i, %zero, %zero, %zero), dynamic_slice_sizes={1,24,224,2048}
  %wb = u8[24,7168,1024]{2,1,0} bitcast(%wl)
  %sb = bf16[24,224,2048]{2,1,0} bitcast(%sl)
  %deq = bf16[24,7168,2048]{2,1,0} fusion(%wb, %sb), kind=kLoop, calls=%dequant
  %ag = bf16[256,7168]{1,0} all-gather(%x), channel_id=1, replica_groups=[1,16]<=[16], dimensions={0}
  %ar = f32[16,7168]{1,0} all-reduce(%x), channel_id=2, replica_groups=mesh['expert'=16] {'expert'}, use_global_device_ids=true, to_apply=%add
  %bad = bf16[24,7168,2048]{2,1,0} all-reduce(%deq), channel_id=4, replica_groups={}, to_apply=%add
  %rounds = s32[] constant(3)
  %init = (s32[], s32[], bf16[16,7168]) tuple(%zero, %rounds, %x)
  %loop = (s32[], s32[], bf16[16,7168]) while(%init), condition=%inner_cond, body=%inner_body
  %y = bf16[16,7168]{1,0} get-tuple-element(%loop), index=2
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  ROOT %t = (s32[], u8[60,24,7168,1024], bf16[60,24,224,2048], bf16[16,7168]) tuple(%j, %w, %s, %y)
}

ENTRY %main (w: u8[60,24,7168,1024], s: bf16[60,24,224,2048], x: bf16[16,7168], pool: bf16[60,2049,64,576]) -> bf16[16,7168] {
  %w = u8[60,24,7168,1024]{3,2,1,0:T(32,128)(4,1)} parameter(0)
  %s = bf16[60,24,224,2048]{3,2,1,0:T(8,128)(2,1)} parameter(1)
  %x = bf16[16,7168]{1,0:T(8,128)(2,1)} parameter(2)
  %pool = bf16[60,2049,64,576]{3,2,1,0:T(8,128)(2,1)} parameter(3)
  %zero = s32[] constant(0)
  %init = (s32[], u8[60,24,7168,1024], bf16[60,24,224,2048], bf16[16,7168]) tuple(%zero, %w, %s, %x)
  %layers = (s32[], u8[60,24,7168,1024], bf16[60,24,224,2048], bf16[16,7168]) while(%init), condition=%layer_cond, body=%layer_body
  %copy = bf16[60,2049,64,576]{1,3,2,0} copy(%pool)
  ROOT %out = bf16[16,7168]{1,0} get-tuple-element(%layers), index=3
}
"""


@pytest.fixture(scope="module")
def module():
    return hlo.parse(MODULE)


def test_shapes_layouts_and_tile_padding():
    a = hlo.parse_array("bf16[60,2049,64,576]{3,2,1,0:T(8,128)(2,1)}")
    assert a.dims == (60, 2049, 64, 576) and a.minor_to_major == (3, 2, 1, 0) and a.tiles == ((8, 128), (2, 1))
    assert a.nbytes == 60 * 2049 * 64 * 576 * 2
    assert a.padded_bytes == 60 * 2049 * 64 * 640 * 2  # the minor dim in 128-wide tiles: 576 -> 640
    # the same array laid out pages-minor: 2049 -> 2176 pages, 576 a multiple of 8
    b = hlo.parse_array("bf16[60,2049,64,576]{1,3,2,0:T(8,128)(2,1)}")
    assert b.padded_bytes == 60 * 2176 * 64 * 576 * 2
    assert hlo.parse_array("pred[1,163840]{1,0:T(4,128)(4,1)}").padded_bytes == 4 * 163840
    assert hlo.parse_array("bf16[7168]{0:T(1024)(128)(2,1)}").padded_bytes == 7168 * 2
    assert hlo.parse_array("f32[3]").padded_bytes == 12  # no layout: as is


def test_entry_parameters_loops_and_trip_counts(module):
    assert module.entry == "main"
    assert [str(a) for a in module.params()] == ["u8[60,24,7168,1024]", "bf16[60,24,224,2048]", "bf16[16,7168]",
                                                  "bf16[60,2049,64,576]"]
    runs, loops = hlo.executions(module)
    assert {(lp.name, lp.trips) for lp in loops} == {("layers", 60), ("loop", None)}
    assert runs["layer_body"] == 60 and runs["inner_body"] == 60  # a run-time trip count: counted once
    assert "add" not in runs  # a reducer is no computation that runs per se


def test_collectives_by_kind_with_bytes_and_runs(module):
    summary = hlo.collective_summary(module)
    assert summary["all-gather"] == {"ops": 1, "runs": 60, "bytes": 60 * 256 * 7168 * 2}
    assert summary["all-reduce"] == {"ops": 2, "runs": 120, "bytes": 60 * (16 * 7168 * 4 + 24 * 7168 * 2048 * 2)}
    assert summary["all-to-all"] == {"ops": 1, "runs": 60, "bytes": 60 * 16 * 7168 * 2}
    groups = {c.name: c.groups for c in hlo.collectives(module)}
    assert groups["ar"] == "mesh['expert'=16] {'expert'}" and groups["ag"] == "[1,16]<=[16]"


def test_provenance_follows_weights_through_loops_slices_and_fusions(module):
    prov = hlo.Provenance(module, {0, 1})
    assert prov.of("layer_body", "wl") == {0}
    assert prov.of("layer_body", "deq") == {0, 1}  # a dequantization: values and scales, nothing else
    assert prov.of("layer_body", "ag") == frozenset()  # tokens
    assert prov.of("layer_body", "bad") == {0, 1}  # an all-reduce of a weight's data
    assert prov.of("inner_body", "a2a") == frozenset()
    assert prov.of("main", "copy") == frozenset()  # the pool is not one of the weights asked about
    assert hlo.Provenance(module, {3}).of("main", "copy") == {3}
    big = {(c, i) for c, i, _ in hlo.large_float_buffers(module, 100_000_000)}
    assert ("layer_body", "deq") in big and ("main", "copy") in big
    assert ("layer_body", "deq") not in {(c, i) for c, i, _ in hlo.large_float_buffers(
        module, 100_000_000, exclude=[hlo.parse_array("bf16[24,7168,2048]")])}
    # what a fusion computes is no buffer of its own
    assert "dequant" in hlo.fused_computations(module)
    assert not any(c == "dequant" for c, _, _ in hlo.large_float_buffers(module, 1))


def test_on_a_program_xla_compiles_here():
    """XLA:CPU's optimized HLO of a scan over stacked int8 weights, dequantized per layer (the data of the
    weights) and multiplied with tokens (not their data): the parser finds the loop's trip count, and the
    provenance tells the weight's dequantized copy from the matmul's result."""
    L, D, F = 5, 64, 256

    def step(w_LDF, s_LF, x_BD):
        def layer(x, ws):
            w, s = ws
            deq = w.astype(jnp.float32) * s[None, :]  # a dequantized copy of one layer
            return jnp.tanh(x @ deq)[:, :D], None
        return jax.lax.scan(layer, x_BD, (w_LDF, s_LF))[0]

    args = (jax.ShapeDtypeStruct((L, D, F), jnp.int8), jax.ShapeDtypeStruct((L, F), jnp.float32),
            jax.ShapeDtypeStruct((8, D), jnp.float32))
    text = jax.jit(step).lower(*args).compile().as_text()
    module = hlo.parse(text)
    _, loops = hlo.executions(module)
    assert [lp.trips for lp in loops] == [L]
    prov = hlo.Provenance(module, {0, 1})
    comps = module.computations
    weighty = [(c, i.op) for c, comp in comps.items() for i in comp.instructions.values()
               if i.op not in ("parameter", "get-tuple-element", "tuple") and prov.of(c, i.name)
               and any(a.dtype == "f32" and a.elements >= D * F for a in i.shapes)]
    assert weighty, text  # the per-layer dequantized weight is found as weight data ...
    dots = [(c, i.name) for c, comp in comps.items() for i in comp.instructions.values() if i.op == "dot"]
    assert dots and not any(prov.of(c, n) for c, n in dots)  # ... and a matmul with tokens is not
    np.testing.assert_equal(len(module.params()), 3)


# A loop of 3 trips: a fusion slicing one layer out of a weight stack [4, 64, 128] for a dot with 8 rows, and a
# fusion writing its result in place into a cache [16, 8, 128] (dynamic-update-slice).
LOOP = """HloModule m, entry_computation_layout={(bf16[4,64,128]{2,1,0}, bf16[8,64]{1,0}, f32[16,8,128]{2,1,0})->f32[16,8,128]{2,1,0}}

%fdot (p0: bf16[4,64,128], p1: s32[], p2: bf16[8,64]) -> f32[8,128] {
  %p0 = bf16[4,64,128]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %p2 = bf16[8,64]{1,0} parameter(2)
  %z = s32[] constant(0)
  %ds = bf16[1,64,128]{2,1,0} dynamic-slice(%p0, %p1, %z, %z), dynamic_slice_sizes={1,64,128}
  %w = bf16[64,128]{1,0} bitcast(%ds)
  ROOT %d = f32[8,128]{1,0} dot(%p2, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fupd (c0: f32[16,8,128], c1: f32[8,128], c2: s32[]) -> f32[16,8,128] {
  %c0 = f32[16,8,128]{2,1,0} parameter(0)
  %c1 = f32[8,128]{1,0} parameter(1)
  %c2 = s32[] parameter(2)
  %u = f32[1,8,128]{2,1,0} bitcast(%c1)
  %z = s32[] constant(0)
  ROOT %dus = f32[16,8,128]{2,1,0} dynamic-update-slice(%c0, %u, %c2, %z, %z)
}

%cond (p: (s32[], bf16[4,64,128], bf16[8,64], f32[16,8,128])) -> pred[] {
  %p = (s32[], bf16[4,64,128], bf16[8,64], f32[16,8,128]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %k = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %k), direction=LT
}

%body (p: (s32[], bf16[4,64,128], bf16[8,64], f32[16,8,128])) -> (s32[], bf16[4,64,128], bf16[8,64], f32[16,8,128]) {
  %p = (s32[], bf16[4,64,128], bf16[8,64], f32[16,8,128]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %w = bf16[4,64,128]{2,1,0} get-tuple-element(%p), index=1
  %x = bf16[8,64]{1,0} get-tuple-element(%p), index=2
  %c = f32[16,8,128]{2,1,0} get-tuple-element(%p), index=3
  %y = f32[8,128]{1,0} fusion(%w, %i, %x), kind=kOutput, calls=%fdot
  %c2 = f32[16,8,128]{2,1,0} fusion(%c, %y, %i), kind=kLoop, calls=%fupd
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  ROOT %t = (s32[], bf16[4,64,128], bf16[8,64], f32[16,8,128]) tuple(%j, %w, %x, %c2)
}

ENTRY %main (w: bf16[4,64,128], x: bf16[8,64], c: f32[16,8,128]) -> f32[16,8,128] {
  %w = bf16[4,64,128]{2,1,0} parameter(0)
  %x = bf16[8,64]{1,0} parameter(1)
  %c = f32[16,8,128]{2,1,0} parameter(2)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[4,64,128], bf16[8,64], f32[16,8,128]) tuple(%zero, %w, %x, %c)
  %loop = (s32[], bf16[4,64,128], bf16[8,64], f32[16,8,128]) while(%init), condition=%cond, body=%body
  ROOT %out = f32[16,8,128]{2,1,0} get-tuple-element(%loop), index=3
}
"""


def test_traffic_counts_loop_bodies_by_trips_slices_read_and_updates_in_place():
    moved = hlo.traffic(hlo.parse(LOOP))
    # per trip, by hand: the dot's fusion reads one layer (64 x 128 bf16, not the stack), the index and x
    # (8 x 64 bf16) and writes 8 x 128 f32; the update's fusion reads its update and index and writes the
    # update alone (the cache itself is updated in place); the counter's add reads 2 and writes 1 int32
    dot = 64 * 128 * 2 + 4 + 8 * 64 * 2 + 8 * 128 * 4
    update = 8 * 128 * 4 + 4 + 8 * 128 * 4
    assert moved.bytes == 3 * (dot + update + 3 * 4)
    assert moved.flops == 3 * 2 * 8 * 128 * 64
    assert moved.top[0][1:] == ("fusion", dot, 3)


def test_traffic_follows_a_weight_into_a_nested_fusion_that_slices_it():
    """The dot's fusion takes the whole stack and hands it, with the layer index, to a nested fusion that
    slices one layer out (how XLA:TPU fuses a scanned weight's slice into a dot): one layer is read, as when
    the slice sits in the dot's fusion itself, not the stack."""
    nested = LOOP.replace("""  %z = s32[] constant(0)
  %ds = bf16[1,64,128]{2,1,0} dynamic-slice(%p0, %p1, %z, %z), dynamic_slice_sizes={1,64,128}
  %w = bf16[64,128]{1,0} bitcast(%ds)
  ROOT %d""", """  %w = bf16[64,128]{1,0} fusion(%p0, %p1), kind=kLoop, calls=%fslice
  ROOT %d""").replace("%fdot (", """%fslice (s0: bf16[4,64,128], s1: s32[]) -> bf16[64,128] {
  %s0 = bf16[4,64,128]{2,1,0} parameter(0)
  %s1 = s32[] parameter(1)
  %z = s32[] constant(0)
  %ds = bf16[1,64,128]{2,1,0} dynamic-slice(%s0, %s1, %z, %z), dynamic_slice_sizes={1,64,128}
  ROOT %w = bf16[64,128]{1,0} bitcast(%ds)
}

%fdot (""")
    assert "calls=%fslice" in nested
    assert hlo.traffic(hlo.parse(nested)).bytes == hlo.traffic(hlo.parse(LOOP)).bytes


OFFLOAD = """HloModule m, entry_computation_layout={(bf16[4096,640]{1,0}, s32[128]{0}, bf16[16,640]{1,0}, s32[16]{0})->(bf16[128,640]{1,0}, bf16[4096,640]{1,0})}

%gathered (g0: bf16[4096,640], g1: s32[128]) -> bf16[128,640] {
  %g0 = bf16[4096,640]{1,0} parameter(0)
  %g1 = s32[128]{0} parameter(1)
  %gs = (bf16[4096,640]{1,0}, s32[128]{0}, bf16[128,640]{1,0}, u32[]) call-start(%g0, %g1), async_execution_thread="sparsecore", to_apply=%g
  ROOT %gd = bf16[128,640]{1,0} call-done(%gs)
}

ENTRY %main (pool: bf16[4096,640], ids: s32[128], upd: bf16[16,640], at: s32[16]) -> (bf16[128,640], bf16[4096,640]) {
  %pool = bf16[4096,640]{1,0} parameter(0)
  %ids = s32[128]{0} parameter(1)
  %upd = bf16[16,640]{1,0} parameter(2)
  %at = s32[16]{0} parameter(3)
  %gather_offload_async_start = ((), (), (s32[1]{0})) call-start(), async_execution_thread="sparsecore", to_apply=%gathered
  %gather_offload_async_start.update = ((bf16[4096,640]{1,0}, s32[128]{0}), bf16[128,640]{1,0}) call-update(%gather_offload_async_start, %pool, %ids)
  %gather_offload_async_done = bf16[128,640]{1,0} call-done(%gather_offload_async_start.update)
  %scatter_offload_async_start = ((), (), (s32[1]{0})) call-start(), async_execution_thread="sparsecore", to_apply=%gathered
  %scatter_offload_async_start.update = ((bf16[4096,640]{1,0}, s32[16]{0}, bf16[16,640]{1,0}), bf16[4096,640]{1,0}) call-update(%scatter_offload_async_start, %pool, %at, %upd)
  %scatter_offload_async_done = bf16[4096,640]{1,0} call-done(%scatter_offload_async_start.update)
  ROOT %t = (bf16[128,640]{1,0}, bf16[4096,640]{1,0}) tuple(%gather_offload_async_done, %scatter_offload_async_done)
}
"""


def test_traffic_counts_sparsecore_gathers_and_scatters_by_the_rows_they_move():
    """XLA:TPU's SparseCore offloads list the whole table among their operands: a gather of 128 pages' rows
    out of a 4096-row pool moves those rows (read and written), a scatter of 16 rows into it its 16 rows, and
    the call-dones (bookkeeping) nothing; the tiny call-starts count their few bytes."""
    moved = hlo.traffic(hlo.parse(OFFLOAD))
    rows = 128 * 640 * 2 * 2 + 16 * 640 * 2 * 2
    assert rows <= moved.bytes <= rows + 64, moved.top
    assert moved.bytes < 4096 * 640 * 2  # not the pool


def test_step_model_by_hand():
    """A decode step of 64 rows on v5p chips: moves 60 GiB, 2 TFLOP, 1 GiB of collectives, arguments 20 GiB."""
    from k2jax.aot.compile import Result
    from k2jax.aot.report import step_model
    from k2jax.plan import CHIPS, GiB
    from k2jax.runtime.runner import StepShape

    r = Result("decode", StepShape(64, 1, 128, 128), argument_bytes=20 * GiB, moved_bytes=60 * GiB, flops=2e12,
               model_flops=64 * 2 * 32e9, collectives={"all-reduce": {"ops": 2, "runs": 120, "bytes": GiB}})
    v5p = CHIPS["v5p"]
    m = step_model(r, v5p, 64)
    hbm, peak, ici = 2765e9, 459e12, 1200e9
    assert v5p.hbm_bandwidth == hbm and v5p.bf16_flops == peak and v5p.ici_bandwidth == ici
    step = max(60 * GiB / hbm, 2e12 / peak) + GiB / ici  # memory-bound: 23.3 ms + 0.9 ms
    assert m["seconds"] == pytest.approx(step)
    assert m["moved_over_arguments"] == pytest.approx(3.0)
    assert m["ideal_seconds"] == pytest.approx(max(20 * GiB / hbm, 64 * 2 * 32e9 / 64 / peak))
    assert m["tokens_per_second"] == pytest.approx(64 / step)
    assert m["tokens_per_second_per_chip"] == pytest.approx(1 / step)
    assert m["mfu"] == pytest.approx(64 * 2 * 32e9 / (step * 64 * peak))
    assert step_model(Result("x", r.shape, error="refused"), v5p, 64) is None


PREFETCH = """HloModule m, entry_computation_layout={(bf16[64,128]{1,0})->bf16[64,128]{1,0}}

ENTRY %main (w: bf16[64,128]) -> bf16[64,128] {
  %w = bf16[64,128]{1,0} parameter(0)
  %cs = (bf16[64,128]{1,0:S(1)}, bf16[64,128]{1,0}, u32[]{:S(2)}) copy-start(%w)
  %cd = bf16[64,128]{1,0:S(1)} copy-done(%cs)
  ROOT %n = bf16[64,128]{1,0} negate(%cd)
}
"""


def test_traffic_counts_an_async_copy_once_read_and_once_written():
    """XLA:TPU prefetches a weight with copy-start/copy-done, whose result tuple lists the destination and
    the operand itself: the copy reads the weight and writes it once (not the operand a second time), and
    the negate reads the copy and writes its own result."""
    moved = hlo.traffic(hlo.parse(PREFETCH), top=5)
    w = 64 * 128 * 2
    by_op = {op: b for _, op, b, _ in moved.top}
    assert by_op["copy-start"] == 2 * w + 4, moved.top  # + the u32 context
    assert moved.bytes == 4 * w + 4
