"""Synthetic checkpoints in exactly the released Kimi K2 layout, for tests and benchmarks (nothing downloaded).

`write_release_checkpoint(cfg, path)` writes what the release has, for any config: config.json with the FP8
quantization_config, model.safetensors.index.json, `model-{k}-of-{n}.safetensors` shards cut into contiguous
runs of about equal bytes (embeddings first, layer by layer, norm and lm_head last; the same cut as
`save_hf`), F8_E4M3 block weights with float32 `weight_scale_inv`, bf16 embeddings / norms / router, float32
`e_score_correction_bias` and the `rotary_emb.inv_freq` buffers. It streams: one shard in memory at a time,
each tensor drawn from its own seed, so multi-GB checkpoints cost no more memory than a shard.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import zlib

import ml_dtypes
import numpy as np

from k2jax.checkpoint import names as N
from k2jax.checkpoint.fp8 import DEFAULT_BLOCK, FP8, quantize, scale_shape
from k2jax.checkpoint.hf import _release_order
from k2jax.checkpoint.safetensors_io import INDEX_NAME, write_file
from k2jax.config import K2Config

BF16 = np.dtype(ml_dtypes.bfloat16)


def _specs(cfg: K2Config, block) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Every tensor of the release layout for cfg: name -> (shape, dtype)."""
    out = {}
    for i in range(cfg.num_hidden_layers):
        out[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = ((cfg.qk_rope_head_dim // 2,), np.dtype(np.float32))
    for name in N.expected_names(cfg):
        t = N.resolve(name, cfg)
        shape = N.source_shape(name, cfg)
        if t.fp8:
            out[name] = (shape, FP8)
            out[N.scale_name(name)] = (scale_shape(shape, block), np.dtype(np.float32))
        elif t.path[-1] == "e_score_correction_bias":
            out[name] = (shape, np.dtype(np.float32))
        else:
            out[name] = (shape, BF16)
    return out


def _values(name: str, cfg: K2Config, seed: int, block, fast: bool) -> dict[str, np.ndarray]:
    """One weight's tensors (with its scale for FP8), drawn from a seed of (seed, name).

    Scales keep activations O(1) so the model computes something sensible: linear weights ~ N(0, 1/in),
    embeddings N(0, 1), norms 1 + N(0, 0.1), router N(0, 9/in) (the oracle's default), bias U[-0.5, 0.5].
    fast: FP8 bytes drawn uniformly (NaN patterns excluded) with random scales; for benchmarks only.
    """
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    if name.endswith(".inv_freq"):
        P = cfg.qk_rope_head_dim
        return {name: (1.0 / cfg.rope_theta ** (np.arange(0, P, 2, dtype=np.float32) / P)).astype(np.float32)}
    t = N.resolve(name, cfg)
    shape = N.source_shape(name, cfg)
    if t.fp8:
        if fast:
            q = rng.integers(0, 256, shape, dtype=np.uint8)
            q[(q & 0x7F) == 0x7F] ^= 1  # 0x7F / 0xFF are NaN in e4m3fn
            s = rng.uniform(0.5, 1.5, scale_shape(shape, block)).astype(np.float32) / (64 * math.sqrt(shape[1]))
            return {name: q.view(FP8), N.scale_name(name): s}
        q, s = quantize(rng.standard_normal(shape, np.float32) / math.sqrt(shape[1]), block)
        return {name: q, N.scale_name(name): s}
    leaf = t.path[-1]
    if leaf == "e_score_correction_bias":
        return {name: rng.uniform(-0.5, 0.5, shape).astype(np.float32)}
    if leaf == "weight" and t.path[0] != "mlp":  # RMSNorm weights
        x = 1.0 + 0.1 * rng.standard_normal(shape, np.float32)
    elif t.path == ("embed_tokens",):
        x = rng.standard_normal(shape, np.float32)
    elif t.path[:2] == ("mlp", "gate"):
        x = rng.standard_normal(shape, np.float32) * (3.0 / math.sqrt(shape[1]))
    else:
        x = rng.standard_normal(shape, np.float32) / math.sqrt(shape[1])
    return {name: x.astype(BF16)}


def random_params(cfg: K2Config, dtype=np.float32, seed: int = 0, scale: float = 0.15):
    """Random params without compiling an init (jax.eval_shape of the model): vectors (norms, router bias)
    near 1, matrices ~N(0, scale²). The default scale separates logits well (no greedy ties)."""
    import jax
    import jax.numpy as jnp

    from k2jax.nn.model import abstract_params

    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: jnp.asarray(1 + 0.1 * rng.standard_normal(s.shape) if len(s.shape) == 1
                                              else scale * rng.standard_normal(s.shape), s.dtype),
                        abstract_params(cfg, dtype))


def write_release_checkpoint(cfg: K2Config | dict | str | os.PathLike, path: str | os.PathLike,
                             num_shards: int | None = None, seed: int = 0, block=DEFAULT_BLOCK,
                             fast: bool = False, shard_bytes: int = 1 << 30) -> pathlib.Path:
    """Write a synthetic FP8 checkpoint of `cfg` (K2Config, HF dict or config.json path) in the released layout
    at `path`; -> path. num_shards None: about `shard_bytes` per shard. Same arguments, same bytes."""
    cfg = cfg if isinstance(cfg, K2Config) else K2Config.from_hf_config(cfg)
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    block = tuple(block)
    specs = _specs(cfg, block)
    nbytes = {n: math.prod(s) * d.itemsize for n, (s, d) in specs.items()}
    total = sum(nbytes.values())
    num_shards = num_shards or max(1, math.ceil(total / shard_bytes))
    shards: list[list[str]] = [[] for _ in range(num_shards)]
    acc = 0
    for n in sorted(specs, key=_release_order):  # the cut save_hf makes
        shards[min(num_shards - 1, acc * num_shards // max(total, 1))].append(n)
        acc += nbytes[n]
    weight_map = {}
    for k, shard in enumerate(shards, 1):
        fname = f"model-{k}-of-{num_shards}.safetensors"
        tensors = {}
        for n in shard:
            if not N.is_scale(n):  # a scale comes with its weight (the cut may put them in different shards)
                tensors |= _values(n, cfg, seed, block, fast)
        for n in [n for n in tensors if n not in shard]:  # scales of this shard's weights living in another one
            del tensors[n]
        for n in shard:
            if n not in tensors:  # scales whose weight is in another shard
                tensors |= {n: _values(N.weight_of_scale(n), cfg, seed, block, fast)[n]}
        write_file(path / fname, tensors, {"format": "pt"})
        weight_map.update({n: fname for n in shard})
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / INDEX_NAME).write_text(json.dumps(index, indent=2))
    hf = cfg.to_hf_config()
    hf["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                 "weight_block_size": list(block)}
    hf["torch_dtype"] = "bfloat16"
    (path / "config.json").write_text(json.dumps(hf, indent=2))
    return path


_LAUNCHER = ("import os, subprocess, sys, time; t = time.perf_counter(); p = subprocess.Popen(sys.argv[1:]); "
             "_, st, u = os.wait4(p.pid, 0); "
             "print(u.ru_maxrss * 1024, time.perf_counter() - t, u.ru_utime + u.ru_stime); "
             "sys.exit(os.waitstatus_to_exitcode(st))")


def run_measured(cmd: list[str], env: dict | None = None) -> tuple[int, int, float, float]:
    """Run `cmd` -> (exit status, its peak RSS in bytes, wall seconds, CPU seconds).

    The peak comes from wait4 in a small launcher process, not in the caller: a child's ru_maxrss starts
    from the RSS of the process it was forked from (Linux keeps the old image's high-water mark across exec),
    which in a test or benchmark process holding a model would swamp the figure.
    """
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", _LAUNCHER, *cmd], env=env, stdout=subprocess.PIPE, text=True)
    rss, wall, cpu = p.stdout.split()[-3:]
    return p.returncode, int(rss), float(wall), float(cpu)


_PREFILL_SCRIPT = """
import time, jax, jax.numpy as jnp
from k2jax import K2Config, K2Model, init_params
from k2jax.inference.cache import init_cache
cfg = K2Config.from_hf_config({config!r})
model, L = K2Model(cfg), {length}
params = init_params(cfg, jax.random.PRNGKey(0))
tokens = jax.random.randint(jax.random.PRNGKey(1), (1, L), 0, cfg.vocab_size)
cache = init_cache(cfg, 1, L, "float32", page_size=64)
f = jax.jit(lambda p, t, c: model.apply({{"params": p}}, t, None, None, c, jnp.full((1,), L - 1)))
compiled = f.lower(params, tokens, cache).compile()

def status(key):  # kB; VmHWM is this process's own peak (getrusage's maxrss also counts the parent at fork)
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key))

open("/proc/self/clear_refs", "w").write("5")  # restart the peak from here: only the run is measured
before = status("VmRSS:")
t = time.perf_counter()
logits, cache = jax.block_until_ready(compiled(params, tokens, cache))
assert logits.shape == (1, cfg.vocab_size) and int(cache.lengths[0]) == L
print(time.perf_counter() - t, before / 1024, (status("VmHWM:") - before) / 1024)
"""


def prefill_memory(length: int, config: str | os.PathLike, timeout: float = 900) -> tuple[float, float, float]:
    """Run one prefill of `length` tokens of `config` (random params, one CPU device) in a fresh process:
    -> (seconds, MiB resident before the run, MiB the peak grew during the run; compile excluded)."""
    import subprocess
    import sys

    script = _PREFILL_SCRIPT.format(config=str(config), length=int(length))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout, env=env)
    if out.returncode:
        raise RuntimeError(f"prefill of {length} tokens failed:\n{out.stderr[-3000:]}")
    seconds, before, grew = (float(x) for x in out.stdout.split()[-3:])
    return seconds, before, grew
