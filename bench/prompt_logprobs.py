"""The cost of prompt logprobs, side by side in one run, over HTTP on one `k2jax serve`:

- the time of a completions request over a long prompt (default 4000 tokens) to `serve --demo` (the random
  model of configs/bench.json's shape), max_tokens 1, without logprobs,
  and of the same request with `echo: true, logprobs: 1` (every prompt token scored). Goal: <= 1.3x.
- the server's resident memory after each kind of request (VmRSS, and its peak VmHWM): flat, the scores
  never hold a [T, V] array.

The server runs with --no-prefix-cache, so that every request prefills the whole prompt (a scored request
reads nothing from the cache anyway), and the two kinds alternate, `--repeats` times each (medians).

    python bench/prompt_logprobs.py [--long 4000] [--chunk 512] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request

from runtime import Server  # bench/runtime.py (also puts the repo on sys.path)


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=1800) as r:
        return json.load(r)


def memory_kb(pid: int) -> dict:
    with open(f"/proc/{pid}/status") as f:
        return {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f) if k in ("VmRSS", "VmHWM")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--long", type=int, default=4000, help="prompt tokens (default 4000)")
    ap.add_argument("--chunk", type=int, default=512, help="--prefill-chunk (default 512)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    max_len = -(-(args.long + 64) // 512) * 512
    with tempfile.TemporaryDirectory() as tmp, open(os.path.join(tmp, "serve.log"), "w") as log:
        srv = Server(["--demo", "--max-batch", "2", "--max-len", str(max_len), "--prefill-chunk", str(args.chunk),
                      "--no-prefix-cache"], log, tmp)
        print(f"server up in {srv.up_s:.0f} s (max_len {max_len}, chunk {args.chunk}, idle chunk {4 * args.chunk})")
        try:
            rng = __import__("numpy").random.default_rng(0)
            prompt = [int(t) for t in rng.integers(0, 768, args.long)]  # regular tokens of the demo vocabulary
            plain = {"model": "k2jax-demo", "prompt": prompt, "max_tokens": 1, "temperature": 0}
            scored = plain | {"echo": True, "logprobs": 1}
            post(srv.url, plain)  # a first run of each: nothing measured
            r = post(srv.url, scored)
            lp = r["choices"][0]["logprobs"]
            assert len(lp["token_logprobs"]) == args.long + 1 and lp["token_logprobs"][0] is None
            times = {"plain": [], "scored": []}
            mem = {"plain": [], "scored": []}
            for _ in range(args.repeats):
                for kind, body in (("plain", plain), ("scored", scored)):
                    t = time.perf_counter()
                    post(srv.url, body)
                    times[kind].append(time.perf_counter() - t)
                    mem[kind].append(memory_kb(srv.proc.pid))
        finally:
            srv.close()
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    print(f"\n{args.long}-token prompt, max_tokens 1, {args.repeats} runs each, alternating:")
    for k in ("plain", "scored"):
        print(f"  {k:7s} {med[k]:7.2f} s (runs: {', '.join(f'{x:.2f}' for x in times[k])}); "
              f"RSS after each: {', '.join(str(m['VmRSS'] // 1024) for m in mem[k])} MiB")
    ratio = med["scored"] / med["plain"]
    print(f"echo + logprobs vs plain: {ratio:.2f}x (goal <= 1.3x): {'met' if ratio <= 1.3 else 'NOT met'}")
    rss = [m["VmRSS"] for k in mem for m in mem[k]]
    print(f"server RSS over the runs: {min(rss) // 1024} - {max(rss) // 1024} MiB; peak (VmHWM) "
          f"{max(m['VmHWM'] for k in mem for m in mem[k]) // 1024} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
