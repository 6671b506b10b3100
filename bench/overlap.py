"""Overlap scheduling, side by side in one run: the same serving workload through one Engine (one warm-up)
with overlap (each step sent before the step before's tokens are read; decoding rows' tokens fed on the
device) and without (each step's tokens read before the next is planned), alternating, best of --repeats.

Printed per mode: output tokens/s, engine steps, and per step the wall time, the time the engine thread
waited for the device (blocked reading tokens) and the host's own work (the rest: admission, planning,
inputs, sampling settings, detokenizing, events). Without overlap a step costs the device's time plus the
host's; with it the host's work for step n+1 runs while the device runs step n.

    python bench/overlap.py                       # bench config, 32 requests, 16 at a time
    python bench/overlap.py --requests 64 --max-batch 32
    python bench/overlap.py --grammar 4           # every 4th request's output is JSON (a grammar)

--grammar N gives every N-th request a JSON grammar (response_format json_object), over the demo tokenizer
(the config's vocabulary is made its size). A step where such a row samples is sent as its model pass, and
its masks are made while the pass runs, after the step before's tokens are read.
"""

from __future__ import annotations

import argparse
import os
import time

from common import REPO  # noqa: F401  (puts the repository on sys.path)
from serve import closed_loop, workload  # bench/serve.py

import jax
import jax.numpy as jnp


def run(eng, jobs, concurrency: int, overlap: bool) -> dict:
    """The workload in a closed loop at `concurrency` -> tokens, wall, steps, and seconds waited for tokens."""
    eng.overlap = overlap
    waited = [0.0]
    emit = eng._emit

    def timed_emit(call, out):  # the wait for the device, apart from the host's work on the tokens
        t = time.perf_counter()
        jax.block_until_ready(out["tokens"])
        waited[0] += time.perf_counter() - t
        return emit(call, out)

    eng._emit = timed_emit
    try:
        tokens, steps, wall = closed_loop(eng, jobs, concurrency)
    finally:
        eng._emit = emit
    return {"tokens": tokens, "wall": wall, "steps": steps, "waited": waited[0]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=os.path.join(REPO, "configs", "bench.json"))
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--min-prompt", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--min-new", type=int, default=32)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--repeats", type=int, default=2, help="runs of each mode, alternating (the best is kept)")
    ap.add_argument("--grammar", type=int, default=0, metavar="N",
                    help="every N-th request's output is constrained to JSON (default 0: none)")
    args = ap.parse_args()

    import k2jax
    from k2jax.runtime.engine import Engine
    from k2jax.testing import random_params

    cfg, grammars = k2jax.K2Config.from_hf_config(args.config), None
    if args.grammar:
        from k2jax.serving.grammar import GrammarCompiler, GrammarTokenizer
        from k2jax.synthetic import demo_tokenizer

        tok = demo_tokenizer()
        cfg = cfg.replace(vocab_size=tok.vocab_size)
        grammars = GrammarCompiler(GrammarTokenizer(tok, cfg.vocab_size))
    jobs = workload(args.requests, args.min_prompt, args.max_prompt, args.min_new, args.max_new, cfg.vocab_size)
    if args.grammar:
        json_object = {"grammar": {"response_format": {"type": "json_object"}}}
        jobs = [(p, n, json_object) if i % args.grammar == 0 else (p, n) for i, (p, n) in enumerate(jobs)]
    dt = jnp.dtype(args.dtype)
    eng = Engine(k2jax.K2Model(cfg, dt), random_params(cfg, dt, seed=0), max_batch=args.max_batch,
                 max_len=args.max_prompt + args.max_new, prefill_chunk=args.prefill_chunk, max_queue=len(jobs),
                 prefix_cache=False, grammars=grammars)  # each run prefills its prompts afresh
    t0 = time.perf_counter()
    eng.warm_up()
    constrained = f", every {args.grammar}th with a JSON grammar" if args.grammar else ""
    print(f"{jax.devices()[0].device_kind}; engine warmed up in {time.perf_counter() - t0:.0f} s; "
          f"{args.requests} requests{constrained}, {args.concurrency} at a time, {args.dtype}", flush=True)
    best = {}
    for r in range(args.repeats):
        for overlap in ((True, False) if r % 2 == 0 else (False, True)):
            got = run(eng, jobs, args.concurrency, overlap)
            rate = got["tokens"] / got["wall"]
            print(f"  run {r + 1}, overlap {'on ' if overlap else 'off'}: {rate:6.1f} tokens/s "
                  f"({got['tokens']} tokens, {got['wall']:.1f} s, {got['steps']} steps)", flush=True)
            if overlap not in best or rate > best[overlap][0]:
                best[overlap] = (rate, got)
    print("\n| overlap | output tokens/s | steps | ms per step | waited for the device | host work |")
    print("|---|---|---|---|---|---|")
    for overlap in (True, False):
        rate, g = best[overlap]
        per = 1e3 / g["steps"]
        print(f"| {'on' if overlap else 'off'} | {rate:.1f} | {g['steps']} | {g['wall'] * per:.1f} | "
              f"{g['waited'] * per:.1f} ms | {(g['wall'] - g['waited']) * per:.1f} ms |")
    print(f"\noverlap on / off: {best[True][0] / best[False][0]:.3f}x output tokens/s")


if __name__ == "__main__":
    main()
