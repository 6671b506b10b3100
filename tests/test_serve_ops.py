"""`k2jax serve` as operators run it, each case on a server started with its own flags (the small random
checkpoint of serve_util, float32): a taken port, `k2jax --version`, the queue counted after admission, the
API key, the logs, and SIGTERM with requests in flight. The frequency_penalty case runs on the demo model."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.conftest import REPO
from tests.serve_util import env, free_port, metric, serve_argv, wait_ready, write_model

KEY = "sk-test-k2jax"
DRAIN_S = 3
LONG = 4000  # tokens: far more than a drain lets run on CPU


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("serve_ops"))


class Server:
    """A `k2jax serve` process whose output goes to a file the test can read while it runs."""

    def __init__(self, argv, port, log_path, extra_env=None):
        self.port, self.log_path = port, log_path
        self.out = open(log_path, "w")
        self.proc = subprocess.Popen(argv, env=env() | (extra_env or {}), cwd=REPO, stdout=self.out,
                                     stderr=subprocess.STDOUT, text=True)
        wait_ready(port, [self.proc])

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.out.close()


def test_version_flag():
    import k2jax

    r = subprocess.run([sys.executable, "-m", "k2jax.cli", "--version"], env=env(), cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == f"k2jax {k2jax.__version__}"


def test_a_taken_port_fails_at_once_naming_it(files):
    import socket

    ckpt, tok = files
    def floor():  # starting Python and the CLI as far as its arguments (slow on a busy machine)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "k2jax.cli", "serve", "--help"], env=env(), cwd=REPO, check=True,
                       timeout=120, capture_output=True)
        return time.perf_counter() - t0

    before = floor()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.perf_counter()
        r = subprocess.run(serve_argv(ckpt, tok, port), env=env(), cwd=REPO, capture_output=True, text=True,
                           timeout=120)
        took = time.perf_counter() - t0
    assert r.returncode == 2, r.stderr
    assert f"--port {port}" in r.stderr and "already in use" in r.stderr, r.stderr
    assert "loaded" not in r.stderr  # refused before loading anything
    # under 3 s on an idle machine (about 1.2 s on 2 cores); on a loaded one, within 1 s of starting the CLI
    # (the slower of a start before and one after: the load changes while the test runs)
    start = max(before, floor())
    assert took < max(3.0, start + 1.0), f"{took:.1f} s to notice a taken port (starting the CLI: {start:.1f} s)"


# --- the queue ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small(files, tmp_path_factory):
    """2 slots, a queue of 1, a pool of 1536 tokens (two long requests do not fit at once)."""
    ckpt, tok = files
    port = free_port()
    s = Server(serve_argv(ckpt, tok, port, "--max-batch", "2", "--max-queue", "1", "--max-len", "1024",
                          "--prefill-chunk", "16", "--kv-tokens", "1536"), port,
               tmp_path_factory.mktemp("small") / "out.log")
    yield s
    s.stop()


def test_the_queue_is_counted_after_admission(small):
    """--max-batch 2 --max-queue 1: three simultaneous requests are all taken (two run, one waits), a fourth
    gets 429 rate_limit_exceeded."""
    url = f"http://127.0.0.1:{small.port}/v1/completions"
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 1000, "temperature": 0, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(timeout=300) as c:
            first = [asyncio.ensure_future(c.post(url, json=body)) for _ in range(3)]
            t0 = time.time()
            while not (metric(small.port, "k2jax_slots_in_use") == 2 and metric(small.port, "k2jax_queue_depth") == 1):
                assert time.time() - t0 < 60 and not any(f.done() for f in first), [f.result() for f in first
                                                                                     if f.done()]
                await asyncio.sleep(0.01)
            fourth = await c.post(url, json=body | {"max_tokens": 2})
            return [await f for f in first], fourth

    first, fourth = asyncio.run(main())
    assert [r.status_code for r in first] == [200] * 3, [r.text for r in first]
    assert fourth.status_code == 429 and fourth.headers["retry-after"].isdigit()
    assert fourth.json()["error"]["type"] == "rate_limit_exceeded"


def _readme_counters() -> list[str]:
    """The counters README's /metrics paragraph lists."""
    text = (REPO / "README.md").read_text()
    para = text[text.index("  - `GET /metrics` (Prometheus text)."):]
    para = para[:para.index("\n- **")]
    return sorted(set(re.findall(r"`(k2jax_\w+_total)`", para)))


