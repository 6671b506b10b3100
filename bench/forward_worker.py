"""k2jax's prefill forward in a worker process, for bench/forward.py --against: whichever k2jax is first on
PYTHONPATH (a revision exported from the repository's history) times its own `apply` on a checkpoint.

    python bench/forward_worker.py CHECKPOINT DTYPE TOKENS.npy

Loads CHECKPOINT (HF safetensors) with `load_hf`, compiles the forward on each param layout that revision has
("stacked", the tree load_hf returns, and "split" if it has `k2jax.split_experts`), prints one JSON line
{"layouts": [...]}, then answers each line {"time": layout} on stdin with {"s": seconds} (one forward).
Imports nothing from this directory, so that k2jax comes from PYTHONPATH.
"""

from __future__ import annotations

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np


def main():
    import k2jax

    ckpt, dtype, tokens_path = sys.argv[1:4]
    cfg, stacked = k2jax.load_hf(ckpt, dtype=jnp.dtype(dtype))
    layouts = {"stacked": stacked}
    if hasattr(k2jax, "split_experts"):
        layouts["split"] = k2jax.split_experts(stacked)
    model = k2jax.K2Model(cfg, jnp.dtype(dtype))
    fwd = jax.jit(lambda p, t: model.apply({"params": p}, t))
    tokens = jnp.asarray(np.load(tokens_path), jnp.int32)
    for params in layouts.values():
        jax.block_until_ready(fwd(params, tokens))
    print(json.dumps({"layouts": list(layouts)}), flush=True)
    for line in sys.stdin:
        params = layouts[json.loads(line)["time"]]
        t = time.perf_counter()
        jax.block_until_ready(fwd(params, tokens))
        print(json.dumps({"s": time.perf_counter() - t}), flush=True)


if __name__ == "__main__":
    main()
