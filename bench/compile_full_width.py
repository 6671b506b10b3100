"""One Kimi K2 MoE block at full width (7168 hidden, 384 experts, 2048 expert hidden) on 8 simulated CPU
devices, experts sharded 8 ways: lowered and compiled ahead of time from abstract inputs (no weights
allocated); prints the compile time and memory_analysis()'s per-device argument bytes against block / 8.

    python bench/compile_full_width.py [--mesh expert=8] [--tokens 512]
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import pathlib  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from k2jax.config import K2Config  # noqa: E402
from k2jax.nn.block import DecoderBlock  # noqa: E402
from k2jax.nn.model import abstract_params  # noqa: E402
from k2jax.placement import param_shardings  # noqa: E402
from k2jax.sharding import make_mesh, use_mesh  # noqa: E402

CONFIG = pathlib.Path(__file__).resolve().parents[1] / "configs" / "kimi_k2.json"


def compile_block(mesh_spec: str = "expert=8", tokens: int = 512, config=CONFIG):
    """(compiled, block param bytes, seconds): one bf16 MoE block of `config` compiled for `mesh_spec`,
    batch 1 x `tokens`."""
    # One dense + one MoE layer: the MoE block's params and shardings are moe_layers, layer 0.
    cfg = K2Config.from_hf_config(config).replace(num_hidden_layers=2, first_k_dense_replace=1)
    mesh = make_mesh(mesh_spec)
    block = abstract_params(cfg, jnp.bfloat16)["moe_layers"]
    shard = param_shardings(cfg, mesh)["moe_layers"]
    block = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), block)
    shard = jax.tree_util.tree_map(lambda s: NamedSharding(mesh, P(*s.spec[1:])), shard)
    args = [jax.tree_util.tree_map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), block, shard)]
    batch = NamedSharding(mesh, P(("data", "fsdp")))
    args += [jax.ShapeDtypeStruct((1, tokens, cfg.hidden_size), jnp.bfloat16, sharding=batch),
             jax.ShapeDtypeStruct((1, tokens), jnp.int32, sharding=batch),
             jax.ShapeDtypeStruct((1, tokens), jnp.bool_, sharding=batch)]

    def step(params, x, pos, valid):
        return DecoderBlock(cfg, True, jnp.bfloat16).apply({"params": params}, x, pos, valid)[0]

    t0 = time.perf_counter()
    with use_mesh(mesh):
        compiled = jax.jit(step).lower(*args).compile()
    nbytes = sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(block))
    return compiled, nbytes, time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mesh", default="expert=8")
    ap.add_argument("--tokens", type=int, default=512)
    args = ap.parse_args()
    compiled, nbytes, secs = compile_block(args.mesh, args.tokens)
    mem = compiled.memory_analysis()
    n = len(jax.devices())
    print(f"Kimi K2 MoE block, mesh {args.mesh}, 1 x {args.tokens} tokens: compiled in {secs:.1f} s")
    print(f"block params (bf16): {nbytes / 2**30:.2f} GiB; / {n} = {nbytes / n / 2**30:.3f} GiB")
    print(f"per-device argument bytes: {mem.argument_size_in_bytes / 2**30:.3f} GiB "
          f"(ratio to block/{n}: {mem.argument_size_in_bytes / (nbytes / n):.3f}); "
          f"temp {mem.temp_size_in_bytes / 2**30:.3f} GiB, output {mem.output_size_in_bytes / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
