"""Memory planning without hardware: bytes per chip of the sharded params, the paged KV cache and the
sampling state on a mesh, the KV tokens that fit, and the mesh that fits the most of them.

Everything comes from the abstract param tree and the rules table in k2jax.sharding; nothing is allocated,
so it serves the full 1T config on a laptop. Each dim is split only over mesh axes that divide it (a dim
they do not divide falls back, see k2jax.sharding.dividing_axes), so every chip holds the same bytes of
each tensor: total / (number of distinct shards). The plan lists the params that fall back and what that
costs each chip beyond an even split over the axes their rules name.

The KV cache is counted as the runtime holds it (k2jax.runtime.runner, k2jax.generate): a pool of pages
split over the batch's mesh axes (data, fsdp and expert: data-parallel attention), each shard with its own
trash page, each row with its own pages for max_len tokens; bytes per token from
k2jax.runtime.cache.kv_bytes_per_token. `tensor` does not split the latent cache (it has no heads): the
cache is replicated over it.

`search` ranks the meshes of a chip count by the KV tokens that fit beside the weights, keeping a reserve of
each chip's memory free for activations and compiler temporaries. It searches data x expert x tensor and
leaves `fsdp` out: a training axis, fsdp splits every weight's model dim (attention's too, so it would hold
less per chip) but gathers the weights again before each use; on inference that moves every weight a step
touches over the interconnect on every step, and a decode step touches all of them (Kimi K2's bf16 decode
compiled for v5p:4x4x4 on fsdp=2,expert=32 all-gathers 68 GiB of weights a step). `plan(cfg, mesh)` takes
any mesh, fsdp included.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from k2jax.config import K2Config
from k2jax.runtime.cache import DEFAULT_PAGE_SIZE, KV_DTYPES, TPU_LANE, kv_bytes_per_token
from k2jax.runtime.sampling import slot_settings
from k2jax.nn.model import abstract_params, param_axes
from k2jax.nn.quantized import check_quant
from k2jax.ops.quant import QuantizedWeight, is_quantized
from k2jax.placement import Fallback, placed_specs
from k2jax.sharding import MESH_AXES, dividing_axes, format_bytes, logical_to_spec, parse_mesh_spec, shard_count

GiB, GB = 2**30, 10**9


@dataclasses.dataclass(frozen=True)
class Chip:
    """An accelerator as the plan sees it: a name for --chip, a label, its memory in bytes, and the figures
    `plan --compile` models a step's time with: HBM bandwidth (bytes/s), dense bf16 and 8-bit peaks (flop/s)
    and the interconnect (ICI / NVLink) bandwidth per chip, both directions (bytes/s). 0: not known."""

    name: str
    label: str
    hbm: int
    kv_lane: int = 1  # a KV pool pads each token's values to a multiple of this (TPUs: 128, see cache.lane)
    hbm_bandwidth: float = 0.0
    bf16_flops: float = 0.0
    int8_flops: float = 0.0
    ici_bandwidth: float = 0.0


# Per chip / GPU, vendor figures (memory: GiB for TPUs, decimal GB for NVIDIA). Sources: Cloud TPU's system
# architecture pages for v5e, v5p, v6e and v7x (HBM capacity and bandwidth, peak bf16 and int8 / fp8 compute,
# ICI; ICI given here both ways, twice the pages' per-direction Gbps / 8 where they give one way); NVIDIA's
# H100 SXM and H200 datasheets (dense, no sparsity; NVLink 900 GB/s). v7x's 8-bit figure is its fp8 peak.
CHIPS = {c.name: c for c in (
    Chip("v5e", "TPU v5e", 16 * GiB, TPU_LANE, 819 * GB, 197e12, 394e12, 400 * GB),
    Chip("v6e", "TPU v6e", 32 * GiB, TPU_LANE, 1640 * GB, 918e12, 1836e12, 800 * GB),
    Chip("h100", "H100", 80 * GB, 1, 3350 * GB, 989e12, 1979e12, 900 * GB),
    Chip("v5p", "TPU v5p", 95 * GiB, TPU_LANE, 2765 * GB, 459e12, 918e12, 1200 * GB),
    Chip("h200", "H200", 141 * GB, 1, 4800 * GB, 989e12, 1979e12, 900 * GB),
    Chip("v7x", "TPU v7x", 192 * GiB, TPU_LANE, 7370 * GB, 2307e12, 4614e12, 1200 * GB))}
DTYPES = ("bfloat16", "float32")
SEARCH_AXES = ("data", "expert", "tensor")  # fsdp left out: see the module docstring
# Per decode slot, beside the pool (k2jax.runtime.runner): output counts int32 and a prompt mask bool per id,
# and its sampling settings.
STATE_BYTES_PER_ID = 4 + 1
SETTINGS_BYTES_PER_SLOT = sum(v.nbytes for v in slot_settings(1).values())


@dataclasses.dataclass(frozen=True)
class KVCache:
    """The paged cache of `batch` rows of `max_len` tokens as the runtime lays it out: `shards` data-parallel
    shards (the batch's mesh axes that divide it), each `pages_per_shard` pages of `page_size` tokens (its
    trash page, then its rows' pages); bytes_per_token from kv_bytes_per_token."""

    batch: int
    max_len: int
    kv_dtype: str
    page_size: int
    shards: int
    bytes_per_token: int

    @property
    def table_pages(self) -> int:
        """Pages per row (the page table's width)."""
        return -(-self.max_len // self.page_size)

    @property
    def pages_per_shard(self) -> int:
        return 1 + self.batch // self.shards * self.table_pages

    @property
    def num_pages(self) -> int:
        return self.shards * self.pages_per_shard

    @property
    def per_chip(self) -> int:
        return self.pages_per_shard * self.page_size * self.bytes_per_token

    @property
    def one_copy(self) -> int:
        return self.batch * self.max_len * self.bytes_per_token


@dataclasses.dataclass
class Plan:
    """rows: (component, bytes on each chip, bytes of one full copy); devices: how many chips; fallbacks: the
    params whose dims the mesh does not divide (bytes as held); kv: the cache (None without a batch);
    kv_shards: how many data-parallel shards the mesh splits a cache into (the batch axes' product, for a
    batch they divide); bytes_per_token: of the KV cache, all layers."""

    mesh: dict[str, int]
    dtype: str
    quant: str | None
    kv_dtype: str
    rows: list[tuple[str, float, float]]
    devices: int
    fallbacks: list[Fallback] = dataclasses.field(default_factory=list)
    kv: KVCache | None = None
    kv_shards: int = 1
    bytes_per_token: int = 0
    lane_bytes_per_token: dict = dataclasses.field(default_factory=dict)  # {lane: bytes per token}

    @property
    def per_device(self) -> float:
        return sum(r[1] for r in self.rows)

    @property
    def total(self) -> float:
        return sum(r[2] for r in self.rows)

    @property
    def weights_per_device(self) -> float:
        """The params' bytes on each chip (no cache, no sampling state)."""
        return sum(r[1] for r in self.rows if not r[0].startswith(("KV cache", "sampling state")))

    @property
    def replication(self) -> float:
        """Bytes held over all devices / bytes of one copy (1.0 = nothing stored twice)."""
        return self.per_device * self.devices / self.total

    def kv_tokens(self, hbm: float, reserve: float = 0.1, lane: int | None = None) -> int:
        """KV tokens that fit on the mesh beside the weights (and this plan's sampling state), keeping
        `reserve` of each chip's `hbm` bytes free: whole tokens per chip x the cache's shards. 0 if the
        weights alone do not fit. lane: the pool's padding (k2jax.runtime.cache.lane; default the plan's)."""
        state = sum(r[1] for r in self.rows if r[0].startswith("sampling state"))
        free = hbm * (1 - reserve) - self.weights_per_device - state
        per_token = self.bytes_per_token if lane is None else self.lane_bytes_per_token[lane]
        return max(0, int(free // per_token)) * self.kv_shards

    @property
    def label(self) -> str:
        return quant_label(self.dtype, self.quant)


def quant_label(dtype: str, quant: str | None) -> str:
    """"bfloat16", "fp8 (rest bfloat16)", "int4 experts (rest bfloat16)"."""
    return {None: dtype, "fp8": f"fp8 blocks (rest {dtype})", "int4": f"int4 experts (rest {dtype})"}[quant]


def _component(keys: list[str]) -> str:
    if keys[0] in ("embed_tokens", "lm_head"):
        return "embed + lm_head"
    if "experts" in keys:
        return "routed experts"
    if "shared_experts" in keys:
        return "shared experts"
    if "gate" in keys:
        return "router"
    if "self_attn" in keys:
        return "attention"
    if "mlp" in keys:
        return "dense MLP"
    return "norms"


def _held_bytes(leaf, spec, mesh_shape) -> tuple[float, float]:
    """(bytes on each chip, bytes of one copy) of one param as a load holds it: a plain array, or a
    QuantizedWeight's values and scales, each split as its spec says (k2jax.placement.param_specs)."""
    parts = ((leaf.values, spec.values), (leaf.scales, spec.scales)) if is_quantized(leaf) else ((leaf, spec),)
    dev = full = 0.0
    for a, sp in parts:
        nbytes = math.prod(a.shape) * jnp.dtype(a.dtype).itemsize
        dev += nbytes / math.prod(shard_count(e, mesh_shape) for e in sp)
        full += nbytes
    return dev, full


@functools.lru_cache(maxsize=8)
def _tree(cfg: K2Config, dtype: str, quant: str | None):
    """(abstract params, their logical axes, the rules' intended specs) of cfg: built once per setting, as a
    search plans dozens of meshes of the same model."""
    shapes = abstract_params(cfg, jnp.dtype(dtype), quant=quant)
    axes = param_axes(cfg, quant)
    wanted = jax.tree_util.tree_map(lambda n: logical_to_spec(tuple(n)), axes, is_leaf=lambda x: isinstance(x, P))
    return shapes, axes, wanted


def plan(cfg: K2Config, mesh: str | dict[str, int], *, quant: str | None = None, dtype: str = "bfloat16",
         batch: int = 0, max_len: int = 0, kv_dtype: str | None = None,
         page_size: int = DEFAULT_PAGE_SIZE, kv_lane: int = 1) -> Plan:
    """Per-chip bytes of `cfg` sharded by k2jax.sharding's rules on `mesh` ("expert=64,tensor=4").

    quant: None (every param in `dtype`), "fp8" (the blocks' linear weights in the released e4m3 layout with
    128x128-block float32 scales; the router stays float32 as the model keeps it) or "int4" (routed experts
    in 4 bits with a bf16 scale per 32 inputs, as Kimi-K2-Thinking): the bytes a `k2jax.load(...,
    quant=quant)` holds, values and scales; the rest in dtype ("bfloat16" or "float32").
    batch, max_len: add the paged latent KV cache of that many rows and tokens (kv_dtype: one of
    k2jax.runtime.cache.KV_DTYPES, default `dtype`; page_size tokens per page) and the per-slot sampling
    state, as k2jax.generate holds them. kv_lane: the multiple the pool pads each token's values to, 128 on
    a TPU (k2jax.runtime.cache.lane: Kimi K2's 576 latent values take 640), 1 elsewhere.
    """
    if dtype not in DTYPES:
        hint = f" (quantization is quant={ {'float8': 'fp8'}.get(dtype, dtype)!r})" if dtype in (
            "float8", "fp8", "int4") else ""
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}{hint}")
    if quant == "none":
        quant = None
    check_quant(quant)
    kv_dtype = dtype if kv_dtype in (None, "auto") else kv_dtype
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
    shape = parse_mesh_spec(mesh)
    shapes, axes, wanted = _tree(cfg, dtype, quant)
    specs = placed_specs(axes, shapes, shape)
    per_dev: dict[str, float] = {}
    full: dict[str, float] = {}
    fell_back = []
    is_spec = lambda x: isinstance(x, (P, QuantizedWeight))  # noqa: E731
    for (path, spec), want, leaf in zip(jax.tree_util.tree_leaves_with_path(specs, is_leaf=is_spec),
                                        jax.tree_util.tree_leaves(wanted, is_leaf=is_spec),
                                        jax.tree_util.tree_leaves(shapes, is_leaf=is_quantized)):
        keys = [k.key for k in path]
        dev, nbytes = _held_bytes(leaf, spec, shape)
        name = _component(keys)
        per_dev[name] = per_dev.get(name, 0) + dev
        full[name] = full.get(name, 0) + nbytes
        # A fallback is judged on what is split: the (held) values; quantized scales follow them.
        v, sp, w = (leaf.values, spec.values, want.values) if is_quantized(leaf) else (leaf, spec, want)
        f = Fallback(".".join(keys), tuple(v.shape), w, sp, math.prod(v.shape) * jnp.dtype(v.dtype).itemsize, shape)
        if f.extra_bytes_per_device > 0:
            fell_back.append(f)
    rows = [(name, per_dev[name], full[name]) for name in per_dev]
    batch_axes = tuple(a for a in ("data", "fsdp", "expert") if shape[a] > 1)
    kv = None
    if batch or max_len:
        if batch <= 0 or max_len <= 0:
            raise ValueError(f"KV cache: batch ({batch}) and max_len ({max_len}) must both be positive")
        if page_size < 1:
            raise ValueError(f"page_size must be positive, got {page_size}")
        # As k2jax.runtime.cache lays it out: rows split over the batch axes that divide the batch.
        shards = math.prod(shape[a] for a in dividing_axes(batch_axes, batch, shape))
        kv = KVCache(batch, max_len, kv_dtype, page_size, shards, kv_bytes_per_token(cfg, kv_dtype, kv_lane))
        rows.append((f"KV cache {batch}x{max_len}", kv.per_chip, kv.one_copy))
        state = batch * (cfg.vocab_size * STATE_BYTES_PER_ID + SETTINGS_BYTES_PER_SLOT)
        rows.append((f"sampling state {batch} rows", state / shards, state))
    return Plan(shape, dtype, quant, kv_dtype, rows, math.prod(shape.values()), fell_back, kv,
                math.prod(shape[a] for a in batch_axes), kv_bytes_per_token(cfg, kv_dtype, kv_lane),
                {n: kv_bytes_per_token(cfg, kv_dtype, n) for n in {1, TPU_LANE, kv_lane}})


@dataclasses.dataclass
class Candidate:
    """A mesh of a search: its plan, the KV tokens that fit (whole pod) and whether everything planned fits
    (the weights, and the cache of the plan's batch if one was given)."""

    plan: Plan
    kv_tokens: int
    fits: bool

    @property
    def mesh_spec(self) -> str:
        return mesh_str(self.plan.mesh)


def mesh_str(mesh: dict[str, int]) -> str:
    """"expert=64" / "data=2,expert=32": the axes of size > 1 ("data=1" for a single chip)."""
    return ",".join(f"{a}={n}" for a, n in mesh.items() if n > 1) or "data=1"


def meshes(chips: int, axes=SEARCH_AXES) -> list[dict[str, int]]:
    """Every way to split `chips` over `axes` (each size a divisor), as full mesh shapes."""
    if chips < 1:
        raise ValueError(f"chips must be positive, got {chips}")
    divisors = [d for d in range(1, chips + 1) if chips % d == 0]
    out = []
    for sizes in itertools.product(divisors, repeat=len(axes) - 1):
        rest = chips // math.prod(sizes) if chips % math.prod(sizes) == 0 else 0
        if rest:
            out.append(parse_mesh_spec(dict(zip(axes, sizes + (rest,)))))
    return out


def search(cfg: K2Config, chips: int, hbm: float, *, reserve: float = 0.1, axes=SEARCH_AXES,
           **plan_kwargs) -> list[Candidate]:
    """The meshes of `chips` chips of `hbm` bytes each over `axes` (default data, expert, tensor: see the
    module docstring for fsdp), best first: most KV tokens that fit at `reserve` headroom, then fewest bytes
    per chip. plan_kwargs: plan()'s (quant, dtype, kv_dtype, batch, max_len, page_size); with a batch, a mesh
    whose cache does not fit ranks after every one whose does."""
    if not 0 <= reserve < 1:
        raise ValueError(f"reserve must be in [0, 1), got {reserve}")
    if hbm <= 0:
        raise ValueError(f"hbm must be positive, got {hbm}")
    bad = [a for a in axes if a not in MESH_AXES]
    if bad:
        raise ValueError(f"axes: unknown mesh axis {bad[0]!r} (axes: {', '.join(MESH_AXES)})")
    out = []
    for shape in meshes(chips, axes):
        p = plan(cfg, shape, **plan_kwargs)
        tokens = p.kv_tokens(hbm, reserve)
        fits = tokens > 0 and p.per_device <= hbm * (1 - reserve)
        out.append(Candidate(p, tokens, fits))
    out.sort(key=lambda c: (not c.fits, -c.kv_tokens, c.plan.per_device, c.plan.mesh["tensor"]))
    return out


def chip(name: str) -> Chip:
    """The Chip of a name in CHIPS (or a topology's, "v5p:4x4x4")."""
    key = name.split(":")[0].lower()
    if key not in CHIPS:
        raise ValueError(f"chip {name!r}: unknown (chips: {', '.join(CHIPS)}; or give --hbm GiB)")
    return CHIPS[key]


def format_plan(p: Plan, reserve: float = 0.1) -> str:
    """The text `k2jax plan --mesh` prints: per-chip bytes per component and which chips hold it, keeping
    `reserve` (a fraction of each chip's memory) free for activations and compiler temporaries."""
    width = max(len(r[0]) for r in p.rows)
    lines = [f"mesh {mesh_str(p.mesh)} ({p.devices} devices), weights {p.label}, KV cache {p.kv_dtype}",
             f"{'component':<{width}}  {'per device':>11}  {'one full copy':>13}"]
    lines += [f"{name:<{width}}  {format_bytes(d):>11}  {format_bytes(f):>13}" for name, d, f in p.rows]
    lines += [f"{'total':<{width}}  {format_bytes(p.per_device):>11}  {format_bytes(p.total):>13}", ""]
    if p.kv is not None:
        lines += [f"KV cache: {p.kv.shards} data-parallel shard(s) of {p.kv.batch // p.kv.shards} row(s), "
                  f"{p.kv.pages_per_shard} pages of {p.kv.page_size} tokens each (a trash page and "
                  f"{p.kv.table_pages} per row), {p.bytes_per_token:,} bytes per token", ""]
    if p.fallbacks:
        extra = sum(f.extra_bytes_per_device for f in p.fallbacks)
        lines += [f"{len(p.fallbacks)} params fall back (the mesh does not divide a dim their rule shards):"]
        lines += [f"  {f.describe().removeprefix('param ')}" for f in p.fallbacks]
        lines += [f"fallback cost: +{format_bytes(extra)} per device vs an even split "
                  f"({100 * extra / p.per_device:.3g}% of the per-device total)", ""]
    lines += [f"every device holds the same bytes; largest device: {format_bytes(p.per_device)}",
              f"bytes over all devices: {format_bytes(p.per_device * p.devices)} "
              f"= {p.replication:.3f} x one copy",
              "",
              f"fits (keeping {reserve:.0%} of each chip free), and the KV tokens that fit beside the weights "
              f"({p.kv_shards} cache shard(s)):"]
    for c in CHIPS.values():
        usable = c.hbm * (1 - reserve)
        verdict = "yes" if p.per_device <= usable else "no "
        lines.append(f"  {c.label:<8} {format_bytes(c.hbm):>9}  {verdict}  ({p.per_device / usable:.0%} of usable)"
                     f"  KV tokens {format_tokens(p.kv_tokens(c.hbm, reserve, c.kv_lane)):>7}")
    return "\n".join(lines)


def format_tokens(n: int) -> str:
    """Token counts to 3 significant figures: 812, 42.1 k, 25.3 M."""
    for unit, scale in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return str(n)


def format_search(cands: list[Candidate], chips: int, hbm: float, reserve: float = 0.1, top: int = 5,
                  what: str = "") -> str:
    """The text `k2jax plan --chips N` prints: the best `top` meshes with bytes per chip and KV capacity."""
    p0 = cands[0].plan
    lines = [f"{what}{chips} chips of {format_bytes(hbm)} ({format_bytes(hbm * (1 - reserve))} usable at "
             f"{reserve:.0%} reserve), weights {p0.label}, KV cache {p0.kv_dtype} "
             f"({p0.bytes_per_token:,} bytes per token as the chips hold it)",
             f"meshes over {', '.join(SEARCH_AXES)} (fsdp, a training axis, would gather the weights again at "
             "every step), best first by KV tokens that fit:"]
    kv = p0.kv
    head = f"  {'#':>2}  {'mesh':<26} {'weights/chip':>12}  {'KV shards':>9}  {'KV tokens':>9}"
    if kv is not None:
        head += f"  {f'with {kv.batch}x{kv.max_len}/chip':>20}  fits"
    lines.append(head)
    for i, c in enumerate(cands[:top], 1):
        p = c.plan
        line = (f"  {i:>2}  {c.mesh_spec:<26} {format_bytes(p.weights_per_device):>12}  {p.kv_shards:>9}  "
                f"{format_tokens(c.kv_tokens):>9}")
        if kv is not None:
            line += f"  {format_bytes(p.per_device):>20}  {'yes' if c.fits else 'no'}"
        lines.append(line)
    if not cands[0].fits:
        lines.append("nothing fits: more chips, a quantization (--quant), or a smaller batch")
    lines.append(f"recommended: --mesh {cands[0].mesh_spec}")
    return "\n".join(lines)
