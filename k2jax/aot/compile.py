"""Compile the runtime's real programs for a TPU topology from abstract inputs, and read what the compiler
made of them: per-chip bytes, collectives, loops, tiling padding, and the weight checks.

The programs are the steps of k2jax.runtime.runner (the one jitted step that k2jax.generate and the
server run), built with Runner(..., abstract=True): params, pool and sampling state are
jax.ShapeDtypeStructs with their shardings, so nothing is allocated and a 1T-parameter model compiles on a
laptop. The MoE runs its TPU path (k2jax.ops.gmm): "auto" would pick XLA:CPU's on a CPU host.

With K2JAX_AOT_CACHE=DIR set, what the compiler returns (its memory figures and the optimized HLO) is kept in
DIR under a key of everything it was given (the lowered program, the devices, jax and libtpu versions, XLA
flags), and read back for the same program: jax's own compilation cache cannot help here, because a
compile-only TPU client cannot load a cached executable back. Everything read from the compiler's output is
still computed afresh.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import math
import os
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from k2jax.aot import hlo
from k2jax.config import K2Config
from k2jax.info import active_params_per_token
from k2jax.runtime.cache import kv_bytes_per_token, lane
from k2jax.runtime.layout import DEFAULT_BLOCK, RaggedShape
from k2jax.runtime.runner import Runner, StepShape
from k2jax.nn.model import K2Model, abstract_params
from k2jax.placement import param_shardings
from k2jax.plan import Plan

PROGRAMS = ("decode", "prefill", "chunk", "decode1", "burst", "ragged", "ragged_chunk", "ragged_spread")
DEFAULT_PROGRAMS = ("decode", "prefill", "chunk")
PROGRAM_HELP = {
    "decode": "one token for every row of the batch, reading the pages of max_len tokens",
    "prefill": "a first prompt chunk of one row (no cache to read)",
    "chunk": "a later prompt chunk of one row, reading the longest context that leaves room for it",
    "decode1": "one token for a lone row (not split over the mesh: the compiler partitions its reads)",
    "burst": "first chunks for every row at once (a burst of new requests)",
    "ragged": "the ragged step of serve with every row decoding (one segment per data-parallel shard; it "
              "reads as many cached tokens as the rows hold, up to max_len)",
    "ragged_chunk": "the ragged step of serve with every row decoding and a prompt chunk of --chunk tokens "
                    "in each data-parallel shard's segment",
    "ragged_spread": "the ragged step of serve with every row decoding and one row's prompt chunk of --chunk "
                     "tokens spread over every data-parallel shard's segment (a lone long prompt)",
}
_HLO_DTYPE = {"bfloat16": "bf16", "float32": "f32", "float16": "f16", "int32": "s32", "uint32": "u32",
              "int8": "s8", "uint8": "u8", "bool": "pred", "float8_e4m3fn": "f8e4m3fn", "int64": "s64",
              "uint64": "u64", "int16": "s16", "uint16": "u16", "float64": "f64"}


def check_programs(programs) -> None:
    """Raise ValueError naming the first unknown program name."""
    bad = [p for p in programs if p not in PROGRAMS]
    if bad:
        raise ValueError(f"programs: unknown program {bad[0]!r} (programs: {', '.join(PROGRAMS)})")


def step_shapes(batch: int, max_len: int, page_size: int, prefill: int = 8192, chunk: int = 512,
                programs=DEFAULT_PROGRAMS, shards: int = 1) -> dict[str, StepShape | RaggedShape]:
    """The step shape of each named program (see PROGRAM_HELP) for a cache of `batch` rows of `max_len`;
    shards: the data-parallel shards the mesh splits the rows into (a ragged step's segments)."""
    check_programs(programs)
    W = -(-max_len // page_size)
    out = {}
    for name in programs:
        if name in ("ragged", "ragged_chunk", "ragged_spread"):
            G = DEFAULT_BLOCK
            blocks = -(-min(chunk, max_len) // G) if name != "ragged" else 0
            if name == "ragged_spread":
                out[name] = RaggedShape(batch // shards, 0, G, batch, W, shards=shards, spread=-(-blocks // shards))
            else:
                out[name] = RaggedShape(batch // shards, blocks, G, batch, W, shards=shards)
        elif name == "decode":
            out[name] = StepShape(batch, 1, W, W)
        elif name == "decode1":
            out[name] = StepShape(1, 1, W, W)
        elif name == "prefill":
            out[name] = StepShape(1, min(prefill, max_len), 0, W)
        elif name == "burst":
            out[name] = StepShape(batch, min(chunk, max_len), 0, W)
        elif name == "chunk":
            c = min(chunk, max_len // 2)
            out[name] = StepShape(1, c, -(-(max_len - c) // page_size), W)
    return out


@dataclasses.dataclass
class Result:
    """What the compiler made of one program (bytes are per chip); `error` holds the compiler's message
    instead when it refused (e.g. CompileTimeHbmOom). estimate_*: the plan's figures for the same program;
    padding: bytes the arguments' tiled layouts add; padded: the largest such arguments (name, array,
    extra bytes); weight_copies / weight_collectives: the item-4 findings (see `check_weights`); moved_bytes,
    flops: what one run reads, writes and computes per chip, loop bodies times their trip counts
    (k2jax.aot.hlo.traffic), movers its largest ops; model_flops: 2 x active parameters x the step's tokens,
    over all chips; optimal_seconds: the compiler's own figure (cost_analysis, which counts a loop body once),
    None where it gives none."""

    name: str
    shape: StepShape
    seconds: float = 0.0
    argument_bytes: int = 0
    temp_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0
    collectives: dict = dataclasses.field(default_factory=dict)
    loops: list = dataclasses.field(default_factory=list)
    estimate_arguments: int = 0
    estimate_outputs: int = 0
    padding: int = 0
    padded: list = dataclasses.field(default_factory=list)
    weight_copies: list = dataclasses.field(default_factory=list)
    weight_collectives: list = dataclasses.field(default_factory=list)
    copy_limit: int = 0
    moved_bytes: int = 0
    flops: int = 0
    model_flops: int = 0
    optimal_seconds: float | None = None
    movers: list = dataclasses.field(default_factory=list)
    error: str | None = None
    hlo: str | None = None

    @property
    def total_bytes(self) -> int:
        """argument + temp + output bytes: the issue's per-chip figure (aliased outputs counted twice)."""
        return self.argument_bytes + self.temp_bytes + self.output_bytes

    @property
    def live_bytes(self) -> int:
        """argument + temp + the outputs not aliased to (donated) arguments: what a chip holds at the peak."""
        return self.argument_bytes + self.temp_bytes + self.output_bytes - self.alias_bytes


@dataclasses.dataclass
class Target:
    """Where to compile: the topology's name and devices, the mesh over them, and the plan of the model on
    that mesh (with the cache)."""

    topology: str
    mesh: jax.sharding.Mesh
    plan: Plan


def target_model(cfg: K2Config, dtype: str) -> K2Model:
    """The model as a TPU runs it: its MoE through the grouped-matmul kernel (k2jax.ops.gmm; ragged_dot for
    plain experts). The default would pick by the host's backend."""
    return K2Model(cfg, jnp.dtype(dtype), moe_impl="gmm")


def abstract_runner(cfg: K2Config, mesh, p: Plan) -> Runner:
    """A Runner of abstract params and state for the plan's cache (generate's layout: each row its own
    pages for max_len tokens, a trash page per shard), on `mesh`."""
    quant = p.quant
    shapes = abstract_params(cfg, jnp.dtype(p.dtype), quant=quant)
    shardings = param_shardings(cfg, mesh, quant=quant, warn=False)
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, shardings)
    kv = p.kv
    return Runner(target_model(cfg, p.dtype), params, slots=kv.batch, num_pages=kv.num_pages,
                  page_size=kv.page_size, kv_dtype=kv.kv_dtype, mesh=mesh, abstract=True)


def compile_program(runner: Runner, name: str, shape: StepShape, p: Plan, keep_hlo: bool = False) -> Result:
    """Lower and compile one step of `runner`, then read the compiled program."""
    res = Result(name, shape)
    t0 = time.perf_counter()
    lowered = runner.lower(shape, whole=True)  # a whole step, sampling included
    try:
        mem, text, cost = compiler_output(lowered, runner.mesh)
    except Exception as e:  # the compiler's own error types (XlaRuntimeError: RESOURCE_EXHAUSTED, ...)
        res.seconds = time.perf_counter() - t0
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.seconds = time.perf_counter() - t0
    res.argument_bytes, res.temp_bytes = mem["argument_size_in_bytes"], mem["temp_size_in_bytes"]
    res.output_bytes, res.alias_bytes = mem["output_size_in_bytes"], mem["alias_size_in_bytes"]
    module = hlo.parse(text)
    res.collectives = hlo.collective_summary(module)
    res.loops = hlo.executions(module)[1]
    labels = label_parameters(module, (runner.params, runner.state, runner.batch_shapes(shape)))
    extra = [(labels.get(i, f"parameter {i}"), a, a.padded_bytes - a.nbytes) for i, a in enumerate(module.params())]
    res.padding = sum(e for _, _, e in extra)
    res.padded = sorted((x for x in extra if x[2] > 0), key=lambda x: -x[2])[:5]
    res.estimate_arguments, res.estimate_outputs = estimate(p, runner, shape, lowered)
    res.copy_limit, res.weight_copies, res.weight_collectives = check_weights(module, labels, runner.cfg, p)
    moved = hlo.traffic(module, top=5)
    res.moved_bytes, res.flops, res.movers = moved.bytes, moved.flops, list(moved.top)
    res.model_flops = 2 * active_params_per_token(runner.cfg) * shape.total_tokens
    opt = cost.get("optimal_seconds")
    res.optimal_seconds = float(opt) if opt is not None and opt > 0 else None
    if keep_hlo:
        res.hlo = text
    return res


_MEMORY = ("argument_size_in_bytes", "temp_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes")
_COST = ("flops", "bytes accessed", "optimal_seconds")


def compiler_output(lowered, mesh) -> tuple[dict[str, int], str, dict[str, float]]:
    """Compile `lowered` -> ({memory figure: bytes}, the optimized HLO text, {cost figure: value} of
    cost_analysis: flops, bytes accessed, optimal_seconds); kept in $K2JAX_AOT_CACHE when set (see the
    module's docstring). A refusal raises, and is not kept."""
    cache = os.environ.get("K2JAX_AOT_CACHE")
    path = None
    if cache:
        devices = mesh.devices
        key = hashlib.sha256()
        for part in (jax.__version__, devices.flat[0].client.platform_version, repr(devices.shape),
                     repr(mesh.axis_names), os.environ.get("XLA_FLAGS", ""), os.environ.get("LIBTPU_INIT_ARGS", ""),
                     repr([(d.id, getattr(d, "coords", None), getattr(d, "core_on_chip", None)) for d in devices.flat]),
                     lowered.as_text()):
            key.update(str(part).encode() + b"\0")
        path = pathlib.Path(cache) / f"{key.hexdigest()}.json.gz"
        if path.exists():
            with gzip.open(path, "rt") as f:
                kept = json.load(f)
            if "cost" in kept:  # kept before the cost was: compiled again
                return kept["memory"], kept["hlo"], kept["cost"]
    compiled = lowered.compile()
    mem = compiled.memory_analysis()
    memory = {k: int(getattr(mem, k)) for k in _MEMORY}
    text = compiled.as_text()
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, (list, tuple)) and cost else cost) or {}
    cost = {k: float(cost[k]) for k in _COST if k in cost}
    if path is not None:  # written whole, then renamed: a reader never sees half of it
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        with gzip.open(tmp, "wt") as f:
            json.dump({"memory": memory, "hlo": text, "cost": cost}, f)
        os.replace(tmp, path)
    return memory, text, cost


def estimate(p: Plan, runner: Runner, shape: StepShape, lowered) -> tuple[int, int]:
    """The plan's per-chip (argument, output) bytes of a step: params + pool + sampling state (the plan's
    rows) + the step's inputs; pool + state + the step's sampled outputs."""
    kv_state = sum(r[1] for r in p.rows if r[0].startswith(("KV cache", "sampling state")))
    inputs = local_bytes(runner.batch_shapes(shape))
    outputs = local_bytes(lowered.out_info[1])
    return int(p.per_device + inputs), int(kv_state + outputs)


def _local_shape(leaf) -> tuple[int, ...]:
    shape = tuple(leaf.shape)
    sharding = getattr(leaf, "sharding", None)
    return tuple(sharding.shard_shape(shape)) if sharding is not None else shape


def local_bytes(tree) -> int:
    """Per-chip bytes of abstract values (jax.ShapeDtypeStruct leaves, with or without shardings)."""
    return sum(math.prod(_local_shape(x)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def label_parameters(module: hlo.Module, args) -> dict[int, str]:
    """Entry parameter number -> the argument's path ("params.moe_layers.mlp.experts.gate_proj.values",
    "state.pages.moe_layers", "batch.tokens"), args = (params, state, batch) as jax.ShapeDtypeStructs with
    shardings. jit drops unused arguments, so the parameters are matched in order to the arguments by
    per-chip shape and dtype."""
    leaves = []
    for name, tree in zip(("params", "state", "batch"), args):
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            dt = np.dtype(leaf.dtype).name
            leaves.append((name + _path(path), _HLO_DTYPE.get(dt, dt), _local_shape(leaf)))
    out, j = {}, 0
    for i, a in enumerate(module.params()):
        while j < len(leaves) and (leaves[j][1], leaves[j][2]) != (a.dtype, a.dims):
            j += 1
        if j == len(leaves):
            break
        out[i] = leaves[j][0]
        j += 1
    return out


def _path(path) -> str:
    return "".join(f".{getattr(k, 'key', getattr(k, 'name', getattr(k, 'idx', k)))}" for k in path)


def check_weights(module: hlo.Module, labels: dict[int, str], cfg: K2Config, p: Plan):
    """The item-4 checks of a compiled program -> (limit, copies, collectives):

    - copies: floating-point buffers the program materializes that are a quantized weight's data (its values
      and scales moved, sliced, gathered or dequantized: k2jax.aot.hlo.Provenance) and larger than `limit`,
      the bytes of one layer's chosen experts on a chip (top-k experts x gate, up, down, in the compute
      dtype, the expert hidden dim split as the mesh splits it);
    - collectives: any collective moving weight data (any param but the embedding, whose lookups are
      all-reduced as token rows).
    Each finding is (where, what, the params it comes from)."""
    F = cfg.moe_intermediate_size or 0
    t = p.mesh.get("tensor", 1)
    F_local = F // t if t > 1 and F % t == 0 else F
    limit = (cfg.num_experts_per_tok or 0) * 3 * cfg.hidden_size * F_local * jnp.dtype(p.dtype).itemsize
    quantized = {i for i, n in labels.items() if n.startswith("params.") and _is_quantized_path(n)}
    weights = {i for i, n in labels.items() if n.startswith("params.") and not n.startswith("params.embed_tokens")}
    copies = []
    if quantized:
        prov = hlo.Provenance(module, quantized)
        fused = hlo.fused_computations(module)
        for cname, comp in module.computations.items():
            if cname in fused:
                continue
            for inst in comp.instructions.values():
                if inst.op in ("parameter", "get-tuple-element", "tuple", "bitcast", "while", "conditional"):
                    continue
                for a in inst.shapes:
                    if a.dtype in hlo.FLOAT_TYPES and a.nbytes > limit:
                        src = prov.of(cname, inst.name)
                        if src:
                            copies.append((f"{cname}/{inst.name}", str(a), sorted(labels[i] for i in src)))
    colls = []
    prov = hlo.Provenance(module, weights)
    for c in hlo.collectives(module):
        inst = module.computations[c.computation].instructions[c.name]
        src = set()
        for o in inst.operands:
            src |= prov.of(c.computation, o)
        if src:
            colls.append((f"{c.computation}/{c.name}", f"{c.kind} {c.shapes}", sorted(labels[i] for i in src)))
    return limit, copies, colls


def _is_quantized_path(name: str) -> bool:
    return name.endswith((".values", ".scales"))


def compile_programs(cfg: K2Config, mesh, p: Plan, shapes: dict[str, StepShape], keep_hlo: bool = False,
                     on_progress=None) -> list[Result]:
    """Compile each program of `shapes` ({name: StepShape}) for the plan's model and cache on `mesh` (a mesh
    over a topology's devices, k2jax.aot.topology.topology_mesh). on_progress(result) after each."""
    if p.kv is None:
        raise ValueError("compiling needs a cache: give batch and max_len")
    if kv_bytes_per_token(cfg, p.kv_dtype, lane(mesh)) != p.bytes_per_token:
        raise ValueError(f"the plan counts the cache with kv_lane other than the mesh's devices' ({lane(mesh)}): "
                         f"plan(..., kv_lane={lane(mesh)})")
    runner = abstract_runner(cfg, mesh, p)
    out = []
    for name, shape in shapes.items():
        res = compile_program(runner, name, shape, p, keep_hlo)
        out.append(res)
        if on_progress is not None:
            on_progress(res)
    return out
