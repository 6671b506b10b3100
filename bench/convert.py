"""Conversion throughput against a plain sequential read and `cp` of the same source bytes, and the converter's
peak memory. Goal: the conversion reads its source at >= 70% of the plain sequential read rate of the same files
on the same storage; peak memory bounded by a constant number of tensor buffers (printed), not the file sizes.
--emulator: the same against a GCS emulator started here (the source uploaded to it, converted from gs://).

A synthetic FP8 checkpoint in the released layout (k2jax.testing; wide enough that tensors are MBs, a few GB in
all) is converted end to end by `tools/convert/convert.py` in a child process (its peak RSS from wait4), and
copied with `cp -r`, both after dropping the source from the page cache (posix_fadvise DONTNEED) and both
including the flush of what they wrote (sync). Prints source GB/s, the ratio to cp, peak RSS against the largest
decoder block (converted), and the projected time for the 959 GB release on this disk. The converter moves its
data with O_DIRECT (its default), cp through the page cache; --no-direct-io runs the converter that way too.

    python bench/convert.py [--dir /tmp/k2jax-bench-convert] [--layers 8] [--experts 64] [--dtype bfloat16]
                            [--workers N] [--no-direct-io] [--emulator]
    (--layers 8 --experts 64: the bench config's release, about 3 GB; --layers 4: about 1.5 GB)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import shutil
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RELEASE_BYTES = 959e9


def bench_config(layers: int, experts: int) -> dict:
    """Kimi K2's shape at 2/7 of its width: tensors of 1-10 MB, like the release's 7168 x 2048 experts."""
    cfg = json.loads((REPO / "configs" / "kimi_k2.json").read_text())
    cfg.update(hidden_size=2048, intermediate_size=5120, moe_intermediate_size=1024, num_hidden_layers=layers,
               num_attention_heads=16, num_key_value_heads=16, q_lora_rank=768, kv_lora_rank=256,
               n_routed_experts=experts, num_experts_per_tok=8, first_k_dense_replace=1, vocab_size=32768)
    cfg.pop("auto_map", None)
    return cfg


def drop_cache(root: pathlib.Path) -> None:
    os.sync()
    for p in root.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def timed(cmd: list[str]) -> tuple[float, int, float]:
    """Wall seconds (command + sync of what it wrote), the child's peak RSS in bytes, its CPU seconds."""
    from k2jax.testing import run_measured

    t = time.perf_counter()
    status, rss, _, cpu = run_measured(cmd)
    os.sync()
    wall = time.perf_counter() - t
    if status:
        raise SystemExit(f"{' '.join(cmd)}: exit {status}")
    return wall, rss, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/k2jax-bench-convert", help="work directory (source kept for reruns)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float8"))
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--emulator", action="store_true",
                    help="read the source from a GCS emulator (gcp-storage-emulator, started here) instead of the disk")
    ap.add_argument("--no-direct-io", action="store_true",
                    help="pass --no-direct-io: the converter reads and writes through the page cache, as cp does")
    args = ap.parse_args()

    from k2jax import K2Config
    from k2jax.testing import write_release_checkpoint

    work = pathlib.Path(args.dir)
    src = work / "src"
    cfg_dict = bench_config(args.layers, args.experts)
    stamp = src / "bench_config.json"
    if not stamp.is_file() or json.loads(stamp.read_text()) != cfg_dict:
        shutil.rmtree(src, ignore_errors=True)
        t = time.perf_counter()
        write_release_checkpoint(cfg_dict, src, fast=True, shard_bytes=512 << 20)
        stamp.write_text(json.dumps(cfg_dict))
        print(f"wrote the synthetic source in {time.perf_counter() - t:.1f} s")
    cfg = K2Config.from_hf_config(src)
    src_bytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    nfiles = len(list(src.glob("*.safetensors")))
    block_bytes = largest_block_bytes(cfg, args.dtype)

    dst, copy = work / "dst", work / "cp"
    for d in (dst, copy):
        shutil.rmtree(d, ignore_errors=True)
    source = str(src)
    if args.emulator:
        source = start_emulator_with(src)
    drop_cache(src)
    t_rd, _, _ = timed([sys.executable, "-c", SEQUENTIAL_READ, source])
    drop_cache(src)
    t_cp, _, cpu_cp = timed(["cp", "-r", str(src), str(copy)])
    shutil.rmtree(copy)
    drop_cache(src)
    cmd = [sys.executable, str(REPO / "tools" / "convert" / "convert.py"), source, str(dst), "--quiet",
           "--dtype", args.dtype] + (["--workers", str(args.workers)] if args.workers else []) + \
        (["--no-direct-io"] if args.no_direct_io else [])
    t_cv, rss, cpu_cv = timed(cmd)
    out_bytes = sum(p.stat().st_size for p in dst.rglob("*") if p.is_file())
    shutil.rmtree(dst)

    gbs_cp, gbs_cv = src_bytes / t_cp / 1e9, src_bytes / t_cv / 1e9
    print(f"source: {src_bytes / 1e9:.2f} GB in {nfiles} files ({cfg.num_hidden_layers} layers, "
          f"{cfg.n_routed_experts} experts, hidden {cfg.hidden_size}); output {args.dtype}: {out_bytes / 1e9:.2f} GB;"
          f" {os.cpu_count()} CPUs")
    gbs_rd = src_bytes / t_rd / 1e9
    where = "GCS emulator" if args.emulator else "local disk"
    print(f"source on the {where}")
    print(f"{'':16}{'seconds':>10}{'src MB/s':>10}{'vs read':>9}{'vs cp':>8}{'CPU s/GB':>10}")
    print(f"{'sequential read':16}{t_rd:>10.2f}{gbs_rd * 1e3:>10.0f}{1.0:>9.2f}{gbs_rd / gbs_cp:>8.2f}{'':>10}")
    print(f"{'cp -r (disk)':16}{t_cp:>10.2f}{gbs_cp * 1e3:>10.0f}{gbs_cp / gbs_rd:>9.2f}{1.0:>8.2f}"
          f"{cpu_cp / (src_bytes / 1e9):>10.2f}")
    print(f"{'convert':16}{t_cv:>10.2f}{gbs_cv * 1e3:>10.0f}{gbs_cv / gbs_rd:>9.2f}{gbs_cv / gbs_cp:>8.2f}"
          f"{cpu_cv / (src_bytes / 1e9):>10.2f}   (goal: vs read >= 0.70)")
    from k2jax.checkpoint.convert.codec import PIECE_BYTES
    from k2jax.checkpoint.safetensors_io import Scratch

    workers = args.workers or min(8, 2 * (os.cpu_count() or 1))
    bound = workers * 4 * max(PIECE_BYTES, Scratch.KEEP_BYTES)
    print(f"peak RSS {rss / 2**30:.2f} GiB; bound {bound / 2**30:.2f} GiB = {workers} workers x 4 buffers (read, in, "
          f"out, chunk) of at most {max(PIECE_BYTES, Scratch.KEEP_BYTES) >> 20} MiB, whatever the file sizes; "
          f"largest block converted {block_bytes / 2**30:.2f} GiB")
    print(f"projected for the 959 GB release at this rate: convert {RELEASE_BYTES / gbs_cv / 1e9 / 3600:.2f} h, "
          f"cp {RELEASE_BYTES / gbs_cp / 1e9 / 3600:.2f} h")


