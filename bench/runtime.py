"""The inference runtime's goals, each measured side by side in one run (`k2jax serve` over HTTP with a
streaming client, and k2jax.generate in this process, on the same random weights):

1. TTFT of a long prompt (default 4000 tokens) through `serve` (chunked prefill over the paged cache) vs
   `k2jax.generate`'s prefill of the same prompt. Goal: <= 1.3x.
2. Inter-token gaps of a running stream while another long prompt is prefilled: p50 / p99 / max, against the
   time one prefill chunk takes alone. Goal: p99 <= one chunk's time.
3. A chat's second turn over a shared 2k-token history: TTFT with the prefix cache vs without
   (`--no-prefix-cache`). Goal: >= 4x lower with it.
4. Requests held at once in the same cache bytes, a mixed workload (one long request, many 256-token ones):
   the most requests running together (/metrics) with the pool of `--max-batch-old` x max-len tokens, vs the
   slots-times-max-len rule that pool would give. Goal: >= 3x.
5. 16 concurrent 12-token requests against one alone (`serve --demo --dtype float32`): the ratio of their
   wall times. Goal: <= 6x.

    python bench/runtime.py [--config configs/bench.json] [--long 4000] [--chunk 512] [--skip 1,2,...]

Each server is started once per setting (its compile cache kept in a temporary directory for the run). The
CPU is what it is: compare only within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np

from serve import free_port, pct, stop, wait_up  # bench/serve.py (also puts the repo on sys.path)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Server:
    """`k2jax serve` as a process on a loopback port."""

    def __init__(self, args: list[str], log, cache_dir: str):
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"PYTHONPATH": REPO}
        argv = [sys.executable, "-m", "k2jax.cli", "serve", "--port", str(self.port), "--compile-cache", cache_dir,
                "--no-access-log", *args]
        self.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        self.up_s = wait_up(f"http://127.0.0.1:{self.port}/health", self.proc, timeout=1800)
        self.url = f"http://127.0.0.1:{self.port}/v1/completions"

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics") as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        raise KeyError(name)

    def close(self):
        stop(self.proc)


async def stream(client, url, body):
    """One streamed completion -> (send time, arrival time of each token)."""
    times, t0 = [], time.perf_counter()
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                n = len(json.loads(line[6:])["choices"][0].get("token_ids") or [])
                times += [time.perf_counter()] * n
    return t0, times


def body(prompt, n, model="bench"):
    return {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": True}


async def _client():
    import httpx

    return httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=256))


def ttft(server, prompt, model="bench") -> float:
    async def go():
        async with await _client() as c:
            t0, ts = await stream(c, server.url, body(prompt, 1, model))
            return ts[0] - t0
    return asyncio.run(go())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=os.path.join(REPO, "configs", "bench.json"))
    ap.add_argument("--long", type=int, default=4000, help="the long prompt's tokens (default 4000)")
    ap.add_argument("--chunk", type=int, default=512, help="--prefill-chunk of the servers (default 512)")
    ap.add_argument("--history", type=int, default=2048, help="the chat's shared history (default 2048 tokens)")
    ap.add_argument("--max-batch-old", type=int, default=8, help="goal 4: the slots whose max-len rows make the pool")
    ap.add_argument("--skip", default="", help="comma-separated goal numbers to skip")
    ap.add_argument("--log", default=os.devnull, help="the servers' output goes here")
    args = ap.parse_args()
    skip = {int(x) for x in args.skip.split(",") if x}

    import jax.numpy as jnp

    import k2jax
    from k2jax.checkpoint import save_hf
    from k2jax.testing import random_params

    cfg = k2jax.K2Config.from_hf_config(args.config)
    rng = np.random.default_rng(0)
    ids = lambda n: rng.integers(2, cfg.vocab_size, n).tolist()  # noqa: E731
    max_len = -(-(args.long + 256) // 512) * 512
    log = open(args.log, "a")
    results = []
    with tempfile.TemporaryDirectory() as d:
        ckpt = os.path.join(d, "hf")
        params = random_params(cfg, jnp.bfloat16, seed=0)
        save_hf(params, cfg, ckpt)
        common = ["--hf-checkpoint", ckpt, "--dtype", "bfloat16", "--model-name", "bench", "--max-len",
                  str(max_len), "--prefill-chunk", str(args.chunk)]
        cache = os.path.join(d, "xla")
        long = ids(args.long)

        if not skip >= {1, 2}:
            s = Server(common + ["--max-batch", "4"], log, cache)
            print(f"server up in {s.up_s:.0f} s", flush=True)
            try:
                ttft(s, ids(args.chunk))  # warm
                chunk_s = min(ttft(s, ids(args.chunk)) for _ in range(3))  # one chunk's prefill (+ HTTP)
                if 1 not in skip:
                    # a new prompt each time: a repeated one would be read from the prefix cache
                    serve_s = min(ttft(s, ids(args.long)) for _ in range(2))
                    model = k2jax.K2Model(cfg, jnp.bfloat16)
                    _, p = k2jax.load_hf(ckpt, dtype=jnp.bfloat16)
                    k2jax.generate(model, p, [long], 1)  # compile
                    gen_s = min(_prefill_s(model, p, long) for _ in range(2))
                    results.append(("1", f"TTFT of a {args.long}-token prompt: serve {serve_s:.2f} s vs generate's "
                                         f"prefill {gen_s:.2f} s", serve_s / gen_s, "<= 1.3x"))
                    del p
                if 2 not in skip:
                    gaps, long_s = asyncio.run(_gaps_during_prefill(s.url, ids(64), ids(args.long)))
                    results.append(("2", f"inter-token gap of a stream while a {args.long}-token prompt prefills: "
                                         f"p50 {pct(gaps, 50) * 1e3:.0f} ms, p99 {pct(gaps, 99) * 1e3:.0f} ms, max "
                                         f"{max(gaps) * 1e3:.0f} ms (its TTFT {long_s:.2f} s); one "
                                         f"{args.chunk}-token chunk alone {chunk_s * 1e3:.0f} ms",
                                         pct(gaps, 99) / chunk_s, "p99 <= 1 chunk"))
            finally:
                s.close()

        if 3 not in skip:
            history = ids(args.history)
            turn1, answer, turn2 = history + ids(20), ids(30), ids(20)
            out = {}
            for name, extra in (("reuse", []), ("no reuse", ["--no-prefix-cache"])):
                s = Server(common + ["--max-batch", "4"] + extra, log, cache)
                try:
                    ttft(s, ids(100))  # warm
                    ttft(s, turn1)  # the first turn
                    out[name] = ttft(s, turn1 + answer + turn2)  # the second: history + answer + new question
                    if name == "reuse":
                        hit = s.metric("k2jax_prompt_tokens_cached_total")
                finally:
                    s.close()
            results.append(("3", f"second chat turn over a {args.history}-token history: TTFT {out['reuse']:.2f} s "
                                 f"with the prefix cache ({hit:.0f} prompt tokens reused) vs {out['no reuse']:.2f} s "
                                 f"without", out["no reuse"] / out["reuse"], ">= 4x lower"))

        if 4 not in skip:
            pool = args.max_batch_old * max_len
            s = Server(common + ["--max-batch", str(4 * args.max_batch_old), "--kv-tokens", str(pool)], log, cache)
            try:
                most = asyncio.run(_most_running(s, long, [ids(256) for _ in range(64)]))
            finally:
                s.close()
            results.append(("4", f"requests held at once in a pool of {pool} tokens (one {args.long}-token request "
                                 f"+ 64 of 256 tokens, 64 new each): {most:.0f}, vs {args.max_batch_old} with rows of "
                                 f"max-len", most / args.max_batch_old, ">= 3x"))

        if 5 not in skip:
            s = Server(["--demo", "--dtype", "float32", "--max-batch", "16", "--max-len", "256", "--prefill-chunk",
                        "64"], log, cache)
            try:
                ratio, one, many = asyncio.run(_concurrency(s.url, [ids(12) for _ in range(16)]))
            finally:
                s.close()
            results.append(("5", f"16 concurrent 12-token requests {many:.2f} s vs one alone {one:.2f} s "
                                 f"(serve --demo --dtype float32)", ratio, "<= 6x"))

    print(f"\nbench config {os.path.basename(args.config)}, bf16 random weights, prefill chunk {args.chunk}")
    for goal, what, ratio, want in results:
        print(f"{goal}. {what}: {ratio:.2f}x (goal {want})")


def _prefill_s(model, params, prompt) -> float:
    import k2jax

    t = {}
    k2jax.generate(model, params, [prompt], 1, timings=t)
    return t["prefill_s"]


async def _gaps_during_prefill(url, short, long) -> tuple[list[float], float]:
    """A stream of 300 tokens is decoding when the long prompt arrives. -> the stream's gaps between tokens
    from then until the long prompt's first token (its whole prefill), and that prompt's time to it."""
    async with await _client() as c:
        task = asyncio.ensure_future(stream(c, url, body(short, 300)))
        await asyncio.sleep(2.0)  # the stream is decoding
        if task.done():
            raise RuntimeError("the stream ended before the long prompt was sent")
        t_send = time.perf_counter()
        _, long_ts = await stream(c, url, body(long, 1))
        _, ts = await task
    during = [b - a for a, b in zip(ts, ts[1:]) if t_send <= b <= long_ts[0]]
    return during or [float("nan")], long_ts[0] - t_send


async def _most_running(server, long, shorts) -> float:
    """Send the long request and the short ones together; -> the most requests running at once (/metrics)."""
    async with await _client() as c:
        tasks = [asyncio.ensure_future(stream(c, server.url, body(long, 64)))]
        tasks += [asyncio.ensure_future(stream(c, server.url, body(p, 64))) for p in shorts]
        most = 0.0
        while not all(t.done() for t in tasks):
            await asyncio.sleep(0.05)
            most = max(most, await asyncio.to_thread(server.metric, "k2jax_slots_in_use"))
        await asyncio.gather(*tasks)
    return most


async def _concurrency(url, prompts) -> tuple[float, float, float]:
    async with await _client() as c:
        demo = lambda p: body(p, 12, "k2jax-demo")  # noqa: E731
        await stream(c, url, demo(prompts[0]))  # warm
        t = time.perf_counter()
        await stream(c, url, demo(prompts[1]))
        one = time.perf_counter() - t
        t = time.perf_counter()
        await asyncio.gather(*(stream(c, url, demo(p)) for p in prompts))
        many = time.perf_counter() - t
    return many / one, one, many


if __name__ == "__main__":
    main()
