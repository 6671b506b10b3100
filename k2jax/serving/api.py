"""The OpenAI-compatible HTTP API (FastAPI): /v1/models[/{id}], /v1/completions, /v1/chat/completions
(streaming as server-sent events), /tokenize and /detokenize (vLLM's shapes), /health, /metrics, /version.

Handlers parse a body (k2jax.serving.openai_fields: every field understood or refused with a 400 naming it),
hand one engine request per choice to the engine thread, and wait for their events on an asyncio queue; a
non-streamed request also watches its connection, so a client that goes away frees its slots at the next
engine step. Responses are built by k2jax.serving.responses.

Around the routes: `--api-key` (a Bearer token on everything but /health, /metrics and /version, with
OpenAI's 401), the drain at shutdown (new requests get 503 while the running ones finish; the server's
ServeState), and an access log line per request (k2jax.serving.oplog).

Chat requests go through the server's chat template (with tools, tool messages, assistant tool_calls, the
developer role and chat_template_kwargs), and their output through K2's tool-call and reasoning parsers when
they ask for it (k2jax.serving.chat_request): the message gets `tool_calls` (ids `functions.NAME:IDX`,
counted by the grammar; finish_reason "tool_calls") and `reasoning_content` apart from `content`, and a
stream sends OpenAI's deltas for them. Tools (tool_choice "auto" from the section on, "required", a named
function) and response_format are decoded under a grammar (k2jax.serving.grammar). `k2jax_prompt_tokens_total`
counts each accepted request's usage.prompt_tokens.

Extensions beyond OpenAI's fields (as vLLM names them): `top_k`, `min_p`, `repetition_penalty`, `min_tokens`,
`stop_token_ids`, `ignore_eos`, `skip_special_tokens`, `chat_template_kwargs`; every choice also carries the
generated `token_ids` (special tokens included: a tool-call section's markers are there).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from k2jax.serving import chat_request
from k2jax.serving import openai_fields as fields
from k2jax.serving.chat_template import ChatTemplate
from k2jax.runtime.detok import TokenText
from k2jax.runtime.engine import Engine
from k2jax.runtime.requests import EngineStopped, QueueFull, Request
from k2jax.serving.oplog import AccessLog
from k2jax.serving.openai_fields import BadRequest
from k2jax.serving.responses import Choice, Chunks, Names, response

RETRY_AFTER_S = 1
OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})  # no API key, and answered while draining


class ServeState:
    """Shared by the app and the server's shutdown: `draining` (new requests get 503) and `inflight` (HTTP
    requests past the guard and not yet answered)."""

    def __init__(self):
        self.draining = False
        self.inflight = 0


def error_response(status: int, message: str, param=None, code=None, headers=None, kind=None) -> JSONResponse:
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


class Guard:
    """ASGI middleware: the API key, the drain's 503, and the count of requests in flight."""

    def __init__(self, app, state: ServeState, api_key: str | None):
        self.app, self.state = app, state
        self.key = api_key.encode() if api_key else None

    def _authorized(self, scope) -> bool:
        auth = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        if self.key is not None and not self._authorized(scope):
            r = error_response(401, "Incorrect or missing API key: send the header 'Authorization: Bearer KEY' "
                                    "with the key the server was started with (--api-key)",
                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            return await r(scope, receive, send)
        if self.state.draining:
            r = error_response(503, "the server is shutting down and takes no new requests",
                               code="server_shutting_down")
            return await r(scope, receive, send)
        self.state.inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.inflight -= 1


def make_app(engine: Engine, tokenizer, model_name: str, *, chat_template: ChatTemplate | None = None,
             api_key: str | None = None, state: ServeState | None = None, access_log: bool = True,
             logger=None) -> FastAPI:
    """The app for `engine` (its thread started by the caller). tokenizer: k2jax.tokenizer.KimiTokenizer or
    None (then prompts must be token ids, and chat, echo of token ids and /tokenize are refused).
    chat_template: how chat messages become a prompt (default: the built-in K2 template). Structured output
    uses the engine's grammar compiler (engine.grammars)."""
    from k2jax import __version__

    app = FastAPI(title="k2jax serve")
    state = state or ServeState()
    app.state.serve = state
    app.add_middleware(Guard, state=state, api_key=api_key)
    app.add_middleware(AccessLog, logger=logger, enabled=access_log)  # outermost: logs the guard's answers too
    metrics = engine.metrics
    created = int(time.time())
    template = chat_template or (ChatTemplate.from_tokenizer_dir(None) if tokenizer is not None else None)
    table = engine.detok or (TokenText(tokenizer) if tokenizer is not None else None)
    names = Names(table)
    limits = fields.Limits(engine.model.cfg.vocab_size, engine.max_len, engine.max_batch + engine.max_queue)
    model_card = {"id": model_name, "object": "model", "created": created, "owned_by": "k2jax",
                  "max_model_len": engine.max_len}

    @app.exception_handler(BadRequest)
    async def _bad(_, e: BadRequest):
        metrics.errors += 1
        return error_response(e.status, e.message, e.param, e.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, e: StarletteHTTPException):
        metrics.errors += 1
        return error_response(e.status_code, str(e.detail), headers=getattr(e, "headers", None))

    @app.get("/health")
    async def health():
        if engine.failed is not None:
            return JSONResponse({"status": "error", "error": engine.failed}, status_code=503)
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != model_name:
            raise BadRequest(f"model {model_id!r} does not exist; this server serves {model_name!r}", "model", 404,
                             "model_not_found")
        return model_card

    @app.post("/tokenize")
    async def tokenize(http: HTTPRequest):
        body = await _json(http)
        fields.check_fields(body, frozenset({"model", "prompt", "messages", "tools", "chat_template_kwargs",
                                        "add_special_tokens", "add_generation_prompt", "return_token_strs"}))
        _check_model(body, model_name)
        if tokenizer is None:
            raise BadRequest("tokenize needs a tokenizer: start the server with --tokenizer DIR", None)
        fields.flag(body, "add_special_tokens")  # Kimi's tokenizer adds none to text: nothing to add either way
        if ("prompt" in body) == ("messages" in body):
            raise BadRequest("prompt: give exactly one of prompt (text) or messages (chat)", "prompt")
        if "prompt" in body:
            text = body["prompt"]
            if not isinstance(text, str):
                raise BadRequest("prompt: expected a string", "prompt")
            for k in ("tools", "chat_template_kwargs", "add_generation_prompt"):
                if k in body:
                    raise BadRequest(f"{k}: only with messages", k)
            ids = tokenizer.encode(text)
        else:  # exactly the prompt a chat request with these fields runs
            try:
                _, ids = chat_request.render(template, tokenizer, body, fields.flag(body, "add_generation_prompt", True))
            except chat_request.FieldError as e:
                raise BadRequest(str(e), e.param) from None
        strs = [names.text(i) for i in ids] if fields.flag(body, "return_token_strs") else None
        return {"count": len(ids), "max_model_len": engine.max_len, "tokens": ids, "token_strs": strs}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        """vLLM's: what a client needs to tokenize as the server does (lm-evaluation-harness's remote
        tokenizer reads it, then /tokenize and /detokenize)."""
        if tokenizer is None:
            raise BadRequest("tokenizer_info needs a tokenizer: start the server with --tokenizer DIR", None, 404)
        specials = {i: name for name, i in tokenizer.special_tokens.items()}
        return {"tokenizer_class": "TikTokenTokenizer", "bos_token": specials.get(tokenizer.bos_id),
                "eos_token": specials.get(tokenizer.eos_id), "pad_token": None,
                "chat_template": template.source if template is not None else None,
                "model_max_length": engine.max_len, "vocab_size": limits.vocab_size}

    @app.post("/detokenize")
    async def detokenize(http: HTTPRequest):
        body = await _json(http)
        fields.check_fields(body, frozenset({"model", "tokens"}))
        _check_model(body, model_name)
        if table is None:
            raise BadRequest("detokenize needs a tokenizer: start the server with --tokenizer DIR", None)
        return {"prompt": table.decode(fields.token_ids(body.get("tokens"), "tokens", limits.vocab_size))}

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        t0 = time.perf_counter()
        body = await _json(http)
        _check_model(body, model_name)
        job = fields.parse_completion(body, tokenizer, limits)
        return await _generate(http, engine, state, job, t0, model_name, names, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(http: HTTPRequest):
        t0 = time.perf_counter()
        body = await _json(http)
        _check_model(body, model_name)
        # In a thread: rendering, tokenizing and a first grammar compile take a while for long prompts.
        job = await asyncio.to_thread(fields.parse_chat, body, tokenizer, limits, template, engine.grammars)
        return await _generate(http, engine, state, job, t0, model_name, names, chat=True)

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


async def _watch_disconnect(http: HTTPRequest, q: asyncio.Queue) -> None:
    """Put (None, None) on q when the client closes the connection (the body has been read, so the next
    ASGI message is the disconnect)."""
    while True:
        msg = await http.receive()
        if msg["type"] == "http.disconnect":
            q.put_nowait((None, None))
            return


async def _generate(http, engine: Engine, state: ServeState, job: fields.Job, t0: float, model_name: str,
                    names: Names, chat: bool):
    """Run a parsed request: one engine request per choice; -> the response (streamed or whole)."""
    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()
    metrics = engine.metrics

    def callback(index):
        def on_event(ev):  # on the engine thread
            try:
                loop.call_soon_threadsafe(q.put_nowait, (index, ev))
            except RuntimeError:  # the event loop is closed: nobody waits for this request any more
                pass
        return on_event

    specs = job.choices()
    reqs = [Request(job.prompts[j], p, callback(k)) for k, j, p in specs]
    choices = [Choice(k, len(job.prompts[j]), p.logprobs is not None, _echo(job, j, names), job.chat,
                      job.prompts[j], job.echo_logprobs, job.prompt_logprobs)
               for k, j, p in specs]
    prompt_tokens = sum(len(p) for p in job.prompts)
    if state.draining:  # parsed while the drain began
        return error_response(503, "the server is shutting down and takes no new requests",
                              code="server_shutting_down")
    try:
        engine.submit(*reqs)
    except EngineStopped as e:
        return error_response(503, f"{e}; the server is shutting down", code="engine_stopped")
    except QueueFull as e:
        return error_response(429, f"the server is busy ({e}); retry later", None, "queue_full",
                              headers={"Retry-After": str(RETRY_AFTER_S)}, kind="rate_limit_exceeded")
    except ValueError as e:
        raise BadRequest(str(e), str(e).split(":")[0]) from None
    metrics.prompt_tokens += prompt_tokens  # as the usage reports them
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    first = []  # the time of the first token of any choice

    def record(k, ev) -> bool:
        """Take one event: timings into the metrics, the event into its choice; -> whether it finished it."""
        now = time.perf_counter()
        c = choices[k]
        if ev.token_ids:
            if c.last_t is not None:
                for _ in ev.token_ids:
                    metrics.observe_itl((now - c.last_t) / len(ev.token_ids))
            c.last_t = now
            first[:] = first or [now]
        c.add(ev)
        if ev.finish_reason:
            metrics.observe_e2e(now - t0)
        http.state.usage = {"prompt_tokens": prompt_tokens, "completion_tokens": sum(x.completion_tokens
                                                                                     for x in choices),
                            "ttft": first[0] - t0 if first else None}
        return bool(ev.finish_reason)

    http.state.usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "ttft": None}
    watcher = asyncio.ensure_future(_watch_disconnect(http, q))
    if job.stream:
        chunks = Chunks(rid, created, model_name, chat, names)
        return StreamingResponse(_stream(engine, reqs, choices, q, watcher, record, chunks, job, prompt_tokens),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    left = len(reqs)
    try:
        while left:
            k, ev = await q.get()
            if k is None:  # the client went away: free the slots at the next step
                return error_response(499, "client closed the request")
            left -= record(k, ev)
    finally:
        watcher.cancel()
        if left:
            for r in reqs:
                engine.cancel(r)
    if any(c.finish_reason == "abort" for c in choices):
        return error_response(503, "the server shut down before the request finished: aborted after "
                                   f"{sum(c.completion_tokens for c in choices)} tokens", code="server_shutting_down")
    return JSONResponse(response(rid, created, model_name, chat, choices, prompt_tokens, names))


def _echo(job: fields.Job, j: int, names: Names) -> str:
    if not job.echo:
        return ""
    return job.prompt_texts[j] if job.prompt_texts[j] is not None else names.table.decode(job.prompts[j])


async def _stream(engine, reqs, choices, q, watcher, record, chunks: Chunks, job: fields.Job, prompt_tokens: int):
    """The server-sent events of a streamed request: each choice's chunks as its tokens come, a last chunk
    with its finish_reason ("abort" when the server shuts down first), the usage if asked, then [DONE]."""
    left = len(reqs)
    try:
        for c in choices:
            if (s := chunks.first(c)) is not None:
                yield s
        while left:
            k, ev = await q.get()
            if k is None:  # the client went away
                return
            left -= record(k, ev)
            for s in chunks.prompt_scores(choices[k], ev):
                yield s
            if ev.text or ev.token_ids or ev.finish_reason:
                for s in chunks.event(choices[k], ev):
                    yield s
        if job.include_usage:
            yield chunks.usage(prompt_tokens, choices)
        yield chunks.done()
    finally:
        watcher.cancel()
        if left:  # the client went away (or the response was cancelled): free the slots
            for r in reqs:
                engine.cancel(r)