def test_every_counter_the_readme_lists_moves(small):
    """After requests of every kind (finished, refused with 429 and with 400, preempted by a full pool,
    served in part from the prefix cache) each counter README lists has moved, the compilations apart (they
    moved at the warm-up and stay put); the prompt-token counter moved by the requests' usage.prompt_tokens,
    and the prefilled and cached counters split those prompts."""
    names = _readme_counters()
    assert len(names) >= 10 and "k2jax_prompt_tokens_prefilled_total" in names, names
    before = {n: metric(small.port, n) for n in names}
    url = f"http://127.0.0.1:{small.port}/v1/completions"
    long = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 900, "temperature": 0, "ignore_eos": True}
    shared = list(range(10, 210))  # 200 tokens: three full pages the second request finds cached

    async def main():
        async with httpx.AsyncClient(timeout=600) as c:
            first = [asyncio.ensure_future(c.post(url, json=long)) for _ in range(3)]
            t0 = time.time()
            while metric(small.port, "k2jax_queue_depth") < 1:
                assert time.time() - t0 < 60
                await asyncio.sleep(0.01)
            refused = [await c.post(url, json=long | {"max_tokens": 2}), await c.post(url, json={"prompt": [5],
                                                                                               "top_p": 2})]
            done = [await f for f in first]
            for _ in range(2):
                done.append(await c.post(url, json={"model": "tiny", "prompt": shared, "max_tokens": 3}))
            return done, refused

    done, refused = asyncio.run(main())
    assert [r.status_code for r in done] == [200] * 5 and [r.status_code for r in refused] == [429, 400]
    after = {n: metric(small.port, n) for n in names}
    for n in names:
        if n == "k2jax_compilations_total":
            assert after[n] == before[n] > 0, n
        else:
            assert after[n] > before[n], (n, before[n], after[n])
    usage = sum(r.json()["usage"]["prompt_tokens"] for r in done)
    assert after["k2jax_prompt_tokens_total"] - before["k2jax_prompt_tokens_total"] == usage == 3 * 3 + 2 * 200
    split = [after[n] - before[n] for n in ("k2jax_prompt_tokens_prefilled_total", "k2jax_prompt_tokens_cached_total")]
    assert sum(split) == usage and split[1] == 192, split  # the second shared prompt: three pages of 64 cached


# --- API key, logs and SIGTERM: one server, stopped by the last test ------------------------------------

@pytest.fixture(scope="module")
def ops(files, tmp_path_factory):
    ckpt, tok = files
    port = free_port()
    s = Server(serve_argv(ckpt, tok, port, "--max-batch", "16", "--max-queue", "16", "--max-len", "4096",
                          "--prefill-chunk", "32", "--stats-interval", "0.5", "--drain-timeout", str(DRAIN_S)),
               port, tmp_path_factory.mktemp("ops") / "out.log", extra_env={"K2JAX_API_KEY": KEY})
    yield s
    s.stop()


def test_the_api_key_guards_the_api_but_not_health(ops):
    base = f"http://127.0.0.1:{ops.port}"
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    r = httpx.post(f"{base}/v1/completions", json={"prompt": [5], "max_tokens": 1})  # no key at all
    assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.post(f"{base}/tokenize", json={"prompt": "x"}).status_code == 401
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(base + path).status_code == 200, path
    c = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY)
    assert [m.id for m in c.models.list().data] == ["tiny"]
    r = c.completions.create(model="tiny", prompt=[5, 6], max_tokens=3, temperature=0)
    assert len(r.choices[0].token_ids) >= 1


