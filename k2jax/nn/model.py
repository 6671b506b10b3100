"""K2Model: embed -> dense blocks -> MoE blocks (each group under nn.scan) -> final norm -> lm_head."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from k2jax.config import K2Config
from k2jax.nn.block import DecoderBlock
from k2jax.nn.common import param
from k2jax.ops.matmul import einsum
from k2jax.nn.norm import RMSNorm
from k2jax.nn.quantized import abstract_quantized, quantized_axes


class K2Model(nn.Module):
    """tokens [B, T] int32 -> logits [B, T, V] float32.

    positions [B, T] default to 0..T-1; attention_mask [B, S] (1 = real token) is combined with the causal
    mask. Attention is blocked (tiles above the diagonal skipped); `reference` is the plain form. Computation
    runs in `param_dtype`; norms, softmax and the router in float32.

    `prefill` and `decode` run the same params with a latent KV cache (k2jax.inference generates with them).
    """

    cfg: K2Config
    param_dtype: jnp.dtype = jnp.float32
    moe_impl: str = "auto"
    remat: str = "none"  # per block, one of REMAT_POLICIES: trades the backward pass's memory for compute

    def __call__(self, tokens_BT, positions_BT=None, attention_mask_BS=None):
        B, T = tokens_BT.shape
        positions_BT = _default_positions(tokens_BT, positions_BT)
        kv_valid_BT = jnp.ones((B, T), bool) if attention_mask_BS is None else attention_mask_BS.astype(bool)
        return self.forward(tokens_BT, positions_BT, kv_valid_BT, mode="causal")[0]

    def reference(self, tokens_BT, positions_BT=None, attention_mask_BS=None):
        """The same logits through the plain attention (the whole [T, T] mask and score matrix)."""
        B, T = tokens_BT.shape
        positions_BT = _default_positions(tokens_BT, positions_BT)
        mask_BTS = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
        if attention_mask_BS is not None:
            mask_BTS = mask_BTS & attention_mask_BS.astype(bool)[:, None, :]
        return self.forward(tokens_BT, positions_BT, mask_BTS)[0]

    def prefill(self, tokens_BT, positions_BT, kv_valid_BT):
        """Run a (left-padded) prompt: tokens, positions [B, T], kv_valid [B, T] (True = a real token; causal
        implied) -> (logits at the last position [B, V], cache entries {group: {"ckv": [L, B, T, R],
        "k_pe": [L, B, T, P]}}). Attention is key-blocked: memory linear in T."""
        logits_B1V, kv = self.forward(tokens_BT, positions_BT, kv_valid_BT.astype(bool), mode="prefill")
        return logits_B1V[:, 0], kv

    def decode(self, tokens_BT, positions_BT, kv_valid_BS, cache, index, absorbed=True):
        """Run T new tokens per row against a cache ({group: {"ckv": [L, B, S, R], "k_pe": [L, B, S, P]}},
        see k2jax.inference.cache): their latents are written at slots index..index+T-1; slot s is visible
        to new token t iff kv_valid[b, s] and s <= index + t. -> (logits [B, T, V], updated cache).
        absorbed=False expands the cache per head instead (the reference form; same numbers, slower).

        The layers read the cache and return only the new latents, written in after the last layer: a
        cache scanned in and out with the layers would be copied whole on every step (at batch 16 and an
        8k context, most of the step's time on XLA:CPU). Donate the cache to update it in place."""
        T, S = tokens_BT.shape[1], kv_valid_BS.shape[1]
        causal_TS = jnp.arange(S)[None, :] <= index + jnp.arange(T)[:, None]
        mask_BTS = kv_valid_BS.astype(bool)[:, None, :] & causal_TS[None]
        logits_BTV, new = self.forward(tokens_BT, positions_BT, mask_BTS, cache, index,
                                       mode="decode" if absorbed else "decode_expanded")
        cache = jax.tree.map(lambda c, n: jax.lax.dynamic_update_slice_in_dim(c, n.astype(c.dtype), index, axis=2),
                             cache, new)
        return logits_BTV, cache

    @nn.compact
    def forward(self, tokens_BT, positions_BT, mask, cache=None, index=None, mode="full"):
        """The model in one of MLA's modes (see MLA and the three methods above) -> (logits, kv per group)."""
        cfg, dt = self.cfg, self.param_dtype
        embed_VD = param(self, "embed_tokens", (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dt,
                         nn.initializers.normal(1.0))
        x_BTD = embed_VD[tokens_BT]
        # Per-layer expert arrays (split_experts) go to the blocks whole, with each layer's index.
        split = self.get_variable("params", SPLIT_EXPERTS) if self.has_variable("params", SPLIT_EXPERTS) else None
        kv = {}
        for name, n, moe in (("dense_layers", cfg.num_dense_layers, False),
                             ("moe_layers", cfg.num_moe_layers, True)):
            if n:
                blocks = scanned_blocks(n, self.remat)(cfg, moe, dt, self.moe_impl, mode, name=name)
                experts = split if moe else None
                x_BTD, kv[name] = blocks(x_BTD, positions_BT, mask, None if cache is None else cache[name], index,
                                         experts, jnp.arange(n))
        if mode == "prefill":
            x_BTD = x_BTD[:, -1:]  # only the next token's logits are wanted (T x V would not fit for long prompts)
        x_BTD = RMSNorm(cfg.rms_norm_eps, dt, "embed", name="norm")(x_BTD)
        if cfg.tie_word_embeddings:
            head_DV = embed_VD.T
        else:
            head_DV = param(self, "lm_head", (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), dt)
        return einsum("BTD,DV->BTV", x_BTD, head_DV, jnp.float32), kv


def _default_positions(tokens_BT, positions_BT):
    """positions_BT, or 0..T-1 in every row when it is None."""
    if positions_BT is not None:
        return positions_BT
    B, T = tokens_BT.shape
    return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))


