"""n-gram speculative decoding against none, side by side in one run: `k2jax serve --demo` with and without
`--speculative ngram`, over HTTP with a streaming client.

1. Greedy completions (400 tokens, one request at a time) of "Once upon a time", "def fib(n):\\n    return"
   and "The quick brown fox": decode time (first token to last), whether the tokens are identical, and the
   drafts' mean accepted length (accepted drafts per verified row, from /metrics).
2. Text the lookup rarely predicts: a sampled completion (temperature 1, fixed seed) of 400 tokens.
3. The eight demo prompts at once (200 tokens each, greedy): wall time.

    python bench/speculative.py [--dtype bfloat16|float32] [--tokens 400] [-k 4] [--log FILE]

The speculating server times its decode and verifying steps at start-up and drafts only where a step's
expected tokens per second beat a plain decode (k2jax.runtime.engine). The CPU is what it is: compare only
within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from runtime import Server, _client  # noqa: E402  (bench/runtime.py)

PROMPTS = ["Once upon a time", "def fib(n):\n    return", "The quick brown fox"]
SPEC_METRICS = ("k2jax_spec_decode_verified_rows_total", "k2jax_spec_decode_draft_tokens_total",
                "k2jax_spec_decode_accepted_tokens_total")


async def _stream(client, url, body):
    """One streamed completion -> (token ids, arrival time of each)."""
    ids, times = [], []
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                got = json.loads(line[6:])["choices"][0].get("token_ids") or []
                ids += got
                times += [time.perf_counter()] * len(got)
    return ids, times


def _body(prompt, n, **kw):
    return {"model": "k2jax-demo", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": True} | kw


def completions(server, bodies):
    """Run the bodies at once -> [(ids, times)], and the wall time."""
    async def go():
        async with await _client() as c:
            t0 = time.perf_counter()
            out = await asyncio.gather(*[_stream(c, server.url, b) for b in bodies])
            return out, time.perf_counter() - t0
    return asyncio.run(go())


def spec_counts(server):
    try:
        return [server.metric(m) for m in SPEC_METRICS]
    except KeyError:
        return [0.0, 0.0, 0.0]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("-k", type=int, default=4, help="--num-speculative-tokens (default 4)")
    ap.add_argument("--log", default=None, help="keep the servers' output in this file")
    args = ap.parse_args()
    settings = {"off": [], "ngram": ["--speculative", "ngram", "--num-speculative-tokens", str(args.k)]}
    results = {}
    with tempfile.TemporaryDirectory() as d:
        for name, flags in settings.items():
            log = open(args.log + f".{name}" if args.log else os.devnull, "w")
            s = Server(["--demo", "--dtype", args.dtype, "--max-batch", "8", *flags], log, os.path.join(d, "xla"))
            r = results[name] = {}
            try:
                for p in PROMPTS:
                    before = spec_counts(s)
                    [(ids, times)], _ = completions(s, [_body(p, args.tokens)])
                    after = spec_counts(s)
                    r[p] = (ids, times[-1] - times[0], [a - b for a, b in zip(after, before)])
                before = spec_counts(s)
                [(ids, times)], _ = completions(s, [_body("Write code", args.tokens, temperature=1.0, seed=7)])
                r["sampled"] = (ids, times[-1] - times[0], [a - b for a, b in zip(spec_counts(s), before)])
                before = spec_counts(s)
                from k2jax.demo import PROMPTS as DEMO
                outs, wall = completions(s, [_body(p, 200) for p in DEMO])
                r["eight"] = ([i for ids, _ in outs for i in ids], wall,
                              [a - b for a, b in zip(spec_counts(s), before)])
            finally:
                s.close()
                log.close()
    print(f"\nn-gram speculation, serve --demo --dtype {args.dtype} --max-batch 8, "
          f"--num-speculative-tokens {args.k}")
    print(f"{'case':34} {'off':>8} {'ngram':>8} {'speed-up':>9} {'verified':>9} {'accepted/row':>13} "
          f"{'identical':>10}")
    for case, label in [(p, f"greedy {args.tokens}: {p!r}") for p in PROMPTS] + [
            ("sampled", f"sampled {args.tokens} (T=1): 'Write code'"), ("eight", "8 prompts at once, 200 each")]:
        ids0, t0, _ = results["off"][case]
        ids1, t1, (verified, drafted, accepted) = results["ngram"][case]
        print(f"{label[:34]:34} {t0:7.2f}s {t1:7.2f}s {t0 / t1:8.2f}x {verified:9.0f} "
              f"{accepted / max(verified, 1):13.2f} {str(ids0 == ids1):>10}")


if __name__ == "__main__":
    main()
