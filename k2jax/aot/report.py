"""What `k2jax plan --compile` prints: the compiler's per-chip bytes of each program beside the plan's
estimate (and why they differ where they do by more than 5%), the collectives, the loops, and the weight
checks; the same as a JSON-ready dict."""

from __future__ import annotations

import dataclasses

from k2jax.aot.compile import Result
from k2jax.aot.hlo import Array
from k2jax.plan import Chip, Plan, mesh_str
from k2jax.runtime.layout import RaggedShape
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
        if isinstance(s, RaggedShape):  # flat tokens; pages read: as many as the rows hold
            head = f"{r.name:<8} {f'{s.tokens} flat':>13} {f'-/{s.table_pages}':>9}"
        else:
            head = f"{r.name:<8} {f'{s.rows} x {s.tokens}':>13} {f'{s.read_pages}/{s.table_pages}':>9}"
        if r.error:
            lines.append(f"{head}  FAILED after {r.seconds:.0f} s")
            continue
        lines.append(f"{head} {format_bytes(r.argument_bytes):>10} {format_bytes(r.temp_bytes):>9} "
                     f"{format_bytes(r.output_bytes):>9} {format_bytes(r.alias_bytes):>9} "
                     f"{format_bytes(r.total_bytes):>9} {format_bytes(r.estimate_arguments):>10} "
                     f"{difference(r):>+6.1%} {r.seconds:>7.0f}s")
    lines += [""] + format_step_model(results, chip, p.devices) + [""]
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
        if r.movers:
            lines.append("  largest movers per run: " + "; ".join(
                f"{op} {format_bytes(b)} x {n}" for _, op, b, n in r.movers[:3]))
        if r.weight_collectives:
            lines.append(f"  {len(r.weight_collectives)} collectives move weight data:")
            lines += [f"    {what_} at {where} from {', '.join(src)}" for where, what_, src in r.weight_collectives[:8]]
        else:
            lines.append("  no collective moves weight data (tokens only)")
    return "\n".join(lines).rstrip()


def step_model(r: Result, chip: Chip, devices: int) -> dict | None:
    """The modeled time of one run of a program, per chip, from what the compiler made of it (None where the
    chip's figures are not known):

    - seconds = max(moved bytes / HBM bandwidth, flops / bf16 peak) + collective bytes / ICI bandwidth;
    - ideal_seconds = max(argument bytes / HBM bandwidth, model flops / chips / bf16 peak): every argument
      read once, and only the model's own matmul work (2 x active parameters per token), evenly split;
    - tokens per second for the slice (the step's token positions / seconds) and per chip, and the MFU (model
      flops over the slice's peak for the modeled time)."""
    if r.error or not (chip.hbm_bandwidth and chip.bf16_flops and chip.ici_bandwidth):
        return None
    collective = sum(v["bytes"] for v in r.collectives.values())
    memory_s = r.moved_bytes / chip.hbm_bandwidth
    compute_s = r.flops / chip.bf16_flops
    ici_s = collective / chip.ici_bandwidth
    seconds = max(memory_s, compute_s) + ici_s
    ideal = max(r.argument_bytes / chip.hbm_bandwidth, r.model_flops / devices / chip.bf16_flops)
    tokens = r.shape.total_tokens
    slice_tps = tokens / seconds if seconds else 0.0
    return {"moved_bytes": r.moved_bytes, "moved_over_arguments": r.moved_bytes / max(r.argument_bytes, 1),
            "flops": r.flops, "collective_bytes": collective, "memory_seconds": memory_s,
            "compute_seconds": compute_s, "ici_seconds": ici_s, "seconds": seconds,
            "compiler_optimal_seconds": r.optimal_seconds, "ideal_seconds": ideal,
            "ideal_bytes": r.argument_bytes, "ideal_flops": r.model_flops / devices,
            "tokens_per_second": slice_tps, "tokens_per_second_per_chip": slice_tps / devices,
            "mfu": r.model_flops / (seconds * devices * chip.bf16_flops) if seconds else 0.0}


def format_step_model(results: list[Result], chip: Chip, devices: int) -> list[str]:
    """The report's step-time table (see step_model)."""
    if not (chip.hbm_bandwidth and chip.bf16_flops and chip.ici_bandwidth):
        return [f"no step-time model: the bandwidth and peak of {chip.label} chips are not known"]
    lines = [f"modeled step per chip ({chip.label}: HBM {chip.hbm_bandwidth / 1e12:.2f} TB/s, bf16 "
             f"{chip.bf16_flops / 1e12:.0f} TFLOP/s, ICI {chip.ici_bandwidth / 1e9:.0f} GB/s): "
             "max(moved / HBM, flops / peak) + collectives / ICI; moved and flops count loop bodies times their "
             "trips; ideal: the arguments read once, the model's flops split evenly",
             f"{'program':<8} {'moved':>9} {'x args':>7} {'TFLOP':>7} {'compiler':>9} {'modeled':>9} "
             f"{'(hbm':>8} {'flops':>8} {'ici)':>8} {'ideal':>8} {'tokens/s':>10} {'per chip':>9} {'MFU':>6}"]
    ms = lambda x: "-" if x is None else f"{x * 1e3:.1f}ms"  # noqa: E731
    for r in results:
        m = step_model(r, chip, devices)
        if m is None:
            continue
        lines.append(f"{r.name:<8} {format_bytes(m['moved_bytes']):>9} {m['moved_over_arguments']:>6.2f}x "
                     f"{m['flops'] / 1e12:>7.2f} {ms(m['compiler_optimal_seconds']):>9} {ms(m['seconds']):>9} "
                     f"{ms(m['memory_seconds']):>8} {ms(m['compute_seconds']):>8} {ms(m['ici_seconds']):>8} "
                     f"{ms(m['ideal_seconds']):>8} {m['tokens_per_second']:>10,.0f} "
                     f"{m['tokens_per_second_per_chip']:>9,.0f} {m['mfu']:>6.1%}")
    return lines


def result_json(r: Result, chip: Chip | None = None, devices: int = 1) -> dict:
    """A Result as plain JSON types; with the chip, its step_model under "step_model"."""
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
          "weight_collectives": [{"at": w, "collective": c, "from": s} for w, c, s in r.weight_collectives],
          "moved_bytes": r.moved_bytes, "flops": r.flops, "model_flops": r.model_flops,
          "compiler_optimal_seconds": r.optimal_seconds,
          "largest_movers": [{"at": w, "op": op, "bytes": b, "runs": n} for w, op, b, n in r.movers]}
    if chip is not None:
        d["step_model"] = step_model(r, chip, devices)
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