def test_a_cpu_server_near_the_memory_map_limit_warns_before_compiling(caplog):
    """XLA:CPU maps each program's code piecewise; past vm.max_map_count compiling crashes the process. The
    server warns before compiling when its programs may come near that limit, and not otherwise."""
    import logging

    from k2jax.serving import server

    try:
        limit = int(open("/proc/sys/vm/max_map_count").read())
    except OSError:
        pytest.skip("no /proc/sys/vm/max_map_count")
    log = logging.getLogger("k2jax-test-maps")
    with caplog.at_level(logging.WARNING, logger=log.name):
        server._check_map_count(1, log)
        assert not caplog.records
        server._check_map_count(limit // server.MAPS_PER_CPU_PROGRAM + 1, log)
    assert "vm.max_map_count" in caplog.text and "--fixed-chunks" in caplog.text


def test_the_logs_say_what_the_server_does(ops):
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{ops.port}/v1", api_key=KEY, max_retries=0)
    c.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=7, temperature=0,
                         extra_body={"ignore_eos": True})
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="tiny", prompt=[5], top_p=2.0)
    long = c.completions.create(model="tiny", prompt=[5], max_tokens=600, temperature=0,
                                extra_body={"ignore_eos": True})  # busy for a while: stats lines
    assert long.usage.completion_tokens == 600
    time.sleep(1.0)  # the stats line of the last interval
    log = ops.log()
    n = int(log.split("compiling 1/")[1].split(":")[0])
    # what the server does between loading and serving: a line before the first compile, one as each program
    # begins compiling (with the time since the warm-up began, in order), one when the timing begins
    assert f"warming up: tracing and compiling {n} step programs" in log
    at = [float(m.group(1)) for m in re.finditer(r"compiling \d+/\d+: .*\(at (\d+\.\d) s\)", log)]
    assert len(at) == n and at == sorted(at), at
    assert log.index("warming up:") < log.index("compiling 1/") < log.index("compiled the engine steps in")
    # why these programs: ragged steps (one device), a few sizes each
    assert re.search(r"step programs \(ragged steps: \d+ decode-only sizes up to the \d+ slots of a shard and "
                     r"\d+ prompt-chunk sizes up to \d+ tokens\)", log), log[:3000]
    assert "compute dtype float32, weights float32" in log and "cache float32" in log
    lines = log.splitlines()
    assert any('"POST /v1/completions" 200 prompt_tokens=4 completion_tokens=7 ttft=' in ln and " total=" in ln
               for ln in lines), log[-3000:]
    assert any('"POST /v1/completions" 400 ' in ln and 'error="top_p: must be in' in ln for ln in lines)
    stats = [ln for ln in lines if "stats: running 1, waiting 0" in ln]
    assert stats and "generation " in stats[0] and "tokens/s" in stats[0] and "% in use" in stats[0]
    assert all(re.search(r"prompt \d+\.\d tokens/s \(\+\d+\.\d cached\)", ln) for ln in stats), stats[0]


