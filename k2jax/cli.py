"""The `k2jax` command line."""

from __future__ import annotations

import argparse
import sys


def _info(args) -> int:
    from k2jax.checkpoint.hf_source import load_config
    from k2jax.info import format_info

    cfg = load_config(args.config)
    print(f"{args.config}: {cfg.num_hidden_layers} layers ({cfg.num_dense_layers} dense, {cfg.num_moe_layers} MoE), "
          f"hidden {cfg.hidden_size}, {cfg.n_routed_experts or 0} experts top-{cfg.num_experts_per_tok}, "
          f"vocab {cfg.vocab_size}")
    print(format_info(cfg))
    return 0


def _plan(args) -> int:
    import json
    import os

    import jax

    if not os.environ.get("JAX_PLATFORMS"):
        # plan needs no device: on a host with libtpu but no TPU, starting one would only log warnings
        try:
            jax.config.update("jax_platforms", "cpu")
        except RuntimeError:
            pass
    from k2jax.checkpoint.hf_source import load_config
    from k2jax.plan import GiB, chip, format_plan, format_search, plan, search

    if args.dtype in ("float8", "fp8", "int4"):
        q = "fp8" if args.dtype == "float8" else args.dtype
        raise ValueError(f"--dtype {args.dtype}: the quantization is --quant {q} (--dtype is the dtype of the rest: "
                         "bfloat16 or float32), as serve and generate take them")
    if args.dtype not in ("bfloat16", "float32"):
        raise ValueError(f"--dtype must be bfloat16 or float32, got {args.dtype!r}")
    cfg = load_config(args.config)
    kw = dict(quant=None if args.quant == "none" else args.quant, dtype=args.dtype, batch=args.batch,
              max_len=args.max_len, kv_dtype=args.kv_cache_dtype, page_size=args.page_size)
    what = f"{args.config}: "
    if args.compile:
        return _plan_compile(args, cfg, kw, what)
    if args.mesh and args.chips is None and args.chip is None and args.hbm is None:
        p = plan(cfg, args.mesh, **kw)
        if args.json:
            from k2jax.aot.report import plan_json

            print(json.dumps(plan_json(p), indent=1))
        else:
            print(format_plan(p, args.reserve))
        return 0
    if args.chips is None:
        raise ValueError("give --mesh SPEC (one mesh), --chips N with --chip NAME or --hbm GiB (search the "
                         "meshes), or --compile TOPOLOGY")
    hbm = args.hbm * GiB if args.hbm else chip(args.chip).hbm if args.chip else None
    if hbm is None:
        raise ValueError("--chips needs the memory per chip: --chip v5p|v6e|v5e|v7x|h100|h200 or --hbm GiB")
    if args.chip:  # a TPU pads each token's cache values to 128 (k2jax.runtime.cache.lane)
        kw["kv_lane"] = chip(args.chip).kv_lane
    if args.mesh:
        raise ValueError("--mesh plans one mesh; --chips searches them: give one of the two")
    cands = search(cfg, args.chips, hbm, reserve=args.reserve, **kw)
    if args.json:
        from k2jax.aot.report import plan_json

        print(json.dumps([plan_json(c.plan) | {"kv_tokens": c.kv_tokens, "fits": c.fits}
                          for c in cands[:args.top]], indent=1))
    else:
        print(format_search(cands, args.chips, hbm, args.reserve, args.top, what))
    return 0


