"""The OpenAI-compatible HTTP API (FastAPI): /v1/models, /v1/completions, /v1/chat/completions (streaming as
server-sent events), /health and /metrics. Handlers validate a request, hand it to the engine thread and
wait for its events on an asyncio queue; a bad request gets an OpenAI-style error naming the field.

Extensions beyond OpenAI's fields (as vLLM names them): `top_k`, `stop_token_ids`, `ignore_eos`; every
choice also carries the generated `token_ids`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from k2jax.serving.engine import Engine, Event, QueueFull, Request, SamplingParams

RETRY_AFTER_S = 1
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


def error_response(status: int, message: str, param=None, code=None, headers=None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


def make_app(engine: Engine, tokenizer, model_name: str) -> FastAPI:
    """The app for `engine` (its thread started by the caller). tokenizer: k2jax.tokenizer.KimiTokenizer or
    None (then prompts must be token ids and chat is refused)."""
    app = FastAPI(title="k2jax serve")
    metrics = engine.metrics
    created = int(time.time())

    @app.exception_handler(BadRequest)
    async def _bad(_, e: BadRequest):
        metrics.errors += 1
        return error_response(e.status, e.message, e.param, e.code)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "k2jax", "max_model_len": engine.max_len}]}

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        body = await _json(http)
        _check_model(body, model_name)
        prompt = _prompt_ids(body, tokenizer, engine)
        params = _sampling(body, len(prompt), engine, tokenizer, chat=False)
        return await _run(http, engine, prompt, params, body, model_name, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(http: HTTPRequest):
        body = await _json(http)
        _check_model(body, model_name)
        if tokenizer is None:
            raise BadRequest("chat needs a tokenizer: start the server with --tokenizer DIR", "messages")
        prompt = _chat_ids(body, tokenizer, engine)
        params = _sampling(body, len(prompt), engine, tokenizer, chat=True)
        return await _run(http, engine, prompt, params, body, model_name, chat=True)

    return app


async def _json(http: HTTPRequest) -> dict:
    raw = await http.body()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"malformed JSON in the request body: {e}", None) from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object", None)
    return body


def _check_model(body, name):
    m = body.get("model")
    if m is not None and m != name:
        raise BadRequest(f"model {m!r} does not exist; this server serves {name!r}", "model", 404, "model_not_found")


def _prompt_ids(body, tok, engine) -> list[int]:
    if "prompt" not in body or body["prompt"] is None:
        raise BadRequest("prompt: required", "prompt")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        if tok is None:
            raise BadRequest("prompt: text needs a tokenizer (--tokenizer DIR); send token ids instead", "prompt")
        ids = tok.encode(p)
    elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        ids = list(p)
    else:
        raise BadRequest("prompt: expected a string or a list of token ids (one prompt per request)", "prompt")
    _check_prompt(ids, engine, "prompt")
    return ids


def _check_prompt(ids, engine, field):
    if not ids:
        raise BadRequest(f"{field}: empty", field)
    vocab = engine.model.cfg.vocab_size
    if any(not 0 <= t < vocab for t in ids):
        raise BadRequest(f"{field}: token ids must be in [0, {vocab})", field)
    if len(ids) >= engine.max_len:
        raise BadRequest(f"{field}: {len(ids)} tokens; this server's max_len is {engine.max_len} (prompt and "
                         f"completion together)", field, code="context_length_exceeded")


def _chat_ids(body, tok, engine) -> list[int]:
    msgs = body.get("messages")
    if msgs is None:
        raise BadRequest("messages: required", "messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("messages: expected a non-empty list of {role, content}", "messages")
    clean = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or "role" not in m:
            raise BadRequest(f"messages[{i}]: expected an object with role and content", f"messages[{i}]")
        c = m.get("content") or ""
        if isinstance(c, list):  # content parts: text only
            if any(not isinstance(x, dict) or x.get("type") != "text" for x in c):
                raise BadRequest(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
            c = "".join(x.get("text", "") for x in c)
        if not isinstance(c, str):
            raise BadRequest(f"messages[{i}].content: expected a string", f"messages[{i}].content")
        clean.append({"role": m["role"], "content": c})
    try:
        ids = tok.apply_chat_template(clean)
    except ValueError as e:
        raise BadRequest(f"messages: {e}", "messages") from None
    _check_prompt(ids, engine, "messages")
    return ids


def _number(body, name, default, lo=None, hi=None, lo_open=False, integer=False):
    v = body.get(name)
    if v is None:
        return default
    ok_type = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok_type:
        raise BadRequest(f"{name}: expected {'an integer' if integer else 'a number'}, got {v!r}", name)
    if (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi):
        rng = f"{'(' if lo_open else '['}{lo}, {hi if hi is not None else 'inf'}]"
        raise BadRequest(f"{name}: must be in {rng}, got {v}", name)
    return v


def _sampling(body, n_prompt, engine, tok, chat: bool) -> SamplingParams:
    n = body.get("n")
    if n is not None and n != 1:
        raise BadRequest(f"n: only n=1 is supported, got {n!r}", "n")
    room = engine.max_len - n_prompt
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, key, room if chat else min(DEFAULT_COMPLETION_MAX_TOKENS, room), lo=1, integer=True)
    if max_tokens > room:
        raise BadRequest(f"{key}: prompt ({n_prompt} tokens) + {key} ({max_tokens}) exceeds this server's "
                         f"max_len of {engine.max_len} tokens", key, code="context_length_exceeded")
    temperature = _number(body, "temperature", 1.0, lo=0)  # OpenAI's default
    top_p = _number(body, "top_p", 1.0, lo=0, hi=1, lo_open=True)
    top_k = _number(body, "top_k", 0, lo=-1, hi=engine.model.cfg.vocab_size, integer=True)
    seed = _number(body, "seed", 0, integer=True)
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop = tuple(stop)
    else:
        raise BadRequest("stop: expected a string or a list of strings", "stop")
    if any(s == "" for s in stop):
        raise BadRequest("stop: empty stop strings are not allowed", "stop")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or any(not isinstance(t, int) for t in stop_ids):
        raise BadRequest("stop_token_ids: expected a list of token ids", "stop_token_ids")
    if not body.get("ignore_eos") and tok is not None:
        stop_ids = stop_ids + (tok.stop_ids if chat else [tok.eos_id])
    for f in ("stream",):
        if body.get(f) is not None and not isinstance(body[f], bool):
            raise BadRequest(f"{f}: expected true or false", f)
    return SamplingParams(max_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p),
                          top_k=max(int(top_k), 0), seed=int(seed), stop_ids=tuple(stop_ids), stop=stop)


async def _run(http, engine: Engine, prompt, params, body, model_name, chat: bool):
    loop = asyncio.get_running_loop()
    q: asyncio.Queue[Event] = asyncio.Queue()
    req = Request(prompt, params, lambda ev: loop.call_soon_threadsafe(q.put_nowait, ev))
    try:
        engine.submit(req)
    except QueueFull as e:
        return error_response(429, f"the server is busy ({e}); retry later", None, "queue_full",
                              headers={"Retry-After": str(RETRY_AFTER_S)})
    except ValueError as e:
        raise BadRequest(str(e), str(e).split(":")[0]) from None
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    usage = lambda ev: {"prompt_tokens": ev.prompt_tokens, "completion_tokens": ev.completion_tokens,  # noqa: E731
                        "total_tokens": ev.prompt_tokens + ev.completion_tokens}
    if body.get("stream"):
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(_stream(engine, req, q, rid, created, model_name, chat, include_usage, usage),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    events = []
    while not (events and events[-1].finish_reason):
        try:
            events.append(await asyncio.wait_for(q.get(), 0.5))
        except asyncio.TimeoutError:
            if await http.is_disconnected():
                engine.cancel(req)
                return error_response(499, "client closed the request")
    last = events[-1]
    text, ids = "".join(e.text for e in events), [t for e in events for t in e.token_ids]
    choice = {"index": 0, "finish_reason": last.finish_reason, "logprobs": None, "token_ids": ids}
    choice |= {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model_name, "choices": [choice], "usage": usage(last)}


async def _stream(engine, req, q, rid, created, model_name, chat, include_usage, usage):
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text, ids, finish, first=False):
        choice = {"index": 0, "finish_reason": finish, "logprobs": None, "token_ids": ids}
        if chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text or not finish
                                                                            else {})
            choice["delta"] = delta
        else:
            choice["text"] = text
        return "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": model_name,
                                      "choices": [choice]}) + "\n\n"

    done = False
    try:
        if chat:
            yield chunk("", [], None, first=True)
        while True:
            ev = await q.get()
            if ev.finish_reason:
                done = True
                if ev.text or ev.token_ids:
                    yield chunk(ev.text, ev.token_ids, None)
                yield chunk("", [], ev.finish_reason)
                if include_usage:
                    yield "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": model_name,
                                                 "choices": [], "usage": usage(ev)}) + "\n\n"
                yield "data: [DONE]\n\n"
                return
            if ev.text or ev.token_ids:
                yield chunk(ev.text, ev.token_ids, None)
    finally:
        if not done:  # the client went away (or the server is stopping): free the slot
            engine.cancel(req)
