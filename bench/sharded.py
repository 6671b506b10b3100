"""Expert-parallel MoE on 8 simulated CPU devices against the same MoE on 1 device (bench config, bf16):
prefill (1 x 512) and a decode-sized batch (64 x 1), each exchange mode, with the bytes each device sends per
MoE layer against the minimum (tokens x k x hidden x dtype / devices, one way). A top-2 variant of the config
shows the case n > K (expert devices > top-k, as on real slices), where the all-to-all sends less.

    python bench/sharded.py [--mesh expert=8] [--repeats 5]

Simulated devices share this machine's cores and "send" by memcpy, so the times say more about overheads
(sorting, index tables, rounds) than about a real interconnect; the byte counts are what a slice would move.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from common import median, time_fn  # noqa: E402

from k2jax.config import K2Config  # noqa: E402
from k2jax.ops.expert_parallel import moe_expert_parallel  # noqa: E402
from k2jax.nn.moe import route  # noqa: E402
from k2jax.ops.moe import moe_grouped  # noqa: E402
from k2jax.sharding import make_mesh, use_mesh  # noqa: E402

CONFIG = pathlib.Path(__file__).resolve().parents[1] / "configs" / "bench.json"
CAPACITY = 1.25  # moe_expert_parallel's default capacity_factor


def timed(fn, *args, repeats):
    return median(time_fn(fn, *args, repeats=repeats))


def sent_bytes(mode, idx, E, n, t, K, D, itemsize):
    """(dispatch, combine) bytes one device sends per MoE layer over the expert axis."""
    c = max(1, min(t, math.ceil(CAPACITY * t * K / n)))
    if mode == "gather":  # all_gather of t rows + ids/weights to n-1 peers; psum_scatter of [n t, D] f32
        return (n - 1) * t * (D * itemsize + K * 8), (n - 1) * t * D * 4
    dest = idx // (E // n)
    rounds = 0
    for g in range(idx.shape[0] // t):  # one token group per device
        hits = (dest[g * t:(g + 1) * t, :, None] == np.arange(n)).any(1)
        rounds = max(rounds, math.ceil(hits.sum(0).max() / c))
    return rounds * (n - 1) * c * (D * itemsize + K * 8), rounds * (n - 1) * c * D * itemsize


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mesh", default="expert=8")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    mesh = make_mesh(args.mesh)
    n = mesh.shape["expert"]
    groups = mesh.shape["data"] * mesh.shape["fsdp"] * n
    base = K2Config.from_hf_config(CONFIG)
    E, D, F, dt = base.n_routed_experts, base.hidden_size, base.moe_intermediate_size, jnp.bfloat16
    k1, k2, k3, k4, k5 = jax.random.split(jax.random.PRNGKey(0), 5)
    w = (jax.random.normal(k1, (E, D, F), dt) / D**0.5, jax.random.normal(k2, (E, D, F), dt) / D**0.5,
         jax.random.normal(k3, (E, F, D), dt) / F**0.5)
    ws = tuple(jax.device_put(a, NamedSharding(mesh, s)) for a, s in
               zip(w, (P("expert", None, "tensor"), P("expert", None, "tensor"), P("expert", "tensor", None))))
    router = jax.random.normal(k4, (D, E)) / D**0.5
    one = jax.jit(lambda *a: moe_grouped(*a, impl="tiled"))
    print(f"bench config: D={D}, E={E}, F={F}, bf16; mesh {args.mesh} ({len(jax.devices())} simulated CPU "
          f"devices) vs 1 device; median of {args.repeats}")
    print(f"{'K':>2} {'batch':>6} {'mode':>10} {'ms':>8} {'1-dev ms':>9} {'1dev/ep':>7} {'sent out':>10} "
          f"{'back':>10} {'minimum':>10} {'out/min':>7}")
    for K in (base.num_experts_per_tok, 2):
        cfg = base.replace(num_experts_per_tok=K)
        for B, T in ((1, 512), (64, 1)):
            x = jax.random.normal(k5, (B * T, D), dt)
            idx, wt = route(x.astype(jnp.float32) @ router, jnp.zeros(E), cfg)
            t_one = timed(one, x, idx, wt, *w, repeats=args.repeats)
            t = -(-B * T // groups)
            minimum = B * T * K * D * 2 / groups
            for mode in ("gather", "all_to_all"):
                with use_mesh(mesh):
                    t_ep = timed(jax.jit(lambda *a: moe_expert_parallel(*a, mode=mode)), x, idx, wt, *ws,
                                 repeats=args.repeats)
                out, back = sent_bytes(mode, np.asarray(idx), E, n, t, K, D, 2)
                print(f"{K:>2} {f'{B}x{T}':>6} {mode:>10} {t_ep * 1e3:8.1f} {t_one * 1e3:9.1f} {t_one / t_ep:7.2f} "
                      f"{out / 2**10:6.0f} KiB {back / 2**10:6.0f} KiB {minimum / 2**10:6.0f} KiB "
                      f"{out / minimum:7.2f}")


if __name__ == "__main__":
    main()