def _plan_compile(args, cfg, kw, what) -> int:
    """`k2jax plan --compile TOPOLOGY`: the runtime's programs compiled for the topology."""
    import dataclasses
    import json
    import sys

    from k2jax.aot import compile as aot
    from k2jax.aot.report import format_compile, plan_json, result_json
    from k2jax.aot.topology import chip_name, chips_in, load_topology, topology_mesh
    from k2jax.runtime.cache import TPU_LANE, data_shards
    from k2jax.plan import CHIPS, GiB, Chip, plan, search

    name = chip_name(args.compile)
    if not (args.batch and args.max_len):
        raise ValueError("--compile needs the cache the programs run on: --batch ROWS --max-len TOKENS")
    programs = tuple(x.strip() for x in args.programs.split(",") if x.strip())
    aot.check_programs(programs)
    chips = chips_in(args.compile)
    if args.chips is not None and args.chips != chips:
        raise ValueError(f"--chips {args.chips}: topology {args.compile} has {chips} chips")
    part = CHIPS.get(name) or Chip(name, f"TPU {name}", 0)
    if args.hbm:
        part = dataclasses.replace(part, hbm=int(args.hbm * GiB))
    if not part.hbm:
        raise ValueError(f"--compile {args.compile}: no memory figure for {name} chips: give --hbm GiB")
    topo = load_topology(args.compile)  # before the search: a missing libtpu fails fast
    kw["kv_lane"] = TPU_LANE
    if len(topo.devices) != chips:
        chips = len(topo.devices)
    recommended = not args.mesh
    mesh_spec = args.mesh or search(cfg, chips, part.hbm, reserve=args.reserve, **kw)[0].mesh_spec
    p = plan(cfg, mesh_spec, **kw)
    mesh = topology_mesh(topo.devices, mesh_spec)
    shapes = aot.step_shapes(args.batch, args.max_len, args.page_size, args.prefill, args.chunk, programs,
                             data_shards(mesh, args.batch))

    def progress(r):
        state = "FAILED" if r.error else f"{r.seconds:.0f} s"
        print(f"compiled {r.name} ({r.shape.total_tokens} tokens): {state}", file=sys.stderr, flush=True)

    results = aot.compile_programs(cfg, mesh, p, shapes, on_progress=progress)
    if args.json:
        print(json.dumps({"config": str(args.config), "topology": args.compile, "chips": chips,
                          "hbm_bytes": part.hbm, "reserve": args.reserve, "recommended": recommended,
                          "plan": plan_json(p), "chip": dataclasses.asdict(part),
                          "programs": [result_json(r, part, p.devices) for r in results]}, indent=1))
    else:
        print(format_compile(results, p, args.compile, part, args.reserve, recommended, what))
    return 1 if any(r.error for r in results) else 0


def _generate(args) -> int:
    import time

    import jax.numpy as jnp

    import k2jax
    from k2jax import distributed as dist
    from k2jax.tokenizer import KimiTokenizer, tokenizer_dir

    if (args.prompt is None) == (args.prompt_ids is None):
        raise ValueError("give exactly one of --prompt TEXT (with --tokenizer DIR) or --prompt-ids 1,2,3")
    if args.prompt is not None and args.tokenizer is None:
        raise ValueError("--prompt needs --tokenizer DIR (tiktoken.model and tokenizer_config.json)")
    if args.mesh and args.hf_checkpoint:
        raise ValueError("--mesh works with --checkpoint (a converted checkpoint); --hf-checkpoint loads on one device")
    dtype = None if args.dtype == "auto" else jnp.dtype(args.dtype)
    if dist.initialize_from_args(args) and not args.mesh:
        raise ValueError("a multi-process run needs --mesh (over every process's devices) and --checkpoint")
    main_process = dist.is_main()  # only process 0 prints
    mesh = k2jax.make_mesh(args.mesh) if args.mesh else None
    t0 = time.perf_counter()
    quant = None if args.quant == "none" else args.quant
    if args.checkpoint:
        cfg, params = k2jax.load(args.checkpoint, dtype=dtype, mesh=mesh, quant=quant)
    else:
        cfg, params = k2jax.load_hf(args.hf_checkpoint, dtype=dtype, quant=quant, revision=args.revision)
    dist.log0(f"loaded in {time.perf_counter() - t0:.1f} s")
    model = k2jax.K2Model(cfg, jax_dtype(params))

    tok_dir = tokenizer_dir(args.tokenizer) if args.tokenizer else None  # a gs:// URL or repo id: fetched
    tok = KimiTokenizer.from_dir(tok_dir) if tok_dir else None
    if args.prompt is not None:
        if args.chat:  # the checkpoint's own chat template (k2jax serve renders it the same way)
            from k2jax.serving.chat_template import ChatTemplate

            text = ChatTemplate.from_tokenizer_dir(tok_dir).render([{"role": "user", "content": args.prompt}])
            ids = tok.encode(text, allow_special=True)
        else:
            ids = tok.encode(args.prompt)
        stop = tok.stop_ids if args.chat else [tok.eos_id]
    else:
        try:
            ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--prompt-ids: expected comma-separated integers, got {args.prompt_ids!r}") from None
        eos = cfg.eos_token_id
        stop = [] if eos is None else list(eos) if isinstance(eos, tuple) else [eos]
    stop = [] if args.no_stop else [s for s in stop if 0 <= s < cfg.vocab_size]

    out: list[int] = []
    shown = ""

    def on_token(tokens, active):
        nonlocal shown
        if not active[0] or not main_process:
            return
        out.append(int(tokens[0]))
        if tok is None:
            print(("" if len(out) == 1 else ",") + str(out[-1]), end="", flush=True)
            return
        text = tok.decode(out)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            print(text[len(shown):], end="", flush=True)
            shown = text

    t = {}
    k2jax.generate(model, params, [ids], args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, seed=args.seed, stop_tokens=stop, mesh=mesh, on_token=on_token, timings=t)
    dist.print0()
    dist.log0(f"prompt {len(ids)} tokens, {len(out)} new | prefill {len(ids) / t['prefill_s']:.1f} tokens/s | "
          f"decode {t['decode_steps'] / max(t['decode_s'], 1e-9):.1f} tokens/s | time to first token "
          f"{t['prefill_s']:.3f} s (+ {t['compile_s']:.1f} s compiling)")
    return 0


