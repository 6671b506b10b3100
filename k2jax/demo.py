"""`k2jax demo`: the path a real checkpoint takes, end to end, on random weights and simulated devices.

    synthetic FP8 checkpoint in the released layout (random weights, K2-shaped small config, no download)
      -> `k2jax convert` (the real streaming converter) -> `k2jax.load` on a multi-device mesh, experts sharded
      -> the sharding plan (which device holds which experts, bytes per device) -> `k2jax.generate` on a batch
      of prompts -> prefill / decode throughput

The default config (k2jax.synthetic.DEMO_CONFIG) is configs/bench.json's shape (390 M params; vocabulary 1024): the whole
run, compilation included, takes 35-50 s on a 2-core CPU. `--config` takes any other HF config.json.
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import shutil
import sys
import tempfile
import time

import jax
from flax import traverse_util

import k2jax
from k2jax.checkpoint.convert import convert
from k2jax.checkpoint.hf_write import write_release_checkpoint
from k2jax.info import count_params
from k2jax.ops.quant import is_quantized
from k2jax.plan import plan
from k2jax.synthetic import DEMO_CONFIG, DEMO_TOKENIZER_DIR
from k2jax.tokenizer import KimiTokenizer

PROMPTS = [
    "The quick brown fox",
    "Kimi is a large language model",
    "It uses a mixture of experts with multi-head latent attention,",
    "We're testing the tokenizer:",
    "Answer questions about long documents",
    "The encoder and the decoder agree on every byte",
    "Write code",
    "Moonshot AI trained",
]
MiB = 2**20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", metavar="DIR",
                   help="keep the checkpoints and tokenizer here (a rerun reuses the conversion); default: a "
                        "temporary directory, deleted at the end")
    p.add_argument("--devices", type=int, default=8,
                   help="simulated CPU devices (default 8); 0 = this machine's own devices (GPU/TPU)")
    p.add_argument("--mesh", help="mesh over the devices, e.g. expert=4,data=2 (default expert=<devices>)")
    p.add_argument("--config", metavar="CONFIG.json",
                   help="another HF config.json (e.g. configs/bench.json) instead of the built-in demo config; its "
                        "vocab_size must be at least 1024 (the demo tokenizer's ids) for text prompts")
    p.add_argument("--quant", default="none", choices=("none", "fp8", "int4"),
                   help="weights held on the devices: none = bf16 (default); fp8 = the checkpoint's e4m3 blocks as "
                        "converted; int4 = the routed experts requantized to 4 bits (lossy), the rest bf16")
    p.add_argument("--batch", type=int, default=8, help=f"prompts in the batch (default 8, at most {len(PROMPTS)})")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens generated per prompt (default 32)")


def set_up_devices(n: int) -> None:
    """n simulated CPU devices (n > 0), or this machine's devices (n == 0). Must run before JAX picks its
    devices (importing jax is fine, calling jax.devices() is not)."""
    if n <= 0:
        return
    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # devices already set up in this process (e.g. a notebook): use them if they fit
        if len(jax.devices()) != n:
            raise ValueError(f"--devices {n}: JAX already runs on {len(jax.devices())} devices in this process; "
                             f"run `k2jax demo` in a fresh process") from None


class _Steps:
    """Numbered progress lines with the time each step took."""

    def __init__(self, total: int, out=sys.stdout):
        self.total, self.k, self.out, self.t0 = total, 0, out, time.perf_counter()

    @contextlib.contextmanager
    def __call__(self, what: str):
        self.k += 1
        print(f"\n[{self.k}/{self.total}] {what}", file=self.out, flush=True)
        t = time.perf_counter()
        yield
        print(f"      ({time.perf_counter() - t:.1f} s)", file=self.out, flush=True)


def run(args: argparse.Namespace) -> int:
    set_up_devices(args.devices)  # before anything below asks JAX for its devices
    if not 1 <= args.batch <= len(PROMPTS):
        raise ValueError(f"--batch {args.batch}: expected 1..{len(PROMPTS)}")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens}: expected at least 1")
    if args.workdir:
        pathlib.Path(args.workdir).mkdir(parents=True, exist_ok=True)
        return _demo(pathlib.Path(args.workdir), args)
    with tempfile.TemporaryDirectory(prefix="k2jax-demo-") as d:
        return _demo(pathlib.Path(d), args)


def _demo(work: pathlib.Path, args) -> int:
    t_start = time.perf_counter()
    hf = DEMO_CONFIG if args.config is None else k2jax.K2Config.from_hf_config(args.config).to_hf_config()
    cfg = k2jax.K2Config.from_hf_config(hf)
    devices = jax.devices()
    spec = args.mesh or f"expert={len(devices)}"
    mesh = k2jax.make_mesh(spec)  # checked first: a bad mesh fails before minutes of work
    n_params = count_params(k2jax.abstract_params(cfg))
    print("k2jax demo: the real-checkpoint path (write FP8 -> convert -> sharded load -> generate) on RANDOM "
          "weights: the generated text is gibberish by design.")
    print(f"config: {args.config or 'built-in demo config (the K2 shape of configs/bench.json, vocab 1024)'}: "
          f"{cfg.num_hidden_layers} layers ({cfg.num_dense_layers} dense + {cfg.num_moe_layers} MoE), hidden "
          f"{cfg.hidden_size}, {cfg.n_routed_experts} experts top-{cfg.num_experts_per_tok} + "
          f"{cfg.n_shared_experts} shared, MLA with {cfg.num_attention_heads} heads, vocab {cfg.vocab_size}; "
          f"{n_params / 1e6:.1f} M params")
    kind = f"{len(devices)} simulated CPU devices" if args.devices > 0 else \
        f"{len(devices)} {devices[0].platform.upper()} device(s)"
    print(f"devices: {kind}, mesh {spec}; files in {work}{'' if args.workdir else ' (temporary)'}")
    step = _Steps(5)

    with step("writing a synthetic checkpoint in the released FP8 layout (e4m3 weights, 128x128 block scales)"):
        src = write_release_checkpoint(hf, work / "hf-fp8", seed=0)
        tok_dir = work / "tokenizer"  # the demo tokenizer shipped with k2jax, beside the checkpoint
        shutil.copytree(DEMO_TOKENIZER_DIR, tok_dir, dirs_exist_ok=True)
        size = sum(f.stat().st_size for f in src.iterdir())
        print(f"      {src}: {len(list(src.glob('*.safetensors')))} safetensors file(s), {size / MiB:.1f} MiB")

    quant = None if args.quant == "none" else args.quant
    stored = "bfloat16" if quant is None else "float8"  # a quantized load keeps (or requantizes) the FP8 blocks
    dst = work / ("k2jax-bf16" if quant is None else "k2jax-float8")
    with step(f"converting with the streaming converter: k2jax convert {src} {dst} --dtype {stored}"):
        stats = convert(src, dst, dtype=stored, log=lambda *a, **k: print("     ", *a, **k))
        if not stats.complete:
            raise RuntimeError(f"{dst}: conversion incomplete")

    held = {None: "bf16", "fp8": "fp8 blocks", "int4": "int4 routed experts"}[quant]
    with step(f"restoring on the mesh {spec} ({held}): each device reads only the chunks of its own shards"):
        cfg, params = k2jax.load(dst, mesh=mesh, quant=quant)
        jax.block_until_ready(params)

    with step("sharding plan: where the routed experts live, and bytes per device"):
        _print_plan(cfg, params, devices, plan(cfg, dict(mesh.shape), quant=quant))

    tok = KimiTokenizer.from_dir(tok_dir)
    prompts = PROMPTS[:args.batch]
    ids = [tok.encode(p) for p in prompts]
    if max(max(i) for i in ids) >= cfg.vocab_size:
        raise ValueError(f"vocab_size {cfg.vocab_size} of the config is smaller than the demo tokenizer's "
                         f"{tok.vocab_size} ids: use a config with vocab_size >= {tok.vocab_size}")
    with step(f"generating: a batch of {len(ids)} prompts, {args.max_new_tokens} new tokens each, greedy, "
              f"with the latent KV cache"):
        model = k2jax.K2Model(cfg, params["embed_tokens"].dtype)
        t: dict = {}
        out, lengths = k2jax.generate(model, params, ids, args.max_new_tokens, mesh=mesh, timings=t)
        for p, o, n in zip(prompts, out, lengths):
            print(f"      {p!r} -> {_text(tok, o[:n])!r}")
        prompt_tokens = sum(len(i) for i in ids)
        new_tokens = len(ids) * t["decode_steps"]
        print(f"      prefill: {prompt_tokens} prompt tokens in {t['prefill_s'] * 1e3:.0f} ms = "
              f"{prompt_tokens / t['prefill_s']:,.0f} tokens/s")
        print(f"      decode:  {t['decode_steps']} steps x {len(ids)} sequences in {t['decode_s']:.2f} s = "
              f"{new_tokens / max(t['decode_s'], 1e-9):,.0f} tokens/s "
              f"({t['decode_s'] / max(t['decode_steps'], 1) * 1e3:.1f} ms per step)")
        print(f"      compiling prefill + decode step: {t['compile_s']:.1f} s (once per shape)")
    print(f"\ndone in {time.perf_counter() - t_start:.0f} s. The weights were random. On the real checkpoint: "
          f"`k2jax convert`, `k2jax plan`, then `k2jax generate --checkpoint DIR --mesh ...` on a slice (README).")
    if args.workdir:
        print(f"kept: {src} (FP8 source), {dst} (converted), {tok_dir} (tokenizer). Try: k2jax generate "
              f"--checkpoint {dst} --tokenizer {tok_dir} --prompt 'Hello' --max-new-tokens 8")
    return 0


def _text(tok, ids, width: int = 60) -> str:
    """Decoded ids (those past the tokenizer's vocabulary, which a random model can pick, dropped), cut short."""
    text = tok.decode([int(i) for i in ids if i < tok.vocab_size])
    return text if len(text) <= width else text[:width - 3] + "..."


def _print_plan(cfg, params, devices, estimate) -> None:
    """Per device: the expert slots it holds (from the restored arrays themselves) and its bytes."""
    held: dict = {d: [] for d in devices}
    nbytes: dict = {d: 0 for d in devices}
    for name, leaf in traverse_util.flatten_dict(params, sep=".").items():
        arrays = (leaf.values, leaf.scales) if is_quantized(leaf) else (leaf,)
        for a in arrays:
            for s in a.addressable_shards:
                nbytes[s.device] += s.data.nbytes
        if name == "moe_layers.mlp.experts.gate_proj":
            a = arrays[0]  # [L, E, D, F] (int4: F packed in halves)
            for s in a.addressable_shards:
                e, f = s.index[1], s.index[3]
                cols = "" if f == slice(None) or (f.start or 0, f.stop) == (0, a.shape[3]) else \
                    f", expert hidden {f.start}:{f.stop}{' (packed)' if is_quantized(leaf) and leaf.fmt == 'int4' else ''}"
                lo, hi = e.start or 0, (e.stop or a.shape[1]) - 1
                held[s.device].append(f"expert {lo}{cols}" if lo == hi else f"experts {lo}-{hi}{cols}")
    one_copy = sum(a.nbytes for a in jax.tree.leaves(params))
    print(f"      {'device':<10} {'routed experts held (in each of the ' + str(cfg.num_moe_layers) + ' MoE layers)':<52}"
          f" {'bytes':>10}")
    for d in devices:
        print(f"      {str(d.id) + ' ' + d.platform:<10} {', '.join(held[d]) or '-':<52} {nbytes[d] / MiB:>6.1f} MiB")
    total = sum(nbytes.values())
    print(f"      all devices {total / MiB:.1f} MiB for one copy of {one_copy / MiB:.1f} MiB ({total / one_copy:.2f}x: "
          f"embeddings, attention, norms and the shared expert are replicated on the expert axis)")
    print(f"      `k2jax plan` estimate from the abstract tree: {estimate.per_device / MiB:.1f} MiB per device")
