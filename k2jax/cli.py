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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="k2jax", description="Kimi K2 (DeepSeek-V3 architecture) in JAX: model tools.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("info", help="parameter counts and bytes of a config, per component and per block",
                       description="Count parameters per component and per block from the abstract param tree "
                                   "(no memory allocated), with totals and bytes in bf16 and fp8.")
    p.add_argument("config", help="a HuggingFace config.json (or its directory), e.g. configs/kimi_k2.json")
    p.set_defaults(func=_info)
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
