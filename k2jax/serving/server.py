"""`k2jax serve`: load a model, warm the engine up (every step compiled before the first request), run the
engine loop in its own thread and the HTTP server (uvicorn) in the main one.

Multi-host (jax.distributed): every process runs the engine loop over the global mesh; process 0 also runs
HTTP and, each step, broadcasts the requests it admitted and the cancellations (k2jax.serving.multihost),
so every process steps the same program. Only process 0 answers.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import threading
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", metavar="DIR", help="a converted k2jax checkpoint (k2jax convert)")
    src.add_argument("--hf-checkpoint", metavar="DIR",
                     help="a HuggingFace checkpoint directory (safetensors, FP8 or not), loaded on one device")
    src.add_argument("--demo", action="store_true",
                     help="serve a random-weight model of configs/bench.json's K2 shape (the demo's, vocabulary "
                          "1024) with a small synthetic tokenizer: nothing to download; the text is gibberish")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="directory with tiktoken.model and tokenizer_config.json (without it, prompts must be "
                        "token ids and chat is refused)")
    p.add_argument("--model-name", help="the model id clients send (default: the checkpoint's directory name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--max-batch", type=int, default=8, help="decode slots: requests decoded together (default 8)")
    p.add_argument("--max-len", type=int, default=4096,
                   help="cache length per slot: prompt + completion tokens of one request (default 4096)")
    p.add_argument("--prefill-chunk", type=int, default=512,
                   help="most prompt tokens prefilled per engine step, so running decodes keep going (default 512)")
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
    p.add_argument("--seed", type=int, default=0, help="seed of --demo's random weights (default 0)")
    from k2jax import distributed

    distributed.add_arguments(p)


def load_model(args):
    """-> (model, params, tokenizer or None, model name, mesh)."""
    import jax
    import jax.numpy as jnp

    import k2jax
    from k2jax.tokenizer import KimiTokenizer

    dtype = None if args.dtype == "auto" else jnp.dtype(args.dtype)
    quant = None if args.quant == "none" else args.quant
    if args.mesh and args.hf_checkpoint:
        raise ValueError("--mesh works with --checkpoint or --demo; --hf-checkpoint loads on one device")
    mesh = k2jax.make_mesh(args.mesh) if args.mesh else None
    tok = KimiTokenizer.from_dir(args.tokenizer) if args.tokenizer else None
    if args.demo:
        from k2jax.demo import DEMO_CONFIG, TOKENIZER_MERGES
        from k2jax.testing import random_params
        from k2jax.tokenizer import write_test_tokenizer

        cfg = k2jax.K2Config.from_hf_config(DEMO_CONFIG)
        params = random_params(cfg, dtype or jnp.bfloat16, seed=args.seed)
        if quant is not None:
            params = k2jax.quantize_params(params, cfg, quant)
        if mesh is not None:
            params = jax.device_put(params, k2jax.param_shardings(cfg, mesh, quant=quant))
        if tok is None:
            with tempfile.TemporaryDirectory(prefix="k2jax-serve-tok-") as d:
                tok = KimiTokenizer.from_dir(write_test_tokenizer(d, num_merges=TOKENIZER_MERGES))
        name = args.model_name or "k2jax-demo"
    elif args.checkpoint:
        cfg, params = k2jax.load(args.checkpoint, dtype=dtype, mesh=mesh, quant=quant)
        name = args.model_name or _name(args.checkpoint)
    else:
        cfg, params = k2jax.load_hf(args.hf_checkpoint, dtype=dtype, quant=quant)
        name = args.model_name or _name(args.hf_checkpoint)
    model = k2jax.K2Model(cfg, params["embed_tokens"].dtype)
    return model, params, tok, name, mesh


def _name(path) -> str:
    import pathlib

    return pathlib.Path(path).resolve().name


def run(args) -> int:
    from k2jax import distributed as D

    D.initialize_from_args(args)
    import jax

    from k2jax.serving import compiles
    from k2jax.serving.engine import Engine

    compiles.install()
    multi = jax.process_count() > 1
    if multi and not args.mesh:
        raise ValueError("a multi-process server needs --mesh (over every process's devices)")
    for flag, v in (("--max-batch", args.max_batch), ("--max-len", args.max_len),
                    ("--prefill-chunk", args.prefill_chunk), ("--max-queue", args.max_queue)):
        if v < 1:
            raise ValueError(f"{flag} must be >= 1, got {v}")
    if args.batch_wait_ms < 0:
        raise ValueError(f"--batch-wait-ms must be >= 0, got {args.batch_wait_ms}")
    t0 = time.perf_counter()
    model, params, tok, name, mesh = load_model(args)
    D.log0(f"k2jax serve: {name} loaded in {time.perf_counter() - t0:.1f} s (weights {args.quant if args.quant != 'none' else args.dtype})")
    sync = None
    if multi:
        from k2jax.serving.multihost import StepSync

        sync = StepSync()
    detok = (lambda ids: tok.decode([i for i in ids if i < tok.vocab_size])) if tok else None
    engine = Engine(model, params, max_batch=args.max_batch, max_len=args.max_len, prefill_chunk=args.prefill_chunk,
                    decode=detok, kv_cache_dtype=args.kv_cache_dtype, mesh=mesh, max_queue=args.max_queue, sync=sync,
                    batch_wait_s=args.batch_wait_ms / 1e3)
    D.log0(f"k2jax serve: compiled the engine steps in {engine.warm_up():.1f} s ({args.max_batch} slots x "
           f"{args.max_len} tokens, prefill chunks of up to {engine.prefill_chunk}, cache {args.kv_cache_dtype})")
    if not D.is_main():
        engine.run_follower()
        jax.distributed.shutdown()  # together with process 0, which holds the coordination service
        return 0
    thread = threading.Thread(target=engine.run, name="k2jax-engine", daemon=True)
    thread.start()
    import uvicorn

    from k2jax.serving.api import make_app

    app = make_app(engine, tok, name)
    print(f"k2jax serve: http://{args.host}:{args.port}/v1 (model {name!r})", file=sys.stderr, flush=True)
    # uvicorn shuts down gracefully on SIGTERM / SIGINT, then restores the handlers it found and raises the
    # signal again: with the default handlers that kills the process before the engine stops and, multi-host,
    # before the other processes are told to stop (they then lose the coordination service this one holds).
    # Handlers that ignore that second signal let the shutdown below run.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=2)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        engine.stop()
        thread.join(timeout=90)
        if multi:
            jax.distributed.shutdown()
    return 0