# What a block keeps from its forward pass for the backward pass: everything ("none": no remat), only its
# inputs ("full": the block is recomputed), or also the weight matmuls' outputs ("save_matmuls": attention
# scores and elementwise work are recomputed).
REMAT_POLICIES = {"none": None, "full": jax.checkpoint_policies.nothing_saveable,
                  "save_matmuls": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def scanned_blocks(length: int, remat: str = "none"):
    """DecoderBlock repeated `length` times under nn.scan: params stacked on a leading, unsharded 'layers'
    axis, so compile time does not grow with depth. Each block gets its layer index; positions, mask, the
    decode cache (read-only; stacked on the same leading axis) and its index are shared by all layers.
    Sown intermediates (router statistics) are stacked on the layer axis too. remat: see REMAT_POLICIES."""
    if remat not in REMAT_POLICIES:
        raise ValueError(f"remat policy must be one of {tuple(REMAT_POLICIES)}, got {remat!r}")
    block = DecoderBlock
    if remat != "none":
        block = nn.remat(DecoderBlock, policy=REMAT_POLICIES[remat], prevent_cse=False)  # scan stops CSE
    return nn.scan(block, variable_axes={"params": 0, "intermediates": 0}, split_rngs={"params": True},
                   in_axes=(nn.broadcast,) * 5 + (0,), length=length,
                   metadata_params={nn.PARTITION_NAME: "layers"})


# Where split_experts puts the MoE layers' routed experts: {"gate_proj": (L arrays [E, D, F]), ...}.
SPLIT_EXPERTS = "moe_layers_experts"
_EXPERT_PATH = ("moe_layers", "mlp", "experts")


def split_experts(params):
    """The same model with the MoE layers' routed experts held as one array per layer instead of one stacked
    [L, E, D, F] array: a faster layout for inference on XLA:CPU, where the scan's per-layer slice of a
    stacked array is a copy (a layer's whole expert stack, for each forward). Each layer's experts then run
    in their own branch of a `lax.switch` on the layer index, reading that layer's arrays in place.

    For inference on one device: train on the stacked layout (under grad, each layer's backward pass would
    add zeros into every other layer's expert gradients), and shard it (k2jax.sharding) too. The result holds
    new arrays; drop the stacked params to free their memory. `stack_experts` undoes it.
    """
    def layers(v):  # abstract params (jax.ShapeDtypeStruct) split too, for ahead-of-time compiles
        n = v.shape[0]
        if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(v)):
            return (jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), v),) * n
        return tuple(v[i] for i in range(n))  # a QuantizedWeight indexes its values and scales alike

    stacked = subtree(params, _EXPERT_PATH)
    rest = with_subtree(params, _EXPERT_PATH[:-1], lambda mlp: {k: v for k, v in mlp.items() if k != "experts"})
    return rest | {SPLIT_EXPERTS: {k: layers(v) for k, v in stacked.items()}}