# Read every .safetensors file under argv[1] (a directory or gs:// URL) once, front to back, 16 MiB at a time.
SEQUENTIAL_READ = r"""
import os, sys
root = sys.argv[1]
if root.startswith("gs://"):
    from k2jax.checkpoint.storage import gcs_fs
    fs = gcs_fs()
    for k in sorted(fs.find(root[5:])):
        if k.endswith(".safetensors"):
            with fs.open(k, "rb", block_size=16 << 20) as f:
                while f.read(16 << 20):
                    pass
else:
    for n in sorted(os.listdir(root)):
        if n.endswith(".safetensors"):
            with open(os.path.join(root, n), "rb", buffering=0) as f:
                while f.read(16 << 20):
                    pass
"""


def start_emulator_with(src: pathlib.Path) -> str:
    """Start a GCS emulator (in memory), point this process and its children at it, upload `src`; -> its URL."""
    from tests.storage_servers import emulator, gcs_env, upload

    url, _ = emulator()
    os.environ.update(gcs_env(url))
    return upload(src, "gs://k2jax-test/bench-src")


def largest_block_bytes(cfg, dtype: str) -> int:
    """Bytes of the biggest decoder block's converted params (a slot of every stacked leaf)."""
    import jax
    import jax.numpy as jnp

    from k2jax import abstract_params

    dt = jnp.bfloat16 if dtype == "float8" else jnp.dtype(dtype)
    tree = abstract_params(cfg, dt)
    best = 0
    for group in ("dense_layers", "moe_layers"):
        if group in tree:
            leaves = jax.tree.leaves(tree[group])
            per = sum(math.prod(l.shape[1:]) * (1 if dtype == "float8" and l.ndim > 2 and l.dtype == dt
                                                else jnp.dtype(l.dtype).itemsize) for l in leaves)
            best = max(best, per)
    return best


if __name__ == "__main__":
    main()
