"""What `k2jax serve` logs while it runs: an access line per request and a stats line every few seconds
while busy. Both go to the "k2jax.serve" logger (stderr, set up by the server).

Access line: client, method, path, status, prompt and completion tokens and time to first token (requests
that generate), total time (for a stream, until its last byte), and an error's message, e.g.
    127.0.0.1:50312 "POST /v1/completions" 200 prompt_tokens=11 completion_tokens=12 ttft=0.041s total=0.385s
    127.0.0.1:50318 "POST /v1/completions" 400 total=0.001s error="top_p: must be in (0, 1], got 2"
A handler reports its tokens by setting `request.state.usage = {"prompt_tokens", "completion_tokens",
"ttft"}` (starlette keeps request.state in the ASGI scope, where this middleware reads it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

LOGGER = "k2jax.serve"


class AccessLog:
    """ASGI middleware: one log line per HTTP request, written when its response has been sent."""

    def __init__(self, app, logger: logging.Logger | None = None, enabled: bool = True):
        self.app, self.log, self.enabled = app, logger or logging.getLogger(LOGGER), enabled

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.enabled:
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        state = scope.setdefault("state", {})
        status, logged, err = [500], [False], bytearray()

        def line():
            logged[0] = True
            client = scope.get("client")
            parts = [f'{client[0]}:{client[1]}' if client else "-", f'"{scope["method"]} {scope["path"]}"',
                     str(status[0])]
            u = state.get("usage")
            if u:
                parts += [f"prompt_tokens={u['prompt_tokens']}", f"completion_tokens={u['completion_tokens']}",
                          f"ttft={u['ttft']:.3f}s" if u.get("ttft") is not None else "ttft=-"]
            parts.append(f"total={time.perf_counter() - t0:.3f}s")
            if err:
                parts.append(f"error={json.dumps(_message(bytes(err)))}")
            self.log.info(" ".join(parts))

        async def logged_send(msg):
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            elif msg["type"] == "http.response.body" and status[0] >= 400 and len(err) < 4096:
                err.extend(msg.get("body", b""))
            await send(msg)
            if msg["type"] == "http.response.body" and not msg.get("more_body") and not logged[0]:
                line()

        try:
            await self.app(scope, receive, logged_send)
        finally:
            if not logged[0]:  # the app raised, or the client went away mid-response
                line()


def _message(body: bytes) -> str:
    """An error response's message (OpenAI's {"error": {"message"}}), else its start."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:200].decode("utf-8", errors="replace")


async def stats_loop(metrics, interval_s: float, logger: logging.Logger | None = None) -> None:
    """Every interval_s, while requests run or wait (or tokens flowed since the last line): running,
    waiting, prompt tokens/s prefilled and served from the prefix cache, generation tokens/s, over the
    interval, and the cache in use."""
    log = logger or logging.getLogger(LOGGER)

    def counts():
        return time.perf_counter(), metrics.prompt_prefilled, metrics.cached_prompt_tokens, metrics.generation_tokens

    last = counts()
    while True:
        await asyncio.sleep(interval_s)
        now = counts()
        dt = max(now[0] - last[0], 1e-9)
        p, c, g = ((a - b) / dt for a, b in zip(now[1:], last[1:]))
        if metrics.slots_in_use or metrics.queue_depth or now[1:] != last[1:]:
            log.info(f"stats: running {metrics.slots_in_use}, waiting {metrics.queue_depth}, prompt {p:.1f} tokens/s "
                     f"(+{c:.1f} cached), generation {g:.1f} tokens/s, cache {100 * metrics.cache_usage:.1f}% in "
                     f"use ({metrics.slots_in_use}/{metrics.max_batch} slots)")
        last = now
