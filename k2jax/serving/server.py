"""`k2jax serve`: claim the port, load a model, warm the engine up (every step compiled before the first
request), run the engine loop in its own thread and the HTTP server (uvicorn) in the main one.

- The listening socket is bound before anything is loaded, so a port in use fails at once, naming it; uvicorn
  is handed that socket.
- SIGTERM (or SIGINT) drains: new requests get 503, running ones may finish for up to --drain-timeout
  seconds, the rest end with finish_reason "abort" (a streamed one gets its last chunk and [DONE], a whole
  one a JSON 503); then the server stops and exits 0. A second signal aborts at once.
- Logs ("k2jax.serve", stderr): resolved dtypes at start-up, "compiling k/n" as each step program begins
  compiling during warm-up (with the time since it began), an access line per request and a stats line every
  --stats-interval seconds while busy (k2jax.serving.oplog).

Multi-host (jax.distributed): every process runs the engine loop over the global mesh; process 0 also runs
HTTP and, each step, broadcasts the requests it admitted and the cancellations (k2jax.serving.multihost),
so every process steps the same program. Only process 0 answers; the others ignore SIGTERM and stop when
process 0 does.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import signal
import socket
import sys
import threading
import time

from k2jax.serving.oplog import LOGGER

ABORT_WAIT_S = 10.0  # after the abort, how long the drain waits for the aborted answers to be sent


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", metavar="DIR", help="a converted k2jax checkpoint (k2jax convert): a directory "
                                                         "or gs://BUCKET/PATH")
    src.add_argument("--hf-checkpoint", metavar="DIR",
                     help="a HuggingFace checkpoint (safetensors, FP8 or not): a directory, gs://BUCKET/PATH or a "
                          "Hugging Face repo id; loaded on one device")
    src.add_argument("--demo", action="store_true",
                     help="serve a random-weight model of configs/bench.json's K2 shape (the demo's, vocabulary "
                          "1024) with a small synthetic tokenizer: nothing to download; the text is gibberish")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="directory with tiktoken.model and tokenizer_config.json, a gs:// URL of one, or a Hugging "
                        "Face repo id (without it, prompts must be token ids and chat is refused)")
    p.add_argument("--chat-template", metavar="FILE",
                   help="a jinja chat template that replaces the checkpoint's (default: the chat_template of "
                        "--tokenizer's tokenizer_config.json, or its chat_template.jinja, else the built-in K2 "
                        "template; --demo uses the built-in one)")
    p.add_argument("--model-name", help="the model id clients send (default: the checkpoint's directory name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--max-batch", type=int, default=8,
                   help="decode slots: requests decoded together (default 8; on a mesh, rounded up to a multiple of "
                        "the data-parallel shards, data x fsdp x expert)")
    p.add_argument("--max-len", type=int, default=4096,
                   help="most tokens of one request: prompt + completion (default 4096)")
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--kv-tokens", type=int,
                    help="size of the paged KV cache pool in tokens, over all requests (default: 90%% of the free "
                         "device memory after the weights where the devices report it; max-batch x max-len on CPU)")
    kv.add_argument("--kv-memory", type=float, metavar="GIB",
                    help="size of the paged KV cache pool in GiB per data-parallel shard, instead of --kv-tokens")
    p.add_argument("--page-size", type=int, default=64, help="tokens per page of the KV cache (default 64)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="do not reuse the cached pages of earlier prompts (the prefix cache is on by default)")
    p.add_argument("--compile-cache", metavar="DIR", default=None,
                   help="keep compiled programs in DIR, so that a restart with the same settings skips most of the "
                        "compiling (default: $JAX_COMPILATION_CACHE_DIR where set, else a folder per host CPU "
                        "under ~/.cache/k2jax/xla; 'none' turns it off)")
    p.add_argument("--prefill-chunk", type=int, default=512,
                   help="most prompt tokens prefilled per engine step while requests decode, so they keep going "
                        "(default 512)")
    p.add_argument("--idle-prefill-chunk", type=int, default=None, metavar="TOKENS",
                   help="most prompt tokens per engine step while no request decodes: a lone long prompt runs in "
                        "fewer, longer chunks, which take less time in all (default 4 x --prefill-chunk, at most "
                        "--max-len)")
    p.add_argument("--fixed-chunks", action="store_true",
                   help="while requests decode, prefill in chunks of --prefill-chunk tokens whatever they cost. By "
                        "default the server times its steps at start-up and cuts the chunks beside decoding requests "
                        "so that no step takes longer than a first chunk of --prefill-chunk tokens: a later chunk "
                        "also reads and attends over the whole cached prefix, and without the cut the decoding "
                        "requests wait up to about 2.5x as long per token while a long prompt prefills (at the cost "
                        "of more, smaller chunks for that prompt)")
    p.add_argument("--step-layout", choices=("auto", "ragged", "rectangular"), default="auto",
                   help="ragged: each engine step is one call over a flat batch of every decoding request's token "
                        "and the prompt chunks that fit, in a handful of programs whatever the cache lengths (on a "
                        "mesh, one segment of the batch per data-parallel shard, each over its own requests). "
                        "rectangular: one call per prompt chunk and one over the decoding rows, a program per "
                        "(rows, tokens, cache read) bucket; the step times are weighed as --fixed-chunks says. "
                        "auto (default): ragged")
    p.add_argument("--no-overlap", action="store_true",
                   help="read each step's sampled tokens before planning the next step. By default (ragged steps) "
                        "the engine plans and sends step n+1 while step n runs, and step n+1 takes its decoding "
                        "requests' tokens from step n on the device; the host reads them afterwards, for output. "
                        "With --speculative, a step that verifies drafts runs without overlap either way")
    p.add_argument("--speculative", choices=("ngram",), default=None,
                   help="speculative decoding: ngram = prompt lookup (each decoding request's last few tokens "
                        "looked up earlier in its own prompt and output; what followed them is drafted), and one "
                        "step verifies every request's drafts; the output is what it would be without (greedy: "
                        "the same tokens; sampling: the same distribution). Ragged steps only (one device). "
                        "Requests with a grammar or penalties are not sped up, and a step where one of them "
                        "decodes runs without drafts (default: off)")
    p.add_argument("--num-speculative-tokens", type=int, default=4, metavar="K",
                   help="most tokens drafted per request and step with --speculative (default 4)")
    p.add_argument("--prompt-lookup-max", type=int, default=3, metavar="N",
                   help="--speculative ngram: the longest suffix looked up, in tokens (default 3)")
    p.add_argument("--prompt-lookup-min", type=int, default=2, metavar="N",
                   help="--speculative ngram: the shortest suffix looked up (default 2: a single token recurs "
                        "too often to predict what follows it)")
    p.add_argument("--batch-wait-ms", type=float, default=20.0,
                   help="an idle server waits up to this long after a request for others arriving with it, so a "
                        "burst is prefilled in one batch (a wait also ends when a quarter of it passes with no new "
                        "arrival; 0 = none; default 20)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests waiting for a slot before new ones get 429 (default 256)")
    p.add_argument("--mesh", help="shard over a device mesh, e.g. expert=8 or data=2,expert=4 (with --checkpoint "
                                  "or --demo): experts on 'expert', slots split over 'data'")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="compute dtype (default: the checkpoint's; bfloat16 for --demo)")
    p.add_argument("--quant", default="none", choices=("none", "fp8", "int4"),
                   help="weights held quantized on device, dequantized at each matmul (k2jax.load's quant=): "
                        "none = every weight in --dtype (an FP8/INT4 checkpoint dequantized on load); fp8 = an "
                        "FP8 checkpoint's (or --checkpoint's --dtype float8 conversion's) e4m3 weights with their "
                        "128x128 block scales; int4 = the routed experts in 4 bits with a scale per 32 inputs (a "
                        "Kimi-K2-Thinking release as stored, an FP8 one requantized: lossy), the rest in --dtype. "
                        "With --demo the random weights are quantized so (default none)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "bfloat16", "float32", "float8"),
                   help="latent cache dtype (auto: the compute dtype); float8 = e4m3 with a per-token scale")
    p.add_argument("--json-whitespace", default="compact", choices=("compact", "spaced", "any"),
                   help="JSON whitespace under a grammar (response_format json_object / json_schema and tool-call "
                        "arguments), outside strings: compact = none (the default: a model left free pads every "
                        "gap it may); spaced = one optional space after ':' and ','; any = any JSON whitespace, at "
                        "most 16 characters per gap. A request may choose with \"json_whitespace\"")
    p.add_argument("--seed", type=int, default=0, help="seed of --demo's random weights (default 0)")
    p.add_argument("--api-key", default=os.environ.get("K2JAX_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on the API (/health, /metrics and /version stay open); "
                        "default: the K2JAX_API_KEY environment variable (which keeps the key out of the process "
                        "list), none = open")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds the running requests may take to finish before they are aborted "
                        "(new requests get 503 meanwhile; default 30)")
    p.add_argument("--stats-interval", type=float, default=10.0,
                   help="seconds between stats lines (running, waiting, tokens/s, cache use) while busy; 0 = none "
                        "(default 10)")
    p.add_argument("--no-access-log", action="store_true", help="no log line per request")
    from k2jax import distributed

    distributed.add_arguments(p)


def load_model(args):
    """-> (model, params, tokenizer or None, model name, mesh)."""
    import jax.numpy as jnp

    import k2jax
    from k2jax.tokenizer import KimiTokenizer, tokenizer_dir

    dtype = None if args.dtype == "auto" else jnp.dtype(args.dtype)
    quant = None if args.quant == "none" else args.quant
    if args.mesh and args.hf_checkpoint:
        raise ValueError("--mesh works with --checkpoint or --demo; --hf-checkpoint loads on one device")
    mesh = k2jax.make_mesh(args.mesh) if args.mesh else None
    tok = KimiTokenizer.from_dir(tokenizer_dir(args.tokenizer)) if args.tokenizer else None
    if args.demo:
        from k2jax.synthetic import demo_tokenizer, random_model

        cfg, params = random_model(None, dtype or jnp.bfloat16, args.seed, quant, mesh)
        tok = tok or demo_tokenizer()
        name = args.model_name or "k2jax-demo"
    elif args.checkpoint:
        cfg, params = k2jax.load(args.checkpoint, dtype=dtype, mesh=mesh, quant=quant)
        name = args.model_name or _name(args.checkpoint)
    else:
        cfg, params = k2jax.load_hf(args.hf_checkpoint, dtype=dtype, quant=quant)
        name = args.model_name or _name(args.hf_checkpoint)
    model = k2jax.K2Model(cfg, params["embed_tokens"].dtype)
    return model, params, tok, name, mesh


def engine_config(args):
    """The engine's settings (k2jax.runtime.settings.EngineConfig) from serve's flags (--kv-memory apart: it
    needs the model; see _run)."""
    from k2jax.runtime.settings import EngineConfig

    return EngineConfig(
        max_batch=args.max_batch, max_len=args.max_len, max_queue=args.max_queue, kv_tokens=args.kv_tokens,
        page_size=args.page_size, kv_cache_dtype=args.kv_cache_dtype, prefix_cache=not args.no_prefix_cache,
        batch_wait_s=args.batch_wait_ms / 1e3, prefill_chunk=args.prefill_chunk, idle_chunk=args.idle_prefill_chunk,
        stall_bound=not args.fixed_chunks, ragged=args.step_layout != "rectangular", overlap=not args.no_overlap,
        speculative=args.speculative, num_speculative_tokens=args.num_speculative_tokens,
        prompt_lookup=(args.prompt_lookup_min, args.prompt_lookup_max))


def use_compile_cache(directory: str | None) -> None:
    """Keep compiled programs on disk (jax's persistent compilation cache), so that a restart with the same
    settings loads them instead of compiling. Without a directory: jax's own JAX_COMPILATION_CACHE_DIR where
    set, else ~/.cache/k2jax/xla/<host CPU> (k2jax.runtime.compiles.host_cpu_key: a home directory shared by
    machines with different CPUs must not hand one's XLA:CPU programs to another); programs that took 0.5 s
    to compile or more, unless JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS says otherwise."""
    import jax

    from k2jax.runtime.compiles import host_cpu_key

    if directory == "none":
        return
    directory = (directory or os.environ.get("JAX_COMPILATION_CACHE_DIR")
                 or os.path.join(os.path.expanduser("~"), ".cache", "k2jax", "xla", host_cpu_key()))
    jax.config.update("jax_compilation_cache_dir", directory)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def chat_template(args):
    """The server's ChatTemplate (None without a tokenizer: chat is refused). Read before the model loads,
    so that a bad template fails at once."""
    from k2jax.serving.chat_template import ChatTemplate

    if args.tokenizer is None and not args.demo:
        if args.chat_template is not None:
            raise ValueError("--chat-template: chat needs a tokenizer; give --tokenizer DIR too")
        return None
    from k2jax.tokenizer import tokenizer_dir

    return ChatTemplate.from_tokenizer_dir(tokenizer_dir(args.tokenizer) if args.tokenizer else None, args.chat_template)


def _grammars(tok, cfg, whitespace: str = "compact"):
    """The structured-output compiler for this tokenizer and model (None without a tokenizer). Built once per
    server and shared by the engine (per-request matchers) and the API (a request's grammar is compiled, and
    cached, when it is parsed); its vocabulary view of the tokenizer is the costly part."""
    if tok is None:
        return None
    from k2jax.serving.grammar import GrammarCompiler, GrammarTokenizer

    if cfg.vocab_size < tok.vocab_size:
        raise ValueError(f"--tokenizer: {tok.vocab_size} ids, more than the model's vocab_size {cfg.vocab_size}: "
                         f"not this model's tokenizer")
    return GrammarCompiler(GrammarTokenizer(tok, cfg.vocab_size), whitespace=whitespace)


def _name(path) -> str:
    import pathlib

    s = str(path).rstrip("/")
    if s.startswith("gs://") or not os.path.exists(s):  # a URL or a repo id: its last part
        return s.rsplit("/", 1)[-1]
    return pathlib.Path(path).resolve().name


def bind(host: str, port: int) -> socket.socket:
    """The listening socket's address claimed (bound, not yet listening: connections are refused until the
    server is ready). Raises ValueError naming the port when it is taken."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r}: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart does not wait out TIME_WAIT
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ValueError(f"--port {port}: {host}:{port} is already in use (another server?); stop it or "
                             f"choose another --port") from None
        raise ValueError(f"--host {host} --port {port}: cannot listen there: {e.strerror or e}") from None
    return sock


def setup_logging(main: bool) -> logging.Logger:
    """The "k2jax.serve" logger on stderr: INFO on process 0, warnings only on the others."""
    log = logging.getLogger(LOGGER)
    if not log.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(asctime)s k2jax serve: %(message)s", "%Y-%m-%d %H:%M:%S"))
        log.addHandler(h)
    log.setLevel(logging.INFO if main else logging.WARNING)
    log.propagate = False
    return log


def _check_flags(args) -> None:
    for flag, v in (("--max-batch", args.max_batch), ("--max-len", args.max_len), ("--page-size", args.page_size),
                    ("--prefill-chunk", args.prefill_chunk), ("--max-queue", args.max_queue),
                    ("--idle-prefill-chunk", 1 if args.idle_prefill_chunk is None else args.idle_prefill_chunk)):
        if v < 1:
            raise ValueError(f"{flag} must be >= 1, got {v}")
    for flag, v in (("--batch-wait-ms", args.batch_wait_ms), ("--drain-timeout", args.drain_timeout),
                    ("--stats-interval", args.stats_interval)):
        if v < 0:
            raise ValueError(f"{flag} must be >= 0, got {v}")
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")


# XLA:CPU maps each compiled program's code into memory piece by piece: measured about 650 maps per engine step
# program (bench config; 37.5 k maps for 56 programs). Past the kernel's vm.max_map_count LLVM fails with
# "Cannot allocate memory" and the process crashes (a 32-slot bench server's 97 programs did).
MAPS_PER_CPU_PROGRAM = 700


def _check_map_count(programs: int, log) -> None:
    """Warn, before compiling, when the step programs of an XLA:CPU server may exceed vm.max_map_count."""
    import jax

    try:
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read())
    except (OSError, ValueError):
        return
    if jax.default_backend() == "cpu" and programs * MAPS_PER_CPU_PROGRAM > 0.9 * limit:
        log.warning(f"{programs} step programs to compile may take about {programs * MAPS_PER_CPU_PROGRAM} memory "
                    f"maps on XLA:CPU, near vm.max_map_count ({limit}); past it compiling fails ('Cannot allocate "
                    f"memory') and the process crashes. Fewer programs: a smaller --max-batch or --max-len, "
                    f"--fixed-chunks; or raise vm.max_map_count")


