"""Conversion throughput against a plain sequential read and `cp` of the same source bytes, and the converter's
peak memory. Goal: the conversion reads its source at >= 70% of the plain sequential read rate of the same files
on the same storage; peak memory bounded by a constant number of tensor buffers (printed), not the file sizes.
--emulator: the same against a GCS emulator started here (the source uploaded to it, converted from gs://).

A synthetic FP8 checkpoint in the released layout (k2jax.testing; wide enough that tensors are MBs, a few GB in
all) is converted end to end by `tools/convert/convert.py` in a child process (its peak RSS and CPU time from
wait4), and copied with `cp -r`, each after dropping the source from the page cache (posix_fadvise DONTNEED)
and each including the flush of what it wrote (sync). --repeat N runs each N times, interleaved; the figures
are medians. --baseline DIR times another checkout's converter (e.g. main: `git worktree add DIR main`)
beside this one in the same runs, and checks that both wrote the same bytes.

Start-up (imports, reading every header and scale, tracing the model's shapes: the converter run again on its
finished output, which does all of that and then finds nothing to do) is the same few seconds whatever the
size, so a 3 GB bench pays it in full and the 959 GB release not at all: the table also gives the rate after
start-up, and the goal is judged on it (and on the end-to-end rate of a bigger run: --layers 32 is 13 GB).

The converter moves its data with O_DIRECT (its default), cp through the page cache; --no-direct-io runs the
converter that way too. A bfloat16 conversion writes twice the bytes it reads (the FP8 source dequantized): on
a disk that reads faster than it writes, its bound is the bytes moved, so the table gives bytes moved (read +
written) per second against cp's as well.

    python bench/convert.py [--dir /tmp/k2jax-bench-convert] [--layers 8] [--experts 64] [--dtype float8]
                            [--config configs/bench.json] [--repeat 3] [--baseline DIR] [--workers N]
                            [--no-direct-io] [--emulator]
    (--layers 8 --experts 64: the wide bench release, 3.2 GB in 7 files; --layers 4: about 1.6 GB; --layers 16:
    6.5 GB; --config configs/bench.json: the bench config's own release, 0.3 GB of sub-MB tensors)
"""

from __future__ import annotations

import argparse
import filecmp
import json
import math
import os
import pathlib
import shutil
import statistics
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RELEASE_BYTES = 959e9


def bench_config(layers: int, experts: int, path: str | None = None) -> dict:
    """Kimi K2's shape at 2/7 of its width: tensors of 1-10 MB, like the release's 7168 x 2048 experts; or the
    config at `path` with that many layers and experts."""
    if path:
        cfg = json.loads(pathlib.Path(path).read_text())
        cfg.update(num_hidden_layers=layers, n_routed_experts=experts)
        return cfg
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


