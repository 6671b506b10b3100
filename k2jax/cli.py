"""The `k2jax` command line."""

from __future__ import annotations

import argparse
import sys


def _info(args) -> int:
    from k2jax.config import K2Config
    from k2jax.info import format_info

    cfg = K2Config.from_hf_config(args.config)
    print(f"{args.config}: {cfg.num_hidden_layers} layers ({cfg.num_dense_layers} dense, {cfg.num_moe_layers} MoE), "
          f"hidden {cfg.hidden_size}, {cfg.n_routed_experts or 0} experts top-{cfg.num_experts_per_tok}, "
          f"vocab {cfg.vocab_size}")
    print(format_info(cfg))
    return 0


def _plan(args) -> int:
    from k2jax.config import K2Config
    from k2jax.plan import format_plan, plan

    cfg = K2Config.from_hf_config(args.config)
    print(format_plan(plan(cfg, args.mesh, args.dtype, args.batch, args.max_len), args.reserve))
    return 0


def _generate(args) -> int:
    import time

    import jax.numpy as jnp
    import numpy as np

    import k2jax
    from k2jax import distributed as D
    from k2jax.tokenizer import KimiTokenizer

    if (args.prompt is None) == (args.prompt_ids is None):
        raise ValueError("give exactly one of --prompt TEXT (with --tokenizer DIR) or --prompt-ids 1,2,3")
    if args.prompt is not None and args.tokenizer is None:
        raise ValueError("--prompt needs --tokenizer DIR (tiktoken.model and tokenizer_config.json)")
    if args.mesh and args.hf_checkpoint:
        raise ValueError("--mesh works with --checkpoint (a converted checkpoint); --hf-checkpoint loads on one device")
    dtype = None if args.dtype == "auto" else jnp.dtype(args.dtype)
    if D.initialize_from_args(args) and not args.mesh:
        raise ValueError("a multi-process run needs --mesh (over every process's devices) and --checkpoint")
    main_process = D.is_main()  # only process 0 prints
    mesh = k2jax.make_mesh(args.mesh) if args.mesh else None
    t0 = time.perf_counter()
    quant = None if args.quant == "none" else args.quant
    if args.checkpoint:
        cfg, params = k2jax.load(args.checkpoint, dtype=dtype, mesh=mesh, quant=quant)
    else:
        cfg, params = k2jax.load_hf(args.hf_checkpoint, dtype=dtype, quant=quant)
    D.log0(f"loaded in {time.perf_counter() - t0:.1f} s")
    model = k2jax.K2Model(cfg, jax_dtype(params))

    tok = KimiTokenizer.from_dir(args.tokenizer) if args.tokenizer else None
    if args.prompt is not None:
        ids = (tok.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat
               else tok.encode(args.prompt))
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
    D.print0()
    D.log0(f"prompt {len(ids)} tokens, {len(out)} new | prefill {len(ids) / t['prefill_s']:.1f} tokens/s | "
          f"decode {t['decode_steps'] / max(t['decode_s'], 1e-9):.1f} tokens/s | time to first token "
          f"{t['prefill_s']:.3f} s (+ {t['compile_s']:.1f} s compiling)")
    return 0


def _serve(args) -> int:
    from k2jax.serving.server import run

    return run(args)


def jax_dtype(params):
    """The compute dtype of a param tree: that of the embedding."""
    return params["embed_tokens"].dtype


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="k2jax", description="Kimi K2 (DeepSeek-V3 architecture) in JAX: model tools.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("info", help="parameter counts and bytes of a config, per component and per block",
                       description="Count parameters per component and per block from the abstract param tree "
                                   "(no memory allocated), with totals and bytes in bf16 and fp8.")
    p.add_argument("config", help="a HuggingFace config.json (or its directory), e.g. configs/kimi_k2.json")
    p.set_defaults(func=_info)
    p = sub.add_parser("plan", help="bytes per device of a config sharded on a mesh, and which chips hold it",
                       description="Per-device bytes of the params (and the latent KV cache with --batch and "
                                   "--max-len) sharded by k2jax's rules table on a mesh, from the abstract param "
                                   "tree (nothing allocated, no devices needed), and whether that fits TPU "
                                   "v5e/v6e/v5p, H100 and H200 memory with a reserve kept free. Params with a "
                                   "dim the mesh does not divide fall back (replicated over the axes that do "
                                   "not divide it) and are listed with their extra bytes per device.")
    p.add_argument("config", help="a HuggingFace config.json (or its directory), e.g. configs/kimi_k2.json")
    p.add_argument("--mesh", required=True,
                   help="mesh axis sizes, e.g. expert=64,tensor=4 (axes data, fsdp, expert, tensor; absent = 1)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float8", "int4", "float32"),
                   help="weights as held on device (values and scales): float8 = the released e4m3 layout with "
                        "128x128-block scales (load quant='fp8'); int4 = routed experts in 4 bits with a bf16 "
                        "scale per 32 inputs, the rest bf16 (load quant='int4', Kimi-K2-Thinking); default "
                        "bfloat16")
    p.add_argument("--batch", type=int, default=0, help="KV cache batch size (with --max-len)")
    p.add_argument("--max-len", type=int, default=0, help="KV cache length in tokens (with --batch)")
    p.add_argument("--reserve", type=float, default=0.1,
                   help="fraction of each chip's memory kept free for activations and temporaries (default 0.1)")
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
    src.add_argument("--checkpoint", metavar="DIR", help="a converted k2jax checkpoint (k2jax convert)")
    src.add_argument("--hf-checkpoint", metavar="DIR",
                     help="a HuggingFace checkpoint directory (safetensors, FP8 or not), loaded on one device")
    p.add_argument("--mesh", help="shard over a device mesh, e.g. expert=4,data=2 (with --checkpoint)")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="compute dtype (default: the checkpoint's; bfloat16 for the FP8 release)")
    p.add_argument("--quant", default="none", choices=("none", "fp8", "int4"),
                   help="weights held on device: none = dequantized to --dtype (default); fp8 = an FP8 "
                        "checkpoint's e4m3 blocks as stored; int4 = routed experts in 4 bits (a Kimi-K2-Thinking "
                        "checkpoint's as stored, an FP8 one's requantized: lossy), the rest in --dtype")
    p.add_argument("--prompt", help="prompt text (needs --tokenizer)")
    p.add_argument("--tokenizer", metavar="DIR", help="directory with tiktoken.model and tokenizer_config.json")
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
                    "streaming as server-sent events), /v1/models, /health, /metrics (Prometheus). Requests join "
                    "and leave --max-batch decode slots between engine steps; prompts are prefilled in chunks of "
                    "up to --prefill-chunk tokens so running decodes keep going. Everything is compiled at start-"
                    "up. Try it without a download: k2jax serve --demo")
    serve_arguments(p)
    p.set_defaults(func=_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"k2jax {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
