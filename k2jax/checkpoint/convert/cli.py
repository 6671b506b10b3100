"""The converter's command line: tools/convert/convert.py and `k2jax convert`."""

from __future__ import annotations

import argparse
import os
import sys

from k2jax import distributed
from k2jax.checkpoint.convert.errors import first_line
from k2jax.checkpoint.convert.job import convert
from k2jax.checkpoint.convert.verify import DTYPES

DESCRIPTION = """\
Convert a HuggingFace DeepSeek-V3 / Kimi K2 checkpoint (the released FP8 safetensors, Kimi-K2-Thinking's INT4,
Kimi-K2.5's text model, or bf16/f32) into a k2jax Orbax checkpoint that `k2jax.load(DST)` (or a plain Orbax
restore of `k2jax.abstract_params`) reads, sharded, straight onto devices.

Every header and FP8 scale is verified first, against config.json; all problems are listed together and
nothing is written. Conversion streams tensor by tensor on --workers threads (memory: a few tensors, not the
model), and can be killed at any moment: rerun the same command to resume. DST is marked complete only at
the very end (k2jax_manifest.json); a complete DST is replaced only with --overwrite.

On several hosts sharing DST (a gs:// URL, or a shared filesystem), run the same command on each with
--distributed (a TPU slice) or --coordinator/--num-processes/--process-id: each process converts its own
contiguous share of the layers, reading (or downloading, from the Hub) only the files that hold them, and every
process returns only once DST is complete.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", metavar="SRC",
                   help="the HF checkpoint: a directory (config.json, model.safetensors.index.json or "
                        "model.safetensors, and the shard files), a gs://BUCKET/PATH holding the same (read in ranges, "
                        "never downloaded whole), or a Hugging Face repo id, e.g. moonshotai/Kimi-K2-Instruct "
                        "(downloaded into the HF cache: HF_HOME, HF_TOKEN or `huggingface-cli login`, HF_ENDPOINT)")
    p.add_argument("dst", metavar="DST", help="output directory or gs://BUCKET/PATH (created; resumed if a same-job "
                                              "conversion was interrupted)")
    p.add_argument("--revision", default=None,
                   help="with a repo id SRC: the branch, tag or commit to convert (default main)")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES,
                   help="bfloat16 (default) or float32: FP8 / INT4 weights dequantized with their scales; "
                        "float8: keep an FP8 release's e4m3 weights and store their scales beside them; int4: keep "
                        "a Kimi-K2-Thinking checkpoint's INT4 routed experts as stored (packed 4-bit values + bf16 "
                        "scales), the rest bf16. k2jax.load(DST, quant=...) holds them quantized on device")
    p.add_argument("--workers", type=int, default=None,
                   help="threads converting and writing (default: min(8, 2 x CPUs); two more threads read ahead)")
    p.add_argument("--layers", metavar="A:B", default=None,
                   help="convert only decoder layers A..B-1 (plus embeddings/norm/lm_head when A is 0), e.g. to "
                        "split the work over hosts sharing DST; the last run to finish marks DST complete")
    p.add_argument("--overwrite", action="store_true", help="replace a complete checkpoint (or another job's "
                                                            "unfinished one) at DST")
    p.add_argument("--quiet", action="store_true", help="no progress bar or log lines, only errors")
    p.add_argument("--no-direct-io", dest="direct_io", action="store_false",
                   help="read and write through the page cache (default: O_DIRECT where the filesystem allows it, "
                        "which saves most of the CPU time of a conversion)")
    distributed.add_arguments(p)


def run(args: argparse.Namespace, prog: str = "k2jax convert") -> int:
    """Run a parsed command line; -> exit status. Errors are one cause (or one list of problems), no traceback."""
    quiet = args.quiet
    log = (lambda *a, **k: None) if quiet else (lambda *a, **k: print(*a, file=sys.stderr, **k))
    try:
        # one progress bar and report: process 0's
        if distributed.initialize_from_args(args) and not distributed.is_main():
            quiet, log = True, (lambda *a, **k: None)
        stats = convert(args.src, args.dst, dtype=args.dtype, workers=args.workers, layers=args.layers,
                        overwrite=args.overwrite, quiet=quiet, log=log, direct_io=args.direct_io,
                        revision=args.revision)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    except (ValueError, OSError) as e:  # ConvertError, SafetensorsError, config errors, I/O
        msg = str(e) if isinstance(e, ValueError) else f"{e.filename or ''}: {e.strerror or e}".lstrip(": ")
        print(f"{prog}: error: {msg}", file=sys.stderr)
        return 2
    except Exception as e:  # a bug: still one line, the traceback on request
        if os.environ.get("K2JAX_DEBUG"):
            raise
        print(f"{prog}: internal error: {type(e).__name__}: {first_line(e)} (K2JAX_DEBUG=1 shows the traceback)",
              file=sys.stderr)
        return 1
    gb = stats.bytes_read / 1e9
    if stats.complete:
        log(f"{args.dst}: complete. {stats.tensors} tensors, {gb:.2f} GB read in {stats.seconds:.1f} s "
            f"({gb / max(stats.seconds, 1e-9):.2f} GB/s); {stats.units_converted} units converted now, "
            f"{stats.units_skipped} already done")
    else:
        log(f"{args.dst}: {stats.units_converted} units converted now, {stats.units_left} left for other --layers "
            f"runs; not complete until every layer range is converted")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="convert.py", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv), prog="convert")