def stack_experts(params):
    """Inverse of split_experts: the stacked layout that checkpoints, sharding and training use."""
    stacked = {k: jax.tree.map(lambda *a: jnp.stack(a), *v) for k, v in params[SPLIT_EXPERTS].items()}
    rest = {k: v for k, v in params.items() if k != SPLIT_EXPERTS}
    return with_subtree(rest, _EXPERT_PATH[:-1], lambda mlp: mlp | {"experts": stacked})


def subtree(tree, path):
    """tree[path[0]][path[1]]... of a nested dict."""
    for k in path:
        tree = tree[k]
    return tree


def with_subtree(tree, path, fn):
    """A copy of nested dict `tree` with the subtree at `path` replaced by fn(subtree); unchanged if absent."""
    if not path:
        return fn(tree)
    if path[0] not in tree:
        return tree
    return {**tree, path[0]: with_subtree(tree[path[0]], path[1:], fn)}


def init_params(cfg: K2Config, rng=None, param_dtype=jnp.float32, moe_impl="auto"):
    """Random params (unboxed nested dict) for `cfg`."""
    rng = jax.random.PRNGKey(0) if rng is None else rng
    model = K2Model(cfg, param_dtype, moe_impl)
    with _no_activation_constraints():
        return _unbox(jax.jit(model.init)(rng, jnp.zeros((1, 1), jnp.int32))["params"])


def abstract_params(cfg: K2Config, param_dtype=jnp.float32, quant: str | None = None):
    """The param tree as jax.ShapeDtypeStruct leaves, with no memory allocated (serves the full 1T config).

    quant "fp8" | "int4": the params that quantization holds (k2jax.quant_policy) are QuantizedWeight leaves
    of abstract values and scales; the rest in param_dtype. The model is traced once per config (cached), so
    a load, its shardings and the plan share one trace.
    """
    shapes = _unbox(_boxed_shapes(cfg, param_dtype))
    return shapes if quant is None else abstract_quantized(shapes, quant)


def param_axes(cfg: K2Config, quant: str | None = None):
    """Logical axis names of every param (same tree as abstract_params(cfg, quant=quant)), from the modules'
    annotations; a quantized param's leaf is a QuantizedWeight of its values' and scales' names."""
    axes = nn.get_partition_spec(_traced(cfg))
    return axes if quant is None else quantized_axes(axes, quant)


# The dtype the model is traced in: the leaves that come out in it are those that follow param_dtype; the
# others are the ones the modules pin (the router, float32). float16 since no module pins a param to it.
_TRACE_DTYPE = jnp.float16


@functools.lru_cache(maxsize=8)
def _traced(cfg: K2Config):
    """The boxed params of `cfg` (nn.Partitioned of jax.ShapeDtypeStruct), traced once per config."""
    with _no_activation_constraints():
        return jax.eval_shape(K2Model(cfg, _TRACE_DTYPE).init, jax.random.PRNGKey(0),
                              jnp.zeros((1, 1), jnp.int32))["params"]


def _boxed_shapes(cfg: K2Config, param_dtype):
    """_traced(cfg) in `param_dtype`: each leaf that follows the param dtype given it, the pinned ones kept."""
    dt = jnp.dtype(param_dtype)
    return jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape, dt) if s.dtype == _TRACE_DTYPE else s,
                                  _traced(cfg))


def _unbox(tree):
    """Strip the axis-name boxes without nn.unbox's sharding constraint, which under an active mesh cannot
    apply to shapes or to freshly made params."""
    return jax.tree_util.tree_map(lambda x: x.unbox(apply_constraint=False) if isinstance(x, nn.Partitioned) else x,
                                  tree, is_leaf=lambda x: isinstance(x, nn.Partitioned))


def _no_activation_constraints():
    """Initialising traces a 1-token forward; under k2jax.use_mesh its activation constraints would apply to
    that trace and fail. With no logical-axis rules they are no-ops; the params' axis names are unaffected."""
    return nn.logical_axis_rules(())
