"""Serving throughput and latency: the k2jax engine (continuous batching over the latent cache) against
transformers' continuous batching (`generate_batch`, in the oracle environment) on the same random
bench-config weights, and the engine against k2jax's own static `generate` at a full batch.

Workload (the defaults): 64 requests, prompts of 32-512 tokens, 32-128 new tokens, at concurrency 1, 4 and
16 and with Poisson arrivals at two rates. Printed side by side: output tokens/s, time to first token p50/p99
and inter-token latency p50/p99. `--requests/--max-prompt/--max-new/--config` shrink it for a quick run.

Why not `transformers serve`: it needs fastapi and uvicorn in the oracle environment (transformers[serving]),
which tests/oracle/requirements.txt does not install, and an HF tokenizer for the checkpoint, which the
synthetic checkpoint does not have; generate_batch is the continuous-batching scheduler it runs on.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def workload(n, min_prompt, max_prompt, min_new, max_new, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(2, vocab, rng.integers(min_prompt, max_prompt + 1)).tolist(),
             int(rng.integers(min_new, max_new + 1))) for _ in range(n)]


def pct(xs, q):
    return float(np.percentile(xs, q)) if xs else float("nan")


def run_engine(engine, jobs, concurrency=None, rate=None, seed=0):
    """Drive the engine on this thread: closed loop at `concurrency`, or Poisson arrivals at `rate`/s.
    -> (output tokens/s, TTFTs, inter-token latencies)."""
    from k2jax.serving.engine import Request, SamplingParams

    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, len(jobs))) if rate else None
    times: dict[int, list[float]] = {}
    starts: dict[int, float] = {}
    pending = list(range(len(jobs)))
    live = set()
    t0 = time.perf_counter()
    done = 0

    def on(k):
        def cb(ev):
            nonlocal done
            if ev.token_ids:
                times[k].append(time.perf_counter())
            if ev.finish_reason:
                live.discard(k)
                done += 1
        return cb

    while done < len(jobs):
        now = time.perf_counter() - t0
        while pending and ((concurrency and len(live) < concurrency) or (rate and arrivals[pending[0]] <= now)):
            k = pending.pop(0)
            p, n = jobs[k]
            times[k], starts[k] = [], time.perf_counter()
            live.add(k)
            engine.submit(Request(p, SamplingParams(max_tokens=n), on(k)))
        if not live and pending and rate:
            time.sleep(max(0.0, arrivals[pending[0]] - now))
            continue
        engine.step()
    wall = time.perf_counter() - t0
    ttft = [times[k][0] - starts[k] for k in times]
    itl = [b - a for k in times for a, b in zip(times[k], times[k][1:])]
    return sum(len(v) for v in times.values()) / wall, ttft, itl


_HF = r"""
import json, sys, time, torch
from transformers import AutoModelForCausalLM, GenerationConfig
ckpt, jobs, max_batch = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).eval()
out = {}
for n in sorted({n for _, n in jobs}):
    pass
gc = GenerationConfig(max_new_tokens=max(n for _, n in jobs), do_sample=False, eos_token_id=-1, pad_token_id=0,
                      max_batch_tokens=512, num_blocks=2048, block_size=32, scheduler="fifo")
