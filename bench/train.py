"""Train step of configs/bench.json: tokens/s, achieved FLOP/s against the measured matmul peak, and memory
per remat policy.

    python bench/train.py [--batch 4] [--tokens 512] [--steps 2] [--dtype bfloat16] [--master]
                          [--remat none,save_matmuls,full] [--moe-impl auto]

Random params in --dtype (with --master: float32 params, cast to --dtype inside the step, so the optimizer
updates float32 master weights); default AdamW. Model FLOPs per step = 3 × the forward's matmul FLOPs
(forward + backward, bench/common.py's forward_flops); recomputation under remat is not counted as useful
work.

Each policy runs in a fresh interpreter (this script with --child), so its memory figures are its own:
  - XLA's compiled memory analysis of the jitted step: arguments, outputs, aliased (donated) bytes, and temp
    bytes, the activations kept for the backward pass plus workspace. Params, gradients and Adam state are
    in arguments/outputs/temp whatever the policy, so activations show only once the token count is large
    enough (at 1 × 128 tokens all policies compile to the same temp bytes).
  - the measured peak RSS (VmHWM) of the child while it runs the steps (reset after compile, so compilation
    is excluded), and how far it rose above the RSS before the first step; on GPU/TPU also the device's
    peak_bytes_in_use.
Times are wall-clock (achieved FLOP/s and tokens/s use them); CPU seconds per step are printed too, since
wall time on a shared machine depends on what else runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from common import REPO, forward_flops, matmul_peak, median  # noqa: I001

from k2jax import K2Config, K2Model, init_params
from k2jax.nn.model import REMAT_POLICIES
from k2jax.train import make_train_step

MiB = 2**20


def _status_kib(key: str) -> int:
    """A field of /proc/self/status in KiB (VmRSS: now, VmHWM: peak since start or the last reset)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def _reset_peak() -> bool:
    """Restart VmHWM from the current RSS (Linux clear_refs 5); False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def child(args, cfg, dtype) -> dict:
    """Compile and run one policy's train step here -> the figures as a dict (bytes, seconds)."""
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (args.batch, args.tokens)), jnp.int32)
    batch = {"tokens": tokens}
    params = init_params(cfg, param_dtype=jnp.float32 if args.master else dtype)
    step = make_train_step(K2Model(cfg, dtype, args.moe_impl, args.child))
    opt_state = step.init(params)
    compiled = step.fn.lower(params, opt_state, batch).compile()
    m = compiled.memory_analysis()
    out = {k: float(getattr(m, f"{k}_size_in_bytes")) if m is not None else math.nan
           for k in ("argument", "output", "alias", "temp")}
    out["reset"] = _reset_peak()
    out["rss_before"] = _status_kib("VmRSS") * 1024.0
    walls, cpus = [], []
    for _ in range(1 + args.steps):  # the first step is a warm-up, not timed
        t, c = time.perf_counter(), time.process_time()
        params, opt_state, metrics = jax.block_until_ready(compiled(params, opt_state, batch))
        walls.append(time.perf_counter() - t)
        cpus.append(time.process_time() - c)
    out["rss_peak"] = _status_kib("VmHWM") * 1024.0
    stats = jax.devices()[0].memory_stats() or {}
    out["device_peak"] = float(stats.get("peak_bytes_in_use", math.nan))
    out["wall"], out["cpu"] = median(walls[1:]), median(cpus[1:])
    out["loss"] = float(metrics["loss"])
    return out


def run_child(argv: list[str], remat: str) -> dict:
    """This script with --child `remat` in a fresh interpreter (a forked child's peak would start from
    ours) -> its figures."""
    p = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--child", remat],
                       capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"remat={remat}: child failed with status {p.returncode}:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _ratio(x: float, base: float | None) -> str:
    ok = base is not None and base > 0 and math.isfinite(x) and math.isfinite(base)
    return f"{x / base:.2f}x" if ok else "-"


