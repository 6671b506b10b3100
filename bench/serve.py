"""Serving throughput and latency, side by side: `k2jax serve` against `transformers serve` (in the oracle
environment) on the same random bench-config weights (bf16), both driven over HTTP by the same streaming
client; then the k2jax server at a full batch against k2jax's own static `generate`.

Workload (the defaults): 64 requests, prompts of 32-512 tokens, 32-128 new tokens, at concurrency 1, 4 and
16 and with Poisson arrivals at two rates. Printed side by side: output tokens/s, time to first token p50/p99
and inter-token latency p50/p99 (from the streamed chunks). `--requests/--max-prompt/--max-new` shrink it.

transformers' side. `transformers serve --continuous-batching` (and `generate_batch`, the same
ContinuousBatchingManager) cannot run DeepseekV3 in transformers 5.24: its paged cache is laid out as
[num_key_value_heads, head_dim] per token, but DeepseekV3's attention caches the MLA latent, and the first
request fails with "index_copy_(): Source/destination tensor must have same slice shapes. Destination slice
shape: 16 32 at dimension 0 and source slice shape: 1 256 at dimension 0". So the comparison is with
`transformers serve` without continuous batching (its default: one `generate` at a time on its inference
thread), which is what that server offers for this model. It needs fastapi, uvicorn, openai and accelerate,
which the oracle environment does not install: `--hf-extra DIR` puts a `pip install --target DIR fastapi
uvicorn openai accelerate` on its path. Prompts go to it as text of a word-level tokenizer written beside the
checkpoint ("t17 t5 ..." is ids 17, 5, ...), to k2jax as the same token ids; k2jax ignores EOS, transformers
stops at it (rare on random weights; tokens/s counts the tokens it sent).

`--in-process` runs only k2jax's side, through its Engine in this process (no HTTP): output tokens/s and the
steps' time by shape, e.g. `--in-process --requests 32 --concurrency 16`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

_TOKENIZER = r"""
import sys
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
d, V = sys.argv[1], int(sys.argv[2])
t = Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0"))
t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
PreTrainedTokenizerFast(tokenizer_object=t, bos_token="t0", eos_token="t1", pad_token="t0",
                        unk_token="t0").save_pretrained(d)
