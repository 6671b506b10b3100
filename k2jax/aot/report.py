"""What `k2jax plan --compile` prints: the compiler's per-chip bytes of each program beside the plan's
estimate (and why they differ where they do by more than 5%), the collectives, the loops, and the weight
checks; the same as a JSON-ready dict."""

from __future__ import annotations

import dataclasses

from k2jax.aot.compile import Result
from k2jax.aot.hlo import Array
from k2jax.plan import Chip, Plan, mesh_str
from k2jax.sharding import format_bytes

TOLERANCE = 0.05  # the plan's estimate and the compiler's figure: a larger difference is explained


def difference(res: Result) -> float:
    """(compiler's argument bytes - plan's) / plan's."""
    return (res.argument_bytes - res.estimate_arguments) / max(res.estimate_arguments, 1)


def explain(res: Result) -> list[str]:
    """Why the compiler's argument bytes differ from the plan's, attributing what the arguments' tiled
    layouts pad (the plan counts logical bytes: a [.., 576] array is laid out in 128-wide tiles on a TPU,
    so its minor dim takes 640)."""
    diff = res.argument_bytes - res.estimate_arguments
    lines = [f"arguments differ from the plan by {format_bytes(diff)} ({difference(res):+.1%}):"]
    lines.append(f"  TPU tiling pads the arguments by {format_bytes(res.padding)} "
                 f"({res.padding / max(abs(diff), 1):.0%} of the difference); largest:")
    for name, a, extra in res.padded[:3]:
        lines.append(f"    {name} {a} {_tiling(a)}: +{format_bytes(extra)}")
    rest = diff - res.padding
    if abs(rest) > TOLERANCE * res.estimate_arguments:
        lines.append(f"  the rest, {format_bytes(rest)}, is not explained by padding: the plan misses an argument "
                     "or the compiler holds one differently")
    return lines