def _memory(x: dict) -> dict:
    """The compared figures of one policy, bytes."""
    return {"temp": x["temp"], "total": x["argument"] + x["output"] + x["temp"] - x["alias"],
            "rss_peak": x["rss_peak"], "rise": x["rss_peak"] - x["rss_before"], "device_peak": x["device_peak"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=f"{REPO}/configs/bench.json")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--steps", type=int, default=2, help="timed steps per policy (after one warm-up step)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--master", action="store_true", help="float32 master params, compute in --dtype")
    ap.add_argument("--remat", default="none,save_matmuls,full", help=f"comma-separated, of {tuple(REMAT_POLICIES)}")
    ap.add_argument("--moe-impl", default="auto", help="k2jax.nn.moe.MOE_IMPLS (auto: tiled on CPU, ragged else)")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # internal: run one policy, print its figures as JSON
    args = ap.parse_args()

    cfg = K2Config.from_hf_config(json.load(open(args.config)))
    dtype = jnp.dtype(args.dtype)
    if args.child:
        print(json.dumps(child(args, cfg, dtype)))
        return
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    policies = args.remat.split(",")
    for r in policies:
        if r not in REMAT_POLICIES:
            ap.error(f"--remat: {r!r} is not one of {tuple(REMAT_POLICIES)}")

    n_tok = args.batch * args.tokens
    flops = 3 * args.batch * forward_flops(cfg, args.tokens)
    peak = matmul_peak(dtype)
    print(f"config {args.config}: {cfg.num_hidden_layers} layers, {cfg.n_routed_experts} experts top-"
          f"{cfg.num_experts_per_tok}; {args.batch} x {args.tokens} tokens, {args.dtype}"
          f"{' (float32 master)' if args.master else ''}, MoE {args.moe_impl}; {flops / 1e9:.1f} model GFLOP per "
          f"step; matmul peak {peak / 1e9:.1f} GFLOP/s; jax {jax.__version__}, backend {jax.default_backend()}",
          flush=True)
    argv = sys.argv[1:]
    rows = {}
    for r in policies:
        rows[r] = run_child(argv, r)
        print(f"  {r}: done (loss {rows[r]['loss']:.3f})", flush=True)

    print(f"\n{'remat':<13} {'step ms':>9} {'CPU s/step':>10} {'tokens/s':>9} {'GFLOP/s':>8} {'of peak':>8}")
    for r, x in rows.items():
        print(f"{r:<13} {x['wall'] * 1e3:>9.0f} {x['cpu']:>10.1f} {n_tok / x['wall']:>9.0f} "
              f"{flops / x['wall'] / 1e9:>8.1f} {flops / x['wall'] / peak:>8.1%}")

    base = rows.get("none")
    print("\nMemory, MiB. XLA compiled: args (params + opt state + batch), out, aliased (donated, not counted "
          "twice), temp (activations + workspace). Measured: peak RSS while stepping, and its rise over the RSS "
          "before the first step." + ("" if all(x["reset"] for x in rows.values()) else
                                      " (peak reset not permitted here: the peak includes compilation)"))
    show_dev = any(math.isfinite(x["device_peak"]) for x in rows.values())
    print(f"{'remat':<13} {'args':>7} {'out':>7} {'alias':>7} {'temp':>8} {'vs none':>8} {'XLA total':>10} "
          f"{'vs none':>8} {'RSS peak':>9} {'vs none':>8} {'RSS rise':>9} {'vs none':>8}"
          + (f" {'device peak':>12} {'vs none':>8}" if show_dev else ""))
    base_m = _memory(base) if base else {}
    for r, x in rows.items():
        m = _memory(x)
        col = lambda key, width: f"{m[key] / MiB:>{width}.0f} {_ratio(m[key], base_m.get(key)):>8}"  # noqa: E731, B023
        line = (f"{r:<13} {x['argument'] / MiB:>7.0f} {x['output'] / MiB:>7.0f} {x['alias'] / MiB:>7.0f} "
                f"{col('temp', 8)} {col('total', 10)} {col('rss_peak', 9)} {col('rise', 9)}")
        print(line + (f" {col('device_peak', 12)}" if show_dev else ""))


if __name__ == "__main__":
    main()
