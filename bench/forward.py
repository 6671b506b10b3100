"""Prefill forward of configs/bench.json (1 × 512 tokens): k2jax against transformers, same weights.

    python bench/forward.py [--tokens 512] [--rounds 5] [--bias-scale 0.0] [--against REV]

transformers' DeepseekV3ForCausalLM runs in the oracle environment (Python 3.11, torch CPU, 2 threads); k2jax
runs its default `apply` on the param tree `load_hf` returns (each projection of the MoE layers' routed
experts one stacked [L, E, D, F] array, as checkpoints and training hold them). They are alternated round by
round so that all see the same machine state. Prints median times, the speed-up, and k2jax's achieved
GFLOP/s against the measured matmul peak of the same dtype. The weights are random; how evenly they spread
tokens over the experts matters to both implementations, so the load skew is printed too.

--against REV adds k2jax as of git revision REV (exported from this repository's history into a temporary
directory) on the same checkpoint and tokens, in a worker process (bench/forward_worker.py) timed in the
same rounds: each param layout that revision has, "stacked" and, where it has `k2jax.split_experts` (the
per-layer experts layout callers chose on CPU before the MoE read the stacked params block by block),
"split". E.g. --against b648c78, the last revision with split_experts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from common import REPO, forward_flops, matmul_peak, median, time_fn  # noqa: I001

from k2jax import K2Config, K2Model, load_hf
from k2jax.nn.model import expert_views
from tests.oracle.client import Oracle


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=f"{REPO}/configs/bench.json")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--bias-scale", type=float, default=0.0,
                    help="the random e_score_correction_bias is uniform in +-this (default 0: a trained model's bias "
                         "evens the load out; the parity tests' 0.5, there to expose bias bugs, sends most "
                         "tokens to a few experts)")
    ap.add_argument("--against", metavar="REV", help="also time k2jax of this git revision (see above)")
    args = ap.parse_args()

    hf_cfg = json.load(open(args.config))
    cfg = K2Config.from_hf_config(hf_cfg)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, args.tokens))
    flops = forward_flops(cfg, args.tokens)
    print(f"config {args.config}: {cfg.num_hidden_layers} layers, {cfg.n_routed_experts} experts top-"
          f"{cfg.num_experts_per_tok}; 1 x {args.tokens} tokens = {flops / 1e9:.1f} GFLOP; jax {jax.__version__}, "
          f"backend {jax.default_backend()}")
    rows = []
    with Oracle() as oracle, tempfile.TemporaryDirectory() as tmp:
        base = {"config": hf_cfg, "seed": 0, "bias_scale": args.bias_scale}
        ckpt = os.path.join(tmp, "hf")
        oracle.run(base | {"save": {"dir": ckpt, "format": "hf"}})
        np.save(os.path.join(tmp, "tokens.npy"), tokens)
        old_tree = export_revision(args.against, os.path.join(tmp, "rev")) if args.against else None
        for dtype in ("bfloat16", "float32"):
            _, params = load_hf(ckpt, dtype=jnp.dtype(dtype))
            model = K2Model(cfg, jnp.dtype(dtype))
            fwd = jax.jit(lambda p, t: model.apply({"params": p}, t))
            toks = jnp.asarray(tokens, jnp.int32)
            jax.block_until_ready(fwd(params, toks))
            if dtype == "bfloat16":
                print(f"tokens per expert, max / mean over the {cfg.n_routed_experts} experts, by MoE layer: "
                      + " ".join(f"{r:.2f}" for r in load_skew(model, params, toks)))
            worker = Worker(old_tree, ckpt, dtype, os.path.join(tmp, "tokens.npy")) if old_tree else None
            oracle.run(base | {"bench": {"input_ids": tokens, "dtype": dtype, "warmup": 1, "repeats": 1}})
            # The runtime's own steps (k2jax.runtime.runner, one CPU device) read the experts through zero-copy
            # per-layer views of the same tree, which a switch on the layer reads in place.
            views = expert_views(params)
            jax.block_until_ready(fwd(views, toks))
            ours, theirs = {"this tree": [], "this tree, runtime's views": []}, []
            ours |= {f"{args.against} {name}": [] for name in (worker.layouts if worker else ())}
            for _ in range(args.rounds):
                theirs += list(oracle.run(base | {"bench": {"input_ids": tokens, "dtype": dtype, "warmup": 0,
                                                            "repeats": 1}})["bench.times"])
                ours["this tree"] += time_fn(fwd, params, toks, repeats=1, warmup=0)
                ours["this tree, runtime's views"] += time_fn(fwd, views, toks, repeats=1, warmup=0)
                for name in worker.layouts if worker else ():
                    ours[f"{args.against} {name}"].append(worker.time(name))
            if worker:
                worker.close()
            peak = matmul_peak(jnp.dtype(dtype))
            for name, times in ours.items():
                rows.append((dtype, name, median(times), median(theirs), flops / median(times), peak))
            del params, views
    width = max(len(r[1]) for r in rows)
    print(f"\n{'dtype':<9} {'k2jax':<{width}} {'k2jax ms':>9} {'HF ms':>9} {'speed-up':>9} {'k2jax GFLOP/s':>14} "
          f"{'matmul peak':>12} {'of peak':>8}")
    for dtype, name, ours, theirs, achieved, peak in rows:
        print(f"{dtype:<9} {name:<{width}} {ours * 1e3:>9.1f} {theirs * 1e3:>9.1f} {theirs / ours:>8.2f}x "
              f"{achieved / 1e9:>14.1f} {peak / 1e9:>12.1f} {achieved / peak:>7.0%}")


def export_revision(rev: str, dst: str) -> str:
    """The source tree of git revision `rev` of this repository, extracted under dst (read from git's history:
    the work tree is untouched)."""
    os.makedirs(dst)
    archive = subprocess.run(["git", "-C", REPO, "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", dst], input=archive, check=True)
    return dst


class Worker:
    """bench/forward_worker.py with another revision's k2jax: `layouts`, `time(layout)` -> seconds."""

    def __init__(self, tree: str, ckpt: str, dtype: str, tokens_path: str):
        env = dict(os.environ, PYTHONPATH=tree)
        self.proc = subprocess.Popen([sys.executable, os.path.join(REPO, "bench", "forward_worker.py"), ckpt, dtype,
                                      tokens_path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.layouts = self._read()["layouts"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the forward worker exited with status {self.proc.wait()}")
        return json.loads(line)

    def time(self, layout: str) -> float:
        self.proc.stdin.write(json.dumps({"time": layout}) + "\n")
        self.proc.stdin.flush()
        return self._read()["s"]

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def load_skew(model, params, tokens) -> np.ndarray:
    """max / mean tokens per expert in each MoE layer (1 = perfectly even)."""
    _, state = model.apply({"params": params}, tokens, mutable=["intermediates"])
    load_LE = np.asarray(state["intermediates"]["moe_layers"]["mlp"]["gate"]["load"][0])
    return load_LE.max(-1) / load_LE.mean(-1)


if __name__ == "__main__":
    main()