"""


def workload(n, min_prompt, max_prompt, min_new, max_new, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(2, vocab, rng.integers(min_prompt, max_prompt + 1)).tolist(),
             int(rng.integers(min_new, max_new + 1))) for _ in range(n)]


def pct(xs, q):
    return float(np.percentile(xs, q)) if xs else float("nan")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url, proc, timeout=900):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return time.time() - t0
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{url} not up after {timeout} s")


async def one(client, url, body, n_of):
    """Stream one completion: -> (send time, token arrival times)."""
    times = []
    t0 = time.perf_counter()
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            n = n_of(json.loads(line[6:])["choices"][0])
            times += [time.perf_counter()] * n
    return t0, times


async def drive(url, make_body, n_of, jobs, concurrency=None, rate=None, seed=0):
    """Closed loop at `concurrency`, or Poisson arrivals at `rate`/s -> (tokens/s, TTFTs, ITLs)."""
    import httpx

    results = []
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=256)) as client:
        t0 = time.perf_counter()
        if rate:
            arrivals = np.cumsum(np.random.default_rng(seed).exponential(1 / rate, len(jobs)))

            async def at(k):
                await asyncio.sleep(max(0.0, t0 + arrivals[k] - time.perf_counter()))
                results.append(await one(client, url, make_body(*jobs[k]), n_of))

            await asyncio.gather(*(at(k) for k in range(len(jobs))))
        else:
            queue = list(range(len(jobs)))

            async def worker():
                while queue:
                    k = queue.pop(0)
                    results.append(await one(client, url, make_body(*jobs[k]), n_of))

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    ttft = [ts[0] - s for s, ts in results if ts]
    itl = [b - a for _, ts in results for a, b in zip(ts, ts[1:])]
    return sum(len(ts) for _, ts in results) / wall, ttft, itl


def scenarios(args):
    return ([(f"concurrency {c}", {"concurrency": c}) for c in map(int, args.concurrency.split(",")) if c]
            + [(f"poisson {r:g}/s", {"rate": r}) for r in map(float, args.rates.split(",")) if r])


def run_all(url, make_body, n_of, jobs, args):
    out = {}
    for name, kw in scenarios(args):
        out[name] = asyncio.run(drive(url, make_body, n_of, jobs, **kw))
        print(f"  {name}: {out[name][0]:.1f} tokens/s", flush=True)
    return out


def serve(argv, env, health, log):
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    return proc, wait_up(health, proc)


def stop(proc):
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def closed_loop(eng, jobs, concurrency: int) -> tuple[int, int, float]:
    """The jobs ((prompt, new tokens) each, greedy; a third item: more SamplingParams fields) through an Engine
    on this thread in a closed loop: `concurrency` at a time, the next submitted as one ends, stepped until
    every one has ended and nothing sent is left unread -> (output tokens, engine steps, wall seconds)."""
    from k2jax.runtime.requests import Request, SamplingParams

    queue, tokens, live = list(range(len(jobs))), [0], [0]

    def submit():
        p, n, *more = jobs[queue.pop(0)]
        live[0] += 1

        def on(e):
            tokens[0] += len(e.token_ids)
            if e.finish_reason:
                live[0] -= 1
                if queue:
                    submit()

        eng.submit(Request(list(p), SamplingParams(max_tokens=n, temperature=0.0, **(more[0] if more else {})), on))

    for _ in range(min(concurrency, len(jobs))):
        submit()
    steps, t0 = 0, time.perf_counter()
    while live[0] or queue or eng.busy():
        eng.step()
        steps += 1
    return tokens[0], steps, time.perf_counter() - t0


def in_process(cfg, jobs, args) -> None:
    """`--in-process`: the workload through k2jax's Engine in this process, with the server's settings, in a
    closed loop at the highest --concurrency: no HTTP and no transformers, so a change to the step shows
    without the servers' noise. Prints output tokens/s and the steps' time by shape."""
    import collections

    import jax
    import jax.numpy as jnp

    import k2jax
    from k2jax.runtime.engine import Engine
    from k2jax.testing import random_params

    dt = jnp.bfloat16
    eng = Engine(k2jax.K2Model(cfg, dt), random_params(cfg, dt, seed=0), max_batch=args.max_batch,
                 max_len=args.max_prompt + args.max_new, prefill_chunk=args.prefill_chunk, max_queue=len(jobs))
    t0 = time.perf_counter()
    eng.warm_up()
    print(f"engine warmed up in {time.perf_counter() - t0:.0f} s", flush=True)
    steps = collections.defaultdict(list)
    run = eng.runner.step

    def timed(shape, batch):  # each step waited for, to be timed alone
        t = time.perf_counter()
        out = run(shape, batch)
        jax.block_until_ready(out["tokens"])
        steps[shape].append(time.perf_counter() - t)
        return out

    eng.runner.step = timed
    tokens, _, wall = closed_loop(eng, jobs, max(map(int, args.concurrency.split(","))))
    print(f"\nworkload: {len(jobs)} requests in process, {tokens} output tokens in {wall:.1f} s: "
          f"{tokens / wall:.1f} tokens/s; steps {sum(map(len, steps.values()))}, "
          f"{sum(map(sum, steps.values())):.1f} s of them")
    for shape, ts in sorted(steps.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {sum(ts):6.2f} s  {len(ts):4d} x {1e3 * float(np.median(ts)):7.1f} ms  {shape}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=os.path.join(REPO, "configs", "bench.json"))
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--min-new", type=int, default=32)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--max-batch", type=int, default=16, help="k2jax decode slots (default 16)")
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--rates", default="0.5,2", help="Poisson arrival rates, requests/s")
    ap.add_argument("--hf-extra", metavar="DIR", help="a pip --target directory with fastapi, uvicorn, openai and "
                                                       "accelerate for the oracle environment")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--log", default=os.devnull, help="the servers' output goes here")
    ap.add_argument("--in-process", action="store_true",
                    help="k2jax's Engine alone in this process, at the highest --concurrency (no servers)")
    args = ap.parse_args()

    import jax.numpy as jnp

    import k2jax
    from k2jax.checkpoint import save_hf
    from k2jax.testing import random_params

    cfg = k2jax.K2Config.from_hf_config(args.config)
    jobs = workload(args.requests, args.min_prompt, args.max_prompt, args.min_new, args.max_new, cfg.vocab_size)
    if args.in_process:
        return in_process(cfg, jobs, args)
    max_len = args.max_prompt + args.max_new
    log = open(args.log, "a")
    with tempfile.TemporaryDirectory() as d:
        ckpt = os.path.join(d, "hf")
        save_hf(random_params(cfg, jnp.bfloat16, seed=0), cfg, ckpt)
        c = json.loads(open(os.path.join(ckpt, "config.json")).read())
        with open(os.path.join(ckpt, "config.json"), "w") as f:  # transformers knows the architecture by this name
            json.dump(c | {"model_type": "deepseek_v3"}, f)

        # --- k2jax serve ---
        port = free_port()
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"PYTHONPATH": REPO}
        argv = [sys.executable, "-m", "k2jax.cli", "serve", "--hf-checkpoint", ckpt, "--dtype", "bfloat16",
                "--port", str(port), "--model-name", "bench", "--max-batch", str(args.max_batch), "--max-len",
                str(max_len), "--prefill-chunk", str(args.prefill_chunk), "--max-queue", "100000"]
        proc, up = serve(argv, env, f"http://127.0.0.1:{port}/health", log)
        print(f"k2jax serve up (load + compile) in {up:.0f} s", flush=True)
        url = f"http://127.0.0.1:{port}/v1/completions"
        kbody = lambda p, n: {"model": "bench", "prompt": p, "max_tokens": n, "temperature": 0,  # noqa: E731
                              "ignore_eos": True, "stream": True}
        kn = lambda ch: len(ch.get("token_ids") or [])  # noqa: E731
        try:
            k2 = run_all(url, kbody, kn, jobs, args)
            full = [(p, args.max_new) for p, _ in jobs[:args.max_batch]]
            asyncio.run(drive(url, kbody, kn, full, concurrency=args.max_batch))  # warm: HTTP and the slots
            eng_tps = asyncio.run(drive(url, kbody, kn, full, concurrency=args.max_batch))[0]
        finally:
            stop(proc)

        # --- transformers serve ---
        hf, why = {}, "skipped (--no-transformers)"
        py = os.environ.get("K2JAX_ORACLE_PYTHON")
        if not args.no_transformers and not py:
            why = "K2JAX_ORACLE_PYTHON not set"
        elif not args.no_transformers:
            subprocess.run([py, "-c", _TOKENIZER, ckpt, str(cfg.vocab_size)], check=True)
            port = free_port()
            henv = dict(os.environ) | ({"PYTHONPATH": args.hf_extra} if args.hf_extra else {})
            tf = os.path.join(os.path.dirname(py), "transformers")
            proc, up = serve([tf, "serve", ckpt, "--device", "cpu", "--dtype", "bfloat16", "--host", "127.0.0.1",
                              "--port", str(port)], henv, f"http://127.0.0.1:{port}/v1/models", log)
            print(f"transformers serve up in {up:.0f} s", flush=True)
            hbody = lambda p, n: {"model": ckpt, "prompt": " ".join(f"t{t}" for t in p),  # noqa: E731
                                  "max_tokens": n, "temperature": 0, "stream": True}
            hn = lambda ch: len((ch.get("text") or "").split())  # noqa: E731
            try:
                asyncio.run(drive(f"http://127.0.0.1:{port}/v1/completions", hbody, hn, jobs[:1], concurrency=1))
                hf = run_all(f"http://127.0.0.1:{port}/v1/completions", hbody, hn, jobs, args)
            finally:
                stop(proc)

        # --- static generate at a full batch: the same prompts, one padded batch ---
        _, params = k2jax.load_hf(ckpt, dtype=jnp.bfloat16)
        model = k2jax.K2Model(cfg, jnp.bfloat16)
        prompts = [p for p, _ in full]
        k2jax.generate(model, params, prompts, args.max_new)  # compiles
        t = {}
        _, lengths = k2jax.generate(model, params, prompts, args.max_new, timings=t)
        static_tps = int(lengths.sum()) / (t["prefill_s"] + t["decode_s"])

    print(f"\nworkload: {len(jobs)} requests, prompts {args.min_prompt}-{args.max_prompt} tokens, "
          f"{args.min_new}-{args.max_new} new, bf16 random weights of {os.path.basename(args.config)}; k2jax "
          f"{args.max_batch} slots x {max_len}; transformers serve without continuous batching (see --help)")
    head = f"{'':<16} {'tokens/s':>17} {'TTFT p50 (s)':>15} {'TTFT p99 (s)':>15} {'ITL p50 (ms)':>15} " \
           f"{'ITL p99 (ms)':>15}"
    print(head + "\n" + f"{'':<16}" + f" {'k2jax':>8} {'hf':>8}" + f" {'k2jax':>7} {'hf':>7}" * 4)
    for name, _ in scenarios(args):
        a, b = k2[name], hf.get(name, (float("nan"), [], []))
        print(f"{name:<16} {a[0]:>8.1f} {b[0]:>8.1f} {pct(a[1], 50):>7.2f} {pct(b[1], 50):>7.2f} "
              f"{pct(a[1], 99):>7.2f} {pct(b[1], 99):>7.2f} {pct(a[2], 50) * 1e3:>7.0f} {pct(b[2], 50) * 1e3:>7.0f} "
              f"{pct(a[2], 99) * 1e3:>7.0f} {pct(b[2], 99) * 1e3:>7.0f}")
    if not hf:
        print(f"transformers: not measured ({why})")
    else:
        c = f"concurrency {max(map(int, args.concurrency.split(',')))}"
        print(f"{c}: k2jax / transformers tokens/s = {k2[c][0] / hf[c][0]:.2f}x, TTFT p99 "
              f"{pct(k2[c][1], 99):.2f} s vs {pct(hf[c][1], 99):.2f} s")
    print(f"full batch ({args.max_batch} requests x {args.max_new} tokens): k2jax serve {eng_tps:.1f} vs static "
          f"generate {static_tps:.1f} tokens/s = {eng_tps / static_tps:.2f}x")


if __name__ == "__main__":
    main()