def _serve(args) -> int:
    from k2jax.serving.server import run

    return run(args)


def jax_dtype(params):
    """The compute dtype of a param tree: that of the embedding."""
    return params["embed_tokens"].dtype


CHIP_NAMES = ("v5e", "v6e", "v5p", "h100", "h200", "v7x")  # k2jax.plan.CHIPS (not imported: it pulls in jax)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="k2jax", description="Kimi K2 (DeepSeek-V3 architecture) in JAX: model tools.")
    from k2jax import __version__

    parser.add_argument("--version", action="version", version=f"k2jax {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("info", help="parameter counts and bytes of a config, per component and per block",
                       description="Count parameters per component and per block from the abstract param tree "
                                   "(no memory allocated), with totals and bytes in bf16 and fp8.")
    p.add_argument("config", help="a HuggingFace config.json (or its directory, a gs:// URL of either, or a Hugging "
                                  "Face repo id), e.g. configs/kimi_k2.json")
    p.set_defaults(func=_info)
    p = sub.add_parser("plan", help="bytes per chip of a config on a mesh, the mesh to use, and the compiler's check",
                       description="Per-chip bytes of the params, the paged latent KV cache and the sampling state "
                                   "(--batch, --max-len) sharded by k2jax's rules table, from the abstract param "
                                   "tree (nothing allocated, no devices needed). --mesh: one mesh, per component, and "
                                   "which chips hold it. --chips N with --chip or --hbm: the meshes over data, expert "
                                   "and tensor for N chips, ranked by the KV tokens that fit beside the weights "
                                   "(fsdp, a training axis, is left out: it would gather the weights again at every step). "
                                   "--compile TOPOLOGY: the runtime's programs compiled for that TPU slice by the TPU "
                                   "compiler on this host (needs `.venv/bin/pip install -e '.[tpu-aot]'`), with the "
                                   "compiler's bytes per chip beside the plan's, the collectives and weight checks.")
    p.add_argument("config", help="a HuggingFace config.json (or its directory, a gs:// URL of either, e.g. a "
                                  "converted checkpoint's, or a Hugging Face repo id), e.g. configs/kimi_k2.json")
    p.add_argument("--mesh", help="mesh axis sizes, e.g. expert=64,tensor=4 (axes data, fsdp, expert, tensor; "
                                  "absent = 1)")
    p.add_argument("--chips", type=int, help="search the meshes of this many chips")
    p.add_argument("--chip", choices=tuple(CHIP_NAMES), help="the chips' memory from their kind")
    p.add_argument("--hbm", type=float, help="memory per chip in GiB (instead of --chip)")
    p.add_argument("--compile", metavar="TOPOLOGY",
                   help="compile the programs for a TPU topology, e.g. v5p:4x4x4 or v6e:8x8, on the recommended "
                        "mesh (or --mesh); needs --batch and --max-len")
    p.add_argument("--quant", default="none", choices=("none", "fp8", "int4"),
                   help="weights held quantized, as serve and generate take it: fp8 = the released e4m3 layout "
                        "with 128x128-block scales; int4 = routed experts in 4 bits with a bf16 scale per 32 "
                        "inputs (Kimi-K2-Thinking); the rest in --dtype (default none)")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 (default) or float32: the params not quantized")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "bfloat16", "float32", "float8"),
                   help="the latent cache's dtype (default: --dtype)")
    p.add_argument("--batch", type=int, default=0, help="KV cache rows (decode slots), with --max-len")
    p.add_argument("--max-len", type=int, default=0, help="KV cache tokens per row, with --batch")
    p.add_argument("--page-size", type=int, default=64, help="tokens per cache page (default 64)")
    p.add_argument("--reserve", type=float, default=0.1,
                   help="fraction of each chip's memory kept free for activations and temporaries (default 0.1)")
    p.add_argument("--top", type=int, default=5, help="meshes shown by a search (default 5)")
    p.add_argument("--programs", default="decode,prefill,chunk",
                   help="with --compile: which of decode, prefill, chunk, decode1, burst, ragged (serve's "
                        "ragged step, every row decoding), ragged_chunk (the same with a --chunk prompt chunk "
                        "per data-parallel shard) (default decode,prefill,chunk)")
    p.add_argument("--prefill", type=int, default=8192, help="with --compile: prefill chunk tokens (default 8192)")
    p.add_argument("--chunk", type=int, default=512,
                   help="with --compile: later prompt chunk tokens, as serve's --prefill-chunk (default 512)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=_plan)
    p = sub.add_parser(
        "generate", help="continue a prompt with a checkpoint, streaming the new tokens",
        description="Generate from a prompt (text through the Kimi tokenizer, optionally in the chat format, or "
                    "token ids) with the latent KV cache: one jitted prefill, then one jitted decode step per token. "
                    "New text (or ids) is printed as it is produced; the last line (stderr) gives prefill "
                    "tokens/s, decode tokens/s and the time to first token. Stops at the tokenizer's stop tokens "
                    "(<|im_end|>, [EOS] with --chat; [EOS] otherwise) or the config's eos_token_id with "
                    "--prompt-ids.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", metavar="DIR", help="a converted k2jax checkpoint (k2jax convert): a directory "
                                                         "or gs://BUCKET/PATH")
    src.add_argument("--hf-checkpoint", metavar="DIR",
                     help="a HuggingFace checkpoint (safetensors, FP8 or not): a directory, gs://BUCKET/PATH or a "
                          "Hugging Face repo id; loaded on one device")
    p.add_argument("--revision", help="with a repo id --hf-checkpoint: the branch, tag or commit (default main)")
    p.add_argument("--mesh", help="shard over a device mesh, e.g. expert=4,data=2 (with --checkpoint)")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="compute dtype (default: the checkpoint's; bfloat16 for the FP8 release)")
    p.add_argument("--quant", default="none", choices=("none", "fp8", "int4"),
                   help="weights held on device: none = dequantized to --dtype (default); fp8 = an FP8 "
                        "checkpoint's e4m3 blocks as stored; int4 = routed experts in 4 bits (a Kimi-K2-Thinking "
                        "checkpoint's as stored, an FP8 one's requantized: lossy), the rest in --dtype")
    p.add_argument("--prompt", help="prompt text (needs --tokenizer)")
    p.add_argument("--tokenizer", metavar="DIR", help="directory with tiktoken.model and tokenizer_config.json (and "
                                                      "the chat template), a gs:// URL of one, or a Hugging Face "
                                                      "repo id, e.g. moonshotai/Kimi-K2-Instruct")
    p.add_argument("--chat", action="store_true", help="wrap --prompt as a user turn in the Kimi chat format")
    p.add_argument("--prompt-ids", metavar="IDS", help="prompt as comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--max-new-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens only")
    p.add_argument("--top-p", type=float, default=None, help="sample from the smallest set with this much mass")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--no-stop", action="store_true", help="ignore stop tokens: always generate --max-new-tokens")
    from k2jax import distributed

    distributed.add_arguments(p)
    p.set_defaults(func=_generate)
    from k2jax import demo

    p = sub.add_parser(
        "demo", help="the whole path on random weights: FP8 checkpoint -> convert -> sharded load -> generate",
        description="Write a synthetic FP8 checkpoint of a small K2-shaped config in the released layout (random "
                    "weights, nothing downloaded), convert it with `k2jax convert`, restore it on a mesh of "
                    "simulated CPU devices with the experts sharded, print which device holds which experts and "
                    "the bytes per device, generate from a batch of prompts and print prefill/decode throughput. "
                    "35-50 s on a 2-core CPU with the default config (configs/bench.json's shape, 390 M params). "
                    "The weights are random: the text is gibberish.")
    demo.add_arguments(p)
    p.set_defaults(func=demo.run)
    from k2jax.checkpoint.convert import DESCRIPTION, add_arguments, run as run_convert

    p = sub.add_parser("convert", help="HF safetensors (the released FP8 checkpoint) -> k2jax Orbax checkpoint",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run_convert)
    from k2jax.serving.server import add_arguments as serve_arguments

    p = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server with continuous batching over the latent cache",
        description="Serve a checkpoint over HTTP: /v1/completions and /v1/chat/completions (OpenAI-compatible, "
                    "streaming as server-sent events; n, seeds, stop strings, echo, lists of prompts), "
                    "/v1/models[/ID], /tokenize, /detokenize, /health, /metrics (Prometheus), /version. Requests "
                    "join and leave --max-batch decode slots between engine steps; prompts are prefilled in chunks "
                    "of up to --prefill-chunk tokens so running decodes keep going. Everything is compiled at "
                    "start-up. SIGTERM drains (--drain-timeout), then exits 0. Try it without a download: k2jax "
                    "serve --demo")
    serve_arguments(p)
    p.set_defaults(func=_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as e:  # bad input, a missing or unreadable path, gs:// or Hub errors
        print(f"k2jax {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
