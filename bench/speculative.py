"""n-gram speculative decoding against none, side by side in one run: `k2jax serve --demo` with and without
`--speculative ngram`, over HTTP with a streaming client.

1. Greedy completions (400 tokens, one request at a time) of "Once upon a time", "def fib(n):\\n    return"
   and "The quick brown fox": decode time (first token to last), whether the tokens are identical, and the
   drafts' mean accepted length (accepted drafts per verified row, from /metrics).
2. Text the lookup rarely predicts: a sampled completion (temperature 1, fixed seed) of 400 tokens.
3. The eight demo prompts at once (200 tokens each, greedy): wall time.

    python bench/speculative.py [--dtype bfloat16|float32] [--tokens 400] [-k 4] [--repeats 3] [--log FILE]

Both servers run at once and take turns: each case runs on one, then the other (the order alternating),
`--repeats` times. The fastest of each is shown, with the slowest beside it, and the speed-up is the median
of the turns' own ratios (each turn's two runs back to back): a shared host's speed drifts within a run by
more than the effect measured. The speculating server times its decode and
verifying steps at start-up and drafts only where a step's expected tokens per second beat a plain decode
(k2jax.runtime.engine). The CPU is what it is: compare only within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
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
    ap.add_argument("--repeats", type=int, default=3, help="turns of each case on each server (default 3)")
    ap.add_argument("--log", default=None, help="keep the servers' output in this file")
    args = ap.parse_args()
    settings = {"off": [], "ngram": ["--speculative", "ngram", "--num-speculative-tokens", str(args.k)]}
    from k2jax.demo import PROMPTS as DEMO
    cases = [(p, f"greedy {args.tokens}: {p!r}", [_body(p, args.tokens)]) for p in PROMPTS] + [
        ("sampled", f"sampled {args.tokens} (T=1): 'Write code'",
         [_body("Write code", args.tokens, temperature=1.0, seed=7)]),
        ("eight", "8 prompts at once, 200 each", [_body(p, 200) for p in DEMO])]
    runs = {name: {case: [] for case, _, _ in cases} for name in settings}  # [(ids, seconds, spec counts)]
    with tempfile.TemporaryDirectory() as d:
        servers, logs = {}, []
        try:
            for name, flags in settings.items():
                logs.append(open(args.log + f".{name}" if args.log else os.devnull, "w"))
                servers[name] = Server(["--demo", "--dtype", args.dtype, "--max-batch", "8", *flags], logs[-1],
                                       os.path.join(d, "xla"))
            for turn in range(args.repeats):
                for case, _, bodies in cases:
                    for name in (list(settings) if turn % 2 == 0 else list(settings)[::-1]):
                        s = servers[name]
                        before = spec_counts(s)
                        outs, wall = completions(s, bodies)
                        counts = [a - b for a, b in zip(spec_counts(s), before)]
                        if len(bodies) == 1:
                            (ids, times), = outs
                            runs[name][case].append((ids, times[-1] - times[0], counts))
                        else:
                            runs[name][case].append(([i for ids, _ in outs for i in ids], wall, counts))
        finally:
            for s in servers.values():
                s.close()
            for log in logs:
                log.close()
    print(f"\nn-gram speculation, serve --demo --dtype {args.dtype} --max-batch 8, "
          f"--num-speculative-tokens {args.k}; the fastest (slowest) of {args.repeats} turns each, and the median of "
          f"the turns' speed-ups")
    print(f"{'case':34} {'off':>16} {'ngram':>16} {'speed-up':>9} {'verified':>9} {'accepted/row':>13} "
          f"{'identical':>10}")
    for case, label, _ in cases:
        off, on = runs["off"][case], runs["ngram"][case]
        t0, t1 = (min(r[1] for r in rs) for rs in (off, on))
        speedup = statistics.median(a[1] / b[1] for a, b in zip(off, on))
        slow0, slow1 = (max(r[1] for r in rs) for rs in (off, on))
        verified, _, accepted = (sum(r[2][j] for r in on) for j in range(3))
        same = all(a[0] == b[0] for a in off for b in on)
        print(f"{label[:34]:34} {t0:6.2f}s ({slow0:5.2f}) {t1:6.2f}s ({slow1:5.2f}) {speedup:8.2f}x "
              f"{verified / len(on):9.0f} {accepted / max(verified, 1):13.2f} {str(same):>10}")


if __name__ == "__main__":
    main()