def _bytes_by_dtype(tree) -> str:
    """'float32 1.23 GB' or 'bfloat16 402.00 MB + int4 301.00 MB ...': the leaves' bytes per dtype, most first."""
    import jax

    by: dict[str, int] = {}
    for x in jax.tree.leaves(tree):
        by[str(x.dtype)] = by.get(str(x.dtype), 0) + int(x.nbytes)
    return " + ".join(f"{k} {_size(v)}" for k, v in sorted(by.items(), key=lambda kv: -kv[1]))


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def run(args) -> int:
    from k2jax import distributed as dist

    _check_flags(args)
    # Claim the port before anything slow (jax.distributed, loading, compiling) when this is surely process 0.
    sock = bind(args.host, args.port) if not args.distributed and args.process_id in (None, 0) else None
    try:
        dist.initialize_from_args(args)
        if sock is None and dist.is_main():
            sock = bind(args.host, args.port)
        return _run(args, sock)
    finally:
        if sock is not None:
            sock.close()


def _run(args, sock) -> int:
    from k2jax import distributed as dist

    import jax
    import jax.numpy as jnp

    from k2jax.runtime.cache import pool_tokens
    from k2jax.runtime import compiles
    from k2jax.runtime.detok import TokenText
    from k2jax.runtime.engine import Engine, round_up_slots

    log = setup_logging(dist.is_main())
    compiles.install()
    use_compile_cache(args.compile_cache)
    multi = jax.process_count() > 1
    if multi and not args.mesh:
        raise ValueError("a multi-process server needs --mesh (over every process's devices)")
    template = chat_template(args)
    t0 = time.perf_counter()
    model, params, tok, name, mesh = load_model(args)
    log.info(f"{name} loaded in {time.perf_counter() - t0:.1f} s: compute dtype {jnp.dtype(model.param_dtype).name}, "
             f"weights {_bytes_by_dtype(params)}" + (f" (--quant {args.quant})" if args.quant != "none" else ""))
    if tok is None:
        log.info("no --tokenizer: prompts must be token ids; chat and text are refused")
    else:
        log.info(f"chat template: {template.origin}" + (f" (thinking {'on' if template.thinking_default else 'off'} "
                                                        f"by default)" if template.is_thinking else ""))
    sync = None
    if multi:
        from k2jax.serving.multihost import StepSync

        sync = StepSync()
    kv_tokens = args.kv_tokens
    if args.kv_memory is not None:
        kv_dtype = args.kv_cache_dtype if args.kv_cache_dtype != "auto" else jnp.dtype(model.param_dtype).name
        kv_tokens = pool_tokens(model.cfg, kv_dtype, args.kv_memory * 2**30, mesh, round_up_slots(args.max_batch, mesh))
    engine = Engine(model, params, engine_config(args).replace(kv_tokens=kv_tokens), mesh=mesh, sync=sync,
                    detok=TokenText(tok) if tok else None, grammars=_grammars(tok, model.cfg, args.json_whitespace))
    state = engine.runner.state
    log.info(f"KV cache {engine.kv_cache_dtype}: a pool of {engine.kv_tokens} tokens in pages of {args.page_size}, "
             f"{_bytes_by_dtype({'pages': state['pages'], 'scales': state['scales']})}; {engine.max_batch} slots, "
             f"at most {args.max_len} tokens per request; prefix cache {'off' if args.no_prefix_cache else 'on'}")
    if engine.runner.extra_bytes:
        log.info(f"XLA:CPU: the gate and up experts are also held output-major and kv_b_proj head-major, the "
                 f"layouts its dots read fastest: {engine.runner.extra_bytes / 1e6:.2f} MB more")
    programs = len(set(engine.sched.shapes()))
    _check_map_count(programs, log)
    log.info(f"warming up: tracing and compiling {programs} step programs ({engine.programs_cause()}), several "
             f"at a time (a line as each begins)")
    t_warm = time.perf_counter()
    compile_s = engine.warm_up(lambda k, n, what: log.info(f"compiling {k}/{n}: {what} (at "
                                                           f"{time.perf_counter() - t_warm:.1f} s)"), log.info)
    budget = engine.sched.stall_budget_s()
    bound = "" if budget is None else f", cut to a first chunk's {budget * 1e3:.0f} ms a step"
    log.info(f"compiled {'and timed ' if bound else ''}the engine steps in {compile_s:.1f} s (prefill chunks of up to "
             f"{engine.prefill_chunk} tokens while requests decode{bound}, {engine.idle_chunk} while none does)")
    if not dist.is_main():
        # A supervisor may signal every process: the followers step until process 0 tells them to stop.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: log.warning("signal ignored: this process stops when process 0 does"))
        engine.run_follower()
        jax.distributed.shutdown()  # together with process 0, which holds the coordination service
        return 0
    thread = threading.Thread(target=engine.run, name="k2jax-engine", daemon=True)
    thread.start()
    try:
        _serve(args, sock, engine, tok, template, name, log)
    finally:
        engine.stop()
        thread.join(timeout=90)
        if multi:
            jax.distributed.shutdown()
    return 1 if engine.failed is not None else 0


