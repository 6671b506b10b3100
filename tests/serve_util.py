"""Shared by the serving tests: a small FP8 checkpoint and tokenizer written by the test, `k2jax serve` on it
as a subprocess on a free loopback port, and the solo reference (k2jax.generate) on the same weights."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import subprocess
import sys
import time
import urllib.request

from tests.conftest import CONFIGS, REPO
from tests.processes import free_port  # noqa: F401  (the serving tests' import)

TINY = json.loads((CONFIGS / "tiny.json").read_text())
CFG = TINY | {"vocab_size": 1024}  # room for the demo tokenizer's 1012 ids
MERGES = 500
START_TIMEOUT_S = 420  # load + compile; several minutes on 2 busy cores
NMAX = 32  # the most tokens a test asks for



def stream_in_background(port: int, body: dict, timeout: float = 120):
    """POST a streamed /v1/completions `body` on a thread; return once its first line came ->
    (the non-empty lines so far and as they come, the thread: join it for the rest)."""
    import threading

    import httpx

    lines, started = [], threading.Event()

    def read():
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=timeout) as r:
            for ln in r.iter_lines():
                if ln:
                    lines.append(ln)
                    started.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(60), "no line of the stream within 60 s"
    return lines, reader


def write_model(root):
    """-> (checkpoint dir, tokenizer dir) under root."""
    from k2jax.testing import write_release_checkpoint
    from tests.bpe import write_test_tokenizer

    ckpt = write_release_checkpoint(CFG, root / "ckpt", seed=0, fast=True)
    tok = write_test_tokenizer(root / "tok", num_merges=MERGES)
    return ckpt, tok


def env(devices: int = 1) -> dict:
    e = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return e | {"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu",
                "PYTHONPATH": str(REPO)}


def serve_argv(ckpt, tok, port, *extra) -> list[str]:
    return [sys.executable, "-m", "k2jax.cli", "serve", "--hf-checkpoint", str(ckpt), "--tokenizer", str(tok),
            "--dtype", "float32", "--port", str(port), "--model-name", "tiny", *extra]


def wait_ready(port: int, procs, timeout: float = START_TIMEOUT_S) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"server exited with {p.returncode}:\n{p.stdout.read()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except http.client.HTTPException as e:  # something else holds the port
            raise RuntimeError(f"port {port} answers, but not as the server's HTTP: {e!r}") from e
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"server not up after {timeout} s")


@contextlib.contextmanager
def running(argvs, port, devices=1):
    """Start the processes (one argv each), wait for /health on `port`; kill them all on exit."""
    procs = [subprocess.Popen(a, env=env(devices), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for a in argvs]
    ok = False
    try:
        wait_ready(port, procs)
        yield procs
        ok = True
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=60 if ok else 10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    # a server stopped by SIGTERM shuts down cleanly (engine stopped, exit status 0)
    assert [p.returncode for p in procs] == [0] * len(procs), [p.returncode for p in procs]


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise KeyError(name)


class Solo:
    """Each prompt alone through k2jax.generate on the checkpoint (greedy, float32; weights held as load_hf's
    `quant` holds them), cached."""

    def __init__(self, ckpt, quant=None):
        import jax.numpy as jnp

        import k2jax

        self.cfg, params = k2jax.load_hf(ckpt, dtype=jnp.float32, quant=quant)
        self.model = k2jax.K2Model(self.cfg, jnp.float32)
        self.params = params
        self._memo = {}

    def __call__(self, prompt, n, stop_ids=()) -> list[int]:
        """The first n greedy tokens, cut after the first of stop_ids. Greedy continuations are prefixes of
        each other, so one generate of NMAX tokens per prompt serves every n (and compiles once per bucket)."""
        import k2jax

        if n > NMAX:
            raise ValueError(f"n={n} > NMAX={NMAX}")
        key = tuple(prompt)
        if key not in self._memo:
            out, _ = k2jax.generate(self.model, self.params, [list(prompt)], NMAX)
            self._memo[key] = [int(t) for t in out[0]]
        toks = self._memo[key][:n]
        for i, t in enumerate(toks):
            if t in stop_ids:
                return toks[:i + 1]
        return toks


def chat_ids(tok, messages, **kw) -> list[int]:
    """The prompt ids the server builds for chat messages with the built-in K2 template (the test tokenizer
    directory has no chat_template of its own)."""
    from k2jax.serving.chat_template import ChatTemplate

    return tok.encode(ChatTemplate.builtin().render(messages, **kw), allow_special=True)


@contextlib.contextmanager
def demo_server(*extra):
    """`k2jax serve --demo --dtype float32` (the demo's random model; float32: a seed's tokens do not depend on
    the batch) with the flags `extra`, on a free port; -> the port."""
    port = free_port()
    argv = [sys.executable, "-m", "k2jax.cli", "serve", "--demo", "--dtype", "float32", "--port", str(port), *extra]
    with running([argv], port):
        yield port