def timed(cmd: list[str], env: dict | None = None) -> tuple[float, int, float]:
    """Wall seconds (command + sync of what it wrote), the child's peak RSS in bytes, its CPU seconds."""
    from k2jax.testing import run_measured

    t = time.perf_counter()
    status, rss, _, cpu = run_measured(cmd, env)
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
    ap.add_argument("--config", metavar="JSON", help="an HF config.json whose release is synthesized instead of the "
                    "wide one (e.g. configs/bench.json); --layers and --experts still apply")
    ap.add_argument("--dtype", default="float8", choices=("float8", "bfloat16", "float32"))
    ap.add_argument("--repeat", type=int, default=1, help="runs of each, interleaved; medians reported")
    ap.add_argument("--baseline", metavar="DIR", help="another k2jax checkout whose converter is timed beside")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--out", metavar="DIR", help="where the conversions, cp's copy and the write test go (default: "
                    "--dir, the source's disk); e.g. /dev/shm to time the reading side alone")
    ap.add_argument("--emulator", action="store_true",
                    help="read the source from a GCS emulator (gcp-storage-emulator, started here) instead of the disk")
    ap.add_argument("--no-direct-io", action="store_true",
                    help="pass --no-direct-io: the converter reads and writes through the page cache, as cp does")
    args = ap.parse_args()

    from k2jax import K2Config
    from k2jax.checkpoint.convert.pool import WORKERS, memory_bound
    from k2jax.testing import write_release_checkpoint

    work = pathlib.Path(args.dir)
    src = work / "src"
    out = pathlib.Path(args.out or work)
    out.mkdir(parents=True, exist_ok=True)
    cfg_dict = bench_config(args.layers, args.experts, args.config)
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

    source = start_emulator_with(src) if args.emulator else str(src)
    converters = {"convert": REPO} | ({"baseline": pathlib.Path(args.baseline).resolve()} if args.baseline else {})
    flags = ["--dtype", args.dtype] + (["--workers", str(args.workers)] if args.workers else []) + \
        (["--no-direct-io"] if args.no_direct_io else [])
    runs: dict[str, list[tuple[float, int, float]]] = {}
    out_bytes = 0
    for rep in range(args.repeat):
        drop_cache(src)
        runs.setdefault("read", []).append(timed([sys.executable, "-c", SEQUENTIAL_READ, source]))
        copy = out / "cp"
        shutil.rmtree(copy, ignore_errors=True)
        drop_cache(src)
        runs.setdefault("cp", []).append(timed(["cp", "-r", str(src), str(copy)]))
        shutil.rmtree(copy)
        for name, repo in converters.items():
            dst = out / f"dst-{name}"
            shutil.rmtree(dst, ignore_errors=True)
            drop_cache(src)
            cmd = [sys.executable, str(repo / "tools" / "convert" / "convert.py"), source, str(dst), "--quiet"]
            runs.setdefault(name, []).append(timed(cmd + flags, dict(os.environ, PYTHONPATH=str(repo))))
            if name == "convert":
                out_bytes = sum(p.stat().st_size for p in dst.rglob("*") if p.is_file())
                if rep == 0:  # start-up: the same command on the finished DST verifies, traces, finds it done
                    runs["start-up"] = [timed(cmd + flags, dict(os.environ, PYTHONPATH=str(repo)))]
            if rep < args.repeat - 1:
                shutil.rmtree(dst)
        written = out / "sequential-write"
        write = [sys.executable, "-c", SEQUENTIAL_WRITE, str(written), str(out_bytes)]
        runs.setdefault("write", []).append(timed(write))
        written.unlink()
    same = None
    if args.baseline:
        same = trees_equal(out / "dst-convert", out / "dst-baseline")
    for name in converters:
        shutil.rmtree(out / f"dst-{name}")

    med = {k: (statistics.median(r[0] for r in v), max(r[1] for r in v), statistics.median(r[2] for r in v))
           for k, v in runs.items()}
    gb = src_bytes / 1e9
    t_up, t_cv = med["start-up"][0], med["convert"][0]
    steady = src_bytes / max(t_cv - t_up, 1e-9)
    t_rd, t_cp = med["read"][0], med["cp"][0]
    print(f"source: {gb:.2f} GB in {nfiles} files ({cfg.num_hidden_layers} layers, {cfg.n_routed_experts} experts, "
          f"hidden {cfg.hidden_size}) on the {'GCS emulator' if args.emulator else 'local disk'}; output "
          f"{args.dtype}: {out_bytes / 1e9:.2f} GB{'' if out == work else f' to {out}'}; {os.cpu_count()} CPUs; "
          f"medians of {args.repeat} run(s)")
    print(f"{'':18}{'seconds':>9}{'src MB/s':>10}{'vs read':>9}{'vs cp':>7}{'CPU s/GB':>10}"
          f"{'moved GB':>10}{'moved MB/s':>12}{'vs cp':>7}")
    moved_cp = 2 * src_bytes / t_cp

    def row(label, t, cpu, moved):
        rate = src_bytes / t
        print(f"{label:18}{t:>9.2f}{rate / 1e6:>10.0f}{rate * t_rd / src_bytes:>9.2f}{rate * t_cp / src_bytes:>7.2f}"
              f"{'' if cpu is None else f'{cpu / gb:.2f}':>10}{moved / 1e9:>10.2f}{moved / t / 1e6:>12.0f}"
              f"{moved / t / moved_cp:>7.2f}")

    row("sequential read", t_rd, None, src_bytes)
    t_wr = med["write"][0]
    print(f"{'sequential write':18}{t_wr:>9.2f}{'':>36}{out_bytes / 1e9:>10.2f}{out_bytes / t_wr / 1e6:>12.0f}"
          f"{out_bytes / t_wr / moved_cp:>7.2f}   (the output's bytes, one file)")
    row("cp -r", t_cp, med["cp"][2], 2 * src_bytes)
    for name in converters:
        row(name if name == "convert" else f"convert {name}", med[name][0], med[name][2], src_bytes + out_bytes)
    if args.repeat > 1:
        print("each run (s): " + "; ".join(f"{k} {', '.join(f'{r[0]:.2f}' for r in v)}" for k, v in runs.items()))
    print(f"start-up {t_up:.2f} s (imports, every header and scale read and checked, the model's shapes traced: "
          f"the converter rerun on its finished output), {med['start-up'][2]:.2f} CPU s")
    print(f"after start-up: convert {steady / 1e6:.0f} MB/s = {steady * t_rd / src_bytes:.2f} of the sequential "
          f"read (goal >= 0.70), {steady * t_cp / src_bytes:.2f} of cp; bytes moved "
          f"{(src_bytes + out_bytes) / (t_cv - t_up) / moved_cp:.2f} of cp's")
    io = src_bytes / (t_rd + t_wr)
    print(f"I/O alone: reading the source then writing the output's bytes sequentially takes {t_rd + t_wr:.2f} s, "
          f"a source rate of {io / 1e6:.0f} MB/s = {io * t_rd / src_bytes:.2f} of the sequential read; convert after "
          f"start-up reaches {steady / io:.2f} of that")
    if args.dtype != "float8":
        print(f"write bound: a {args.dtype} conversion writes {out_bytes / src_bytes:.2f} bytes per byte read (cp: 1), "
              f"so at cp's bytes-moved rate it would read at {moved_cp / (1 + out_bytes / src_bytes) / 1e6:.0f} MB/s "
              f"= {moved_cp / (1 + out_bytes / src_bytes) * t_rd / src_bytes:.2f} of the sequential read")
    if same is not None:
        print(f"output identical to the baseline's: {same}")
    bound, how = memory_bound(args.workers or WORKERS)
    print(f"peak RSS {med['convert'][1] / 2**30:.2f} GiB; buffers bounded by {bound / 2**30:.2f} GiB = {how}, whatever "
          f"the file sizes; largest decoder block converted {block_bytes / 2**30:.2f} GiB")
    print(f"projected for the 959 GB release at the rate after start-up: "
          f"convert {RELEASE_BYTES / steady / 3600:.2f} h, cp {RELEASE_BYTES / (src_bytes / t_cp) / 3600:.2f} h")


def trees_equal(a: pathlib.Path, b: pathlib.Path) -> bool:
    """Same files with the same bytes under a and b."""
    fa = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    fb = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    return fa == fb and all(filecmp.cmp(a / f, b / f, shallow=False) for f in fa)


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


# Write argv[2] bytes (a 16 MiB random block over and over) to the file argv[1] through the page cache, as cp
# writes (`timed` syncs after it, as after cp).
SEQUENTIAL_WRITE = r"""
import os, sys
block, left = os.urandom(16 << 20), int(sys.argv[2])
with open(sys.argv[1], "wb", buffering=0) as f:
    while left > 0:
        left -= f.write(block[:min(left, len(block))])
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