def test_sigterm_drains_then_aborts_and_exits_0(ops):
    """8 streams and 8 non-streamed requests in flight (16 slots: none waits behind the long ones for a slot
    that frees only at the abort), half of them too long to finish: SIGTERM makes new
    requests 503 at once, the short ones finish, the long ones end with finish_reason "abort" and [DONE] (or
    a JSON 503) after the drain timeout; the server exits 0 without a traceback."""
    base = f"http://127.0.0.1:{ops.port}"
    auth = {"Authorization": f"Bearer {KEY}"}

    def body(i, stream):
        return {"model": "tiny", "prompt": [5 + i, 6, 7], "max_tokens": LONG if i % 2 else 16, "temperature": 0,
                "ignore_eos": True, "stream": stream}

    async def stream(c, i):
        lines = []
        async with c.stream("POST", f"{base}/v1/completions", json=body(i, True)) as r:
            assert r.status_code == 200
            async for ln in r.aiter_lines():
                if ln:
                    lines.append(ln)
        assert lines[-1] == "data: [DONE]", lines[-3:]
        chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
        reasons = [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"][0]["finish_reason"]]
        return reasons, sum(len(ch["choices"][0]["token_ids"]) for ch in chunks)

    async def whole(c, i):
        r = await c.post(f"{base}/v1/completions", json=body(i, False))
        if r.status_code == 503:
            assert r.json()["error"]["code"] == "server_shutting_down"
            return ["503"], 0
        assert r.status_code == 200, r.text
        return [r.json()["choices"][0]["finish_reason"]], r.json()["usage"]["completion_tokens"]

    async def main():
        async with httpx.AsyncClient(timeout=120, headers=auth) as c:
            tasks = [asyncio.ensure_future(stream(c, i)) for i in range(8)] + \
                    [asyncio.ensure_future(whole(c, i)) for i in range(8)]
            t0 = time.time()
            while metric(ops.port, "k2jax_slots_in_use") < 8:
                assert time.time() - t0 < 60
                await asyncio.sleep(0.01)
            ops.proc.send_signal(signal.SIGTERM)
            sent = time.time()
            await asyncio.sleep(0.3)
            late = await c.post(f"{base}/v1/completions", json=body(0, False))
            health = await c.get(f"{base}/health")
            return await asyncio.gather(*tasks), late, health, sent

    results, late, health, sent = asyncio.run(main())
    try:
        rc = ops.proc.wait(timeout=DRAIN_S + 30)
    except subprocess.TimeoutExpired:
        raise AssertionError("the server did not exit after SIGTERM") from None
    took = time.time() - sent
    assert late.status_code == 503 and late.json()["error"]["code"] == "server_shutting_down"
    assert health.status_code == 503
    short = [r for i, r in enumerate(results) if i % 2 == 0]
    long = [r for i, r in enumerate(results) if i % 2 == 1]
    assert all(reasons == ["length"] and n == 16 for reasons, n in short), short
    assert all(reasons in (["abort"], ["503"]) for reasons, _ in long), long
    assert sum(reasons == ["abort"] for reasons, _ in long) == 4  # the four streams
    log = ops.log()
    assert rc == 0, log[-3000:]
    assert "Traceback" not in log and "Error" not in log.split("draining")[1], log[-3000:]
    assert "SIGTERM: draining" in log and "aborting 8 requests" in log
    assert took < DRAIN_S + 15, f"exited {took:.1f} s after SIGTERM"


# --- sampling on the demo model -------------------------------------------------------------------------

@pytest.mark.slow
def test_frequency_penalty_lowers_repetition_on_the_demo_model(tmp_path):
    """The same seed with and without a high frequency_penalty: fewer repeated tokens with it."""
    port = free_port()
    argv = [sys.executable, "-m", "k2jax.cli", "serve", "--demo", "--port", str(port), "--max-batch", "2",
            "--max-len", "192", "--prefill-chunk", "64"]
    s = Server(argv, port, tmp_path / "out.log")
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        kw = dict(model="k2jax-demo", prompt="The quick brown fox", max_tokens=128, temperature=0.7, seed=3,
                  extra_body={"ignore_eos": True})
        plain = c.completions.create(**kw).choices[0].token_ids
        penalized = c.completions.create(frequency_penalty=2.0, **kw).choices[0].token_ids
        repeats = lambda ids: len(ids) - len(set(ids))  # noqa: E731
        assert repeats(plain) > 0, "no repetition to lower: a blind test"
        assert repeats(penalized) < repeats(plain), (repeats(penalized), repeats(plain))
    finally:
        s.stop()