t = time.perf_counter()
res = model.generate_batch(inputs=[p for p, _ in jobs], generation_config=gc)
wall = time.perf_counter() - t
toks = sum(len(r.generated_tokens) for r in res.values())
ttft = [r.timestamps[0] - r.created_time for r in res.values() if getattr(r, "timestamps", None)] if res else []
print("RESULT", json.dumps({"tokens_per_s": toks / wall, "wall": wall, "tokens": toks, "ttft": ttft}))
"""


def run_transformers(ckpt, jobs, max_batch):
    py = os.environ.get("K2JAX_ORACLE_PYTHON")
    if not py:
        return None, "K2JAX_ORACLE_PYTHON not set"
    r = subprocess.run([py, "-c", _HF, str(ckpt), json.dumps(jobs), str(max_batch)], capture_output=True, text=True,
                       timeout=3600)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")), None)
    if line is None:
        return None, (r.stderr or r.stdout).strip().splitlines()[-1:]
    return json.loads(line[7:]), None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "..", "configs", "bench.json"))
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--min-new", type=int, default=32)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--rates", default="0.5,2", help="Poisson arrival rates, requests/s")
    ap.add_argument("--no-transformers", action="store_true")
    args = ap.parse_args()

    import jax.numpy as jnp

    import k2jax
    from k2jax.serving.engine import Engine
    from k2jax.testing import random_params, write_release_checkpoint

    cfg = k2jax.K2Config.from_hf_config(args.config)
    jobs = workload(args.requests, args.min_prompt, args.max_prompt, args.min_new, args.max_new, cfg.vocab_size)
    max_len = args.max_prompt + args.max_new
    with tempfile.TemporaryDirectory() as d:
        ckpt = write_release_checkpoint(cfg, os.path.join(d, "hf"), seed=0, fast=True)
        _, params = k2jax.load_hf(ckpt, dtype=jnp.bfloat16)
        model = k2jax.K2Model(cfg, jnp.bfloat16)
        params = k2jax.split_experts(params)
        engine = Engine(model, params, max_batch=args.max_batch, max_len=max_len, prefill_chunk=args.prefill_chunk,
                        max_queue=10**6)
        print(f"compiling the engine: {engine.warm_up():.1f} s", flush=True)
        rows = []
        for c in [int(x) for x in args.concurrency.split(",") if x]:
            rows.append((f"concurrency {c}", *run_engine(engine, jobs, concurrency=c)))
        for r in [float(x) for x in args.rates.split(",") if x]:
            rows.append((f"poisson {r}/s", *run_engine(engine, jobs, rate=r)))
        hf, why = (None, "skipped") if args.no_transformers else run_transformers(ckpt, jobs, args.max_batch)

        # static generate at a full batch: the first max_batch requests, one padded batch
        full = jobs[:args.max_batch]
        t = {}
        k2jax.generate(model, params, [p for p, _ in full], max(n for _, n in full), timings=t)  # compiles
        t = {}
        out, lengths = k2jax.generate(model, params, [p for p, _ in full], max(n for _, n in full), timings=t)
        static_tps = int(lengths.sum()) / (t["prefill_s"] + t["decode_s"])
        eng_tps, _, _ = run_engine(engine, [(p, max(n for _, n in full)) for p, _ in full],
                                   concurrency=args.max_batch)

    print(f"\nworkload: {len(jobs)} requests, prompts {args.min_prompt}-{args.max_prompt}, new {args.min_new}-"
          f"{args.max_new}, {args.max_batch} slots, bf16, {args.config}")
    print(f"{'k2jax engine':<18} {'tokens/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>9} {'ITL p99':>9}")
    for name, tps, ttft, itl in rows:
        print(f"{name:<18} {tps:>9.1f} {pct(ttft, 50):>8.2f}s {pct(ttft, 99):>8.2f}s {pct(itl, 50) * 1e3:>7.0f}ms "
              f"{pct(itl, 99) * 1e3:>7.0f}ms")
    if hf:
        c16 = next((r for r in rows if r[0] == f"concurrency {args.max_batch}"), rows[-1])
        print(f"transformers generate_batch (all {len(jobs)} at once, {args.max_batch}-ish slots): "
              f"{hf['tokens_per_s']:.1f} tokens/s; k2jax at concurrency {args.max_batch}: {c16[1]:.1f} tokens/s "
              f"= {c16[1] / hf['tokens_per_s']:.2f}x")
    else:
        print(f"transformers: not measured ({why})")
    print(f"full batch of {args.max_batch}: engine {eng_tps:.1f} vs static generate {static_tps:.1f} tokens/s = "
          f"{eng_tps / static_tps:.2f}x")


if __name__ == "__main__":
    main()