def _serve(args, sock, engine, tok, template, name, log) -> None:
    """uvicorn on `sock` until a signal's drain ends."""
    import uvicorn

    from k2jax.serving.api import ServeState, make_app

    state = ServeState()
    app = make_app(engine, tok, name, chat_template=template, api_key=args.api_key, state=state,
                   access_log=not args.no_access_log, logger=log)
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=2)
    server = _server_class()(config)
    life = _Lifecycle(server, engine, state, args, sock, name, log)
    server.on_started, server.on_signal = life.started, life.signal
    engine.on_fail = life.failed
    # After the server stops, uvicorn restores the handlers it found; these ignore a late signal, so the engine
    # and (multi-host) the other processes are still stopped in order below.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server with our start hook and our signal handling (the drain) instead of its own."""

        on_started = on_signal = None

        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if not self.should_exit:
                self.on_started()

        def handle_exit(self, sig, frame):
            self.on_signal(sig)

    return Server


class _Lifecycle:
    """The running server's start (URL line, stats loop) and its drain on a signal."""

    def __init__(self, server, engine, state, args, sock, name, log):
        self.server, self.engine, self.state, self.args, self.log = server, engine, state, args, log
        self.sock, self.name = sock, name
        self.loop = None
        self.drain = None
        self.hurry: asyncio.Event | None = None
        self.signals = 0

    def started(self) -> None:
        from k2jax.serving.oplog import stats_loop

        self.loop = asyncio.get_running_loop()
        self.hurry = asyncio.Event()
        host, port = self.sock.getsockname()[:2]
        host = f"[{host}]" if ":" in host else host
        print(f"k2jax serve: http://{host}:{port}/v1 (model {self.name!r})", file=sys.stderr, flush=True)
        if self.args.stats_interval > 0:
            self.stats = self.loop.create_task(stats_loop(self.engine.metrics, self.args.stats_interval, self.log))

    def signal(self, sig) -> None:
        """In the signal handler (main thread): start the drain on the event loop; a second signal aborts the
        running requests now; a third stops without waiting."""
        self.signals += 1
        if self.loop is None:  # not serving yet
            self.server.should_exit = True
            return
        self.loop.call_soon_threadsafe(self._on_signal, sig)

    def _on_signal(self, sig) -> None:
        if self.drain is None:
            self.drain = self.loop.create_task(self._drain(signal.Signals(sig).name))
        elif self.signals == 2:
            self.log.info("second signal: aborting the running requests now")
            self.hurry.set()
        else:
            self.server.should_exit = self.server.force_exit = True

    def failed(self, why: str) -> None:
        """On the engine thread, after a step failed and the engine ended every request: stop serving (exit
        status 1), so that a supervisor starts the server afresh; /health says why until then."""
        self.log.error(f"a step failed: {why}; every request ended with 'abort'; stopping")
        self.state.draining = True
        self.server.should_exit = True

    async def _idle(self) -> None:
        while self.state.inflight:
            await asyncio.sleep(0.02)

    async def _drain(self, why: str) -> None:
        self.state.draining = True
        timeout = self.args.drain_timeout
        self.log.info(f"{why}: draining: {self.state.inflight} requests in flight may finish for up to {timeout:g} "
                      f"s; new requests get 503")
        hurry = asyncio.ensure_future(self.hurry.wait())
        idle = asyncio.ensure_future(self._idle())
        await asyncio.wait({idle, hurry}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        hurry.cancel()
        if self.state.inflight:
            self.log.info(f"aborting {self.state.inflight} requests still running")
            self.engine.abort_all()
            await asyncio.wait({idle}, timeout=ABORT_WAIT_S)
        idle.cancel()
        self.log.info("drained: stopping")
        self.server.should_exit = True
