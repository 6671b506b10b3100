"""The paged latent cache read in place on a TPU: bytes one layer's cached-key attention moves per chip, XLA's
form (gathering each visit's pages) against the Pallas kernel (k2jax.ops.paged_mla), side by side, from the
TPU compiler on this host (libtpu, no TPU needed).

    python bench/paged_mla.py [--topology v5p:2x2x1] [--rows 64] [--context 8192] [--page 64]

Kimi K2's latent (R 512, P 64, 64 heads) at a decode step: `--rows` rows, one token each, every row holding
`--context` cached tokens. Bytes are per layer, per step, per chip:
- XLA: hlo.traffic of the compiled over_cache, its visit loop's body (a loop whose trip count is the step's
  longest row, unknown to the compiler) counted once per visit;
- kernel: what runs outside the kernel (hlo.traffic without the custom call) plus what the kernel's block
  specs DMA: the queries once per group, each row's pages once, the state out. The compiler's own per-operand
  figure for a kernel counts every operand whole (the whole pool), so it is not used;
- ideal: the rows' pages read once (as held: 640 values a token), the queries in and the state out.
"""

from __future__ import annotations

import argparse

from common import REPO  # noqa: F401  (puts the repo on sys.path)

import jax
import jax.numpy as jnp

from k2jax.aot import hlo
from k2jax.aot.topology import load_topology
from k2jax.ops.paged_mla import _LANES, BLOCKS, paged_mla
from k2jax.ops.ragged import DECODE_VISIT_KEYS, over_cache

R, P, N = 512, 64, 64
PAD = 64  # a TPU pool's tokens padded to 640 values (k2jax.runtime.cache.TPU_LANE), as the runtime holds them


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--topology", default="v5p:2x2x1")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--page", type=int, default=64)
    a = ap.parse_args()
    dev = load_topology(a.topology).devices[0]
    sh = jax.sharding.SingleDeviceSharding(dev)
    B, Y = a.rows, a.page
    W = -(-a.context // Y)
    A = B * W + 1

    def s(shape, dtype):
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sh)

    print(f"{a.topology}: {B} decode rows x {a.context} cached tokens, pages of {Y}; one layer, per chip")
    print(f"{'pool':>14} {'XLA form':>10} {'kernel':>10} {'ideal':>10} {'XLA/ideal':>10} {'kernel/ideal':>13}")
    for kv in ("bfloat16", "float8_e4m3fn"):
        quantized = kv != "bfloat16"
        args = (s((B, 1, N, R), "bfloat16"), s((B, 1, N, P), "bfloat16"), s((B,), "int32"), s((B,), "bool"),
                s((1, A, Y, R + P + PAD), kv), s((1, A, 2 * Y), "float32") if quantized else None, s((), "int32"),
                s((B, W), "int32"), s((B,), "int32"))
        page_bytes = Y * ((R + P + PAD) * jnp.dtype(kv).itemsize + (8 if quantized else 0))
        q_bytes = B * N * (R + P) * 2
        out_bytes = B * N * (R + 2 * _LANES) * 4
        ideal = B * W * page_bytes + q_bytes + B * N * (R + 2) * 4

        xla = jax.jit(lambda *x: over_cache(*x, R, PAD, jnp.bfloat16, DECODE_VISIT_KEYS)).lower(*args).compile()
        module = hlo.parse(xla.as_text())
        _, loops = hlo.executions(module)
        bodies = {lp.body for lp in loops}
        movers = hlo.traffic(module, top=10**9).top
        visits = -(-a.context // DECODE_VISIT_KEYS)
        xla_bytes = sum(b * t * (visits if name.split("/")[0] in bodies else 1) for name, _, b, t in movers)

        blocks = BLOCKS[a.topology.split(":")[0]]
        kern = jax.jit(lambda *x: paged_mla(*x, R, PAD, blocks=blocks)).lower(*args).compile()
        outside = sum(b * t for _, op, b, t in hlo.traffic(hlo.parse(kern.as_text()), top=10**9).top
                      if op != "custom-call")
        kern_bytes = outside + B * W * page_bytes + q_bytes + out_bytes
        gib = 2 ** 30
        print(f"{kv:>14} {xla_bytes / gib:9.3f}G {kern_bytes / gib:9.3f}G {ideal / gib:9.3f}G "
              f"{xla_bytes / ideal:9.2f}x {kern_bytes / ideal:12.2f}x")


if __name__ == "__main__":
    main()