def _tiling(a: Array) -> str:
    """"tiled (8,128) on dims 3,2: 576 -> 640"."""
    if not a.tiles or a.minor_to_major is None:
        return ""
    tile = a.tiles[0]
    parts = []
    for k, t in enumerate(reversed(tile)):
        if k < len(a.minor_to_major):
            d = a.minor_to_major[k]
            padded = -(-a.dims[d] // t) * t
            if padded != a.dims[d]:
                parts.append(f"dim {d}: {a.dims[d]} -> {padded}")
    return f"(tile {tile}: {', '.join(parts)})" if parts else f"(tile {tile})"


def format_compile(results: list[Result], p: Plan, topology: str, chip: Chip, reserve: float = 0.1,
                   recommended: bool = False, what: str = "") -> str:
    """The report of `k2jax plan --compile`."""
    usable = chip.hbm * (1 - reserve)
    kv = p.kv
    lines = [f"{what}compiled for {topology}: {p.devices} chips of {chip.label}, {format_bytes(chip.hbm)} each "
             f"({format_bytes(usable)} usable at {reserve:.0%} reserve)",
             f"mesh {mesh_str(p.mesh)}{' (recommended by plan)' if recommended else ''}, weights {p.label}, "
             f"KV cache {p.kv_dtype}, {kv.batch} rows x {kv.max_len} tokens in pages of {kv.page_size}",
             "the compiler's figures per chip (deviceless ahead-of-time compile: nothing ran); total = arguments "
             "+ temp + output, as memory_analysis() counts them (the donated state is in arguments and, "
             "aliased, in output)",
             f"{'program':<8} {'rows x tokens':>13} {'pages':>9} {'arguments':>10} {'temp':>9} {'output':>9} "
             f"{'aliased':>9} {'total':>9} {'plan args':>10} {'diff':>6} {'compile':>8}"]
    for r in results:
        s = r.shape
        head = f"{r.name:<8} {f'{s.rows} x {s.tokens}':>13} {f'{s.read_pages}/{s.table_pages}':>9}"
        if r.error:
            lines.append(f"{head}  FAILED after {r.seconds:.0f} s")
            continue
        lines.append(f"{head} {format_bytes(r.argument_bytes):>10} {format_bytes(r.temp_bytes):>9} "
                     f"{format_bytes(r.output_bytes):>9} {format_bytes(r.alias_bytes):>9} "
                     f"{format_bytes(r.total_bytes):>9} {format_bytes(r.estimate_arguments):>10} "
                     f"{difference(r):>+6.1%} {r.seconds:>7.0f}s")
    lines.append("")
    for r in results:
        if r.error:
            lines += [f"{r.name}: the compiler refused it:", f"  {r.error[:2000]}", ""]
            continue
        lines.append(f"{r.name}:")
        fits = r.total_bytes <= usable
        lines.append(f"  per chip {format_bytes(r.total_bytes)} of {format_bytes(usable)} usable: "
                     f"{'fits' if fits else 'DOES NOT FIT'}; at the peak (aliased output counted once) "
                     f"{format_bytes(r.live_bytes)}")
        if abs(difference(r)) > TOLERANCE:
            lines += ["  " + ln for ln in explain(r)]
        else:
            lines.append(f"  plan's argument estimate within {TOLERANCE:.0%} ({difference(r):+.1%}); TPU tiling "
                         f"pads the arguments by {format_bytes(r.padding)}")
        lines.append("  collectives per run (loop trip counts applied): " + (", ".join(
            f"{k} {v['ops']} ops x {v['runs']} runs = {format_bytes(v['bytes'])}" for k, v in r.collectives.items())
            or "none"))
        dyn = [lp for lp in r.loops if lp.trips is None]
        if dyn:
            lines.append(f"  {len(dyn)} loop(s) whose trip count is known only at run time counted once")
        if p.quant:
            if r.weight_copies:
                lines.append(f"  {len(r.weight_copies)} materialized copies of quantized weights larger than one "
                             f"layer's chosen experts ({format_bytes(r.copy_limit)}):")
                lines += [f"    {arr} at {where} from {', '.join(src)}" for where, arr, src in r.weight_copies[:8]]
            else:
                lines.append("  no materialized copy of a quantized weight larger than one layer's chosen experts "
                             f"({format_bytes(r.copy_limit)})")
        if r.weight_collectives:
            lines.append(f"  {len(r.weight_collectives)} collectives move weight data:")
            lines += [f"    {what_} at {where} from {', '.join(src)}" for where, what_, src in r.weight_collectives[:8]]
        else:
            lines.append("  no collective moves weight data (tokens only)")
    return "\n".join(lines).rstrip()


def result_json(r: Result) -> dict:
    """A Result as plain JSON types."""
    d = {"program": r.name, "shape": dataclasses.asdict(r.shape), "compile_seconds": round(r.seconds, 2),
         "error": r.error}
    if r.error:
        return d
    d |= {"argument_bytes": r.argument_bytes, "temp_bytes": r.temp_bytes, "output_bytes": r.output_bytes,
          "alias_bytes": r.alias_bytes, "total_bytes": r.total_bytes, "peak_bytes": r.live_bytes,
          "plan_argument_bytes": r.estimate_arguments, "plan_output_bytes": r.estimate_outputs,
          "argument_difference": round(difference(r), 4), "tiling_padding_bytes": r.padding,
          "padded_arguments": [{"name": n, "array": str(a), "extra_bytes": e} for n, a, e in r.padded],
          "collectives": r.collectives,
          "loops": [{"name": lp.name, "trips": lp.trips} for lp in r.loops],
          "weight_copy_limit_bytes": r.copy_limit,
          "weight_copies": [{"at": w, "array": a, "from": s} for w, a, s in r.weight_copies],
          "weight_collectives": [{"at": w, "collective": c, "from": s} for w, c, s in r.weight_collectives]}
    return d


def plan_json(p: Plan) -> dict:
    """A Plan as plain JSON types."""
    d = {"mesh": mesh_str(p.mesh), "devices": p.devices, "dtype": p.dtype, "quant": p.quant, "kv_dtype": p.kv_dtype,
         "rows": [{"component": n, "per_chip_bytes": round(d), "one_copy_bytes": round(f)} for n, d, f in p.rows],
         "per_chip_bytes": round(p.per_device), "weights_per_chip_bytes": round(p.weights_per_device),
         "kv_bytes_per_token": p.bytes_per_token, "kv_shards": p.kv_shards,
         "fallbacks": [f.describe() for f in p.fallbacks]}
    if p.kv is not None:
        d["kv_cache"] = dataclasses.asdict(p.kv) | {"per_chip_bytes": p.kv.per_chip}
    return d
