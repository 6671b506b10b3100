"""K2Model: embed -> dense blocks -> MoE blocks (each group under nn.scan) -> final norm -> lm_head."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from k2jax.config import K2Config
from k2jax.nn.block import DecoderBlock
from k2jax.nn.common import param
from k2jax.ops.matmul import einsum
from k2jax.ops.moe import OutputMajor
from k2jax.ops.ragged import HeadMajorKV
from k2jax.nn.norm import RMSNorm
from k2jax.nn.quantized import abstract_quantized, quantized_axes


# The collection K2Model sows its final hidden states [B, T, D] into (key "final_BTD", a 1-tuple).
HIDDEN = "hidden"


class K2Model(nn.Module):
    """The model: tokens [B, T] int32 -> logits float32, with or without a latent KV cache.

    `__call__(tokens_BT, positions_BT=None, attention_mask_BS=None, cache=None, logits_at_B=None)`:
    - no cache (training, scoring): logits [B, T, V]. positions default to 0..T-1; attention_mask [B, T]
      (1 = real token) is a key padding mask combined with the causal one (left padding allowed).
    - cache (k2jax.ops.paged.PagedCache, from k2jax.runtime.cache): each row's T tokens continue the
      sequence the cache holds for it: token t of row b is at position lengths[b] + t (positions default
      to that), attends to the row's cached tokens and causally to the new ones, and its latents are written
      into the row's pages. attention_mask [B, T] marks the real new tokens, a prefix of each row (default
      all); padding tokens are computed but never written. -> (logits, cache with the new tokens written and
      lengths advanced). Donate the cache to write it in place.
    - a ragged cache (k2jax.ops.ragged.RaggedCache): tokens [1, T] are one flat batch of many rows' new
      tokens, laid out as that module says; the cache gives their rows and positions.
    logits_at_B: [B] int, the one position per row whose logits are wanted (prefill: the last real token)
    -> logits [B, V] instead of [B, T, V] (T x V would not fit for long prompts); or [B, J], J positions per
    row -> [B, J, V] (a ragged step: [1, rows], each row's last token). Every position's final
    hidden state (after the norm) is sown into the HIDDEN collection (see k2jax.ops.logprobs).

    Attention takes its fast forms (k2jax.ops.attention.attend, chosen from the shapes); `attention="plain"`
    (or the `reference` method) the plain expanded one. Computation runs in `param_dtype`; norms, softmax and
    the router in float32.
    """

    cfg: K2Config
    param_dtype: jnp.dtype = jnp.float32
    moe_impl: str = "auto"
    remat: str = "none"  # per block, one of REMAT_POLICIES: trades the backward pass's memory for compute
    attention: str = "auto"  # one of k2jax.ops.attention.ATTENTION_IMPLS

    def __call__(self, tokens_BT, positions_BT=None, attention_mask_BS=None, cache=None, logits_at_B=None):
        return self.forward(tokens_BT, positions_BT, attention_mask_BS, cache, logits_at_B, self.attention)

    def reference(self, tokens_BT, positions_BT=None, attention_mask_BS=None, cache=None, logits_at_B=None):
        """The same through the plain attention (the whole [T, S] mask and score matrix)."""
        return self.forward(tokens_BT, positions_BT, attention_mask_BS, cache, logits_at_B, "plain")

    @nn.compact
    def forward(self, tokens_BT, positions_BT, attention_mask_BS, cache, logits_at_B, attention):
        """__call__ with the attention form given (see the class docstring)."""
        cfg, dt = self.cfg, self.param_dtype
        B, T = tokens_BT.shape
        valid_BT = jnp.ones((B, T), bool) if attention_mask_BS is None else attention_mask_BS.astype(bool)
        if positions_BT is None:
            positions_BT = (jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)) if cache is None
                            else cache.positions(T))
        embed_VD = param(self, "embed_tokens", (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dt,
                         nn.initializers.normal(1.0))
        x_BTD = embed_VD[tokens_BT]
        # The MoE layers' routed-expert stacks go to the blocks whole, with each layer's index (see MoE).
        stacks = self._expert_stacks()
        if cache is not None and hasattr(cache, "kv_b"):  # a paged cache's decode reads them in place
            cache = cache.replace(kv_b=self._kv_b_stacks())
        new = {}
        for name, n, moe in (("dense_layers", cfg.num_dense_layers, False),
                             ("moe_layers", cfg.num_moe_layers, True)):
            if n:
                blocks = scanned_blocks(n, self.remat)(cfg, moe, dt, self.moe_impl, attention, name, name=name)
                x_BTD, new[name] = blocks(x_BTD, positions_BT, valid_BT, cache, stacks if moe else None,
                                          jnp.arange(n))
        x_BTD = RMSNorm(cfg.rms_norm_eps, dt, "embed", name="norm")(x_BTD)  # per position: norm, then take
        # Every position's final hidden state, for a caller that scores given tokens (a prompt's logprobs,
        # k2jax.runtime.runner): apply with mutable=[HIDDEN] to get it (its own collection, so that the
        # layers' sown router statistics stay off); otherwise a no-op.
        self.sow(HIDDEN, "final_BTD", x_BTD)
        if logits_at_B is not None:  # [B] (one position per row) or [B, J]
            at_BJ = logits_at_B.astype(jnp.int32).reshape(B, -1)
            x_BTD = jnp.take_along_axis(x_BTD, at_BJ[..., None], axis=1)
        if cfg.tie_word_embeddings:
            head_DV = embed_VD.T
        else:
            head_DV = param(self, "lm_head", (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), dt)
        logits = einsum("BTD,DV->BTV", x_BTD, head_DV, jnp.float32)
        if logits_at_B is not None and logits_at_B.ndim == 1:
            logits = logits[:, 0]
        if cache is None:
            return logits
        cache = cache.append(new, valid_BT.sum(1).astype(jnp.int32))
        return logits, (cache.replace(kv_b={}) if hasattr(cache, "kv_b") else cache)

    def _kv_b_stacks(self) -> dict:
        """{group: its layers' kv_b_proj stack [L, R, N, K + V]} for the groups whose stack is a plain array or
        fp8 (an int4 one is dequantized per layer as before), values only (a cache is no training path)."""
        out = {}
        for name in ("dense_layers", "moe_layers"):
            if self.has_variable("params", name):
                w = self.get_variable("params", name).get("self_attn", {}).get("kv_b_proj")
                if isinstance(w, jax.Array) or getattr(w, "fmt", None) == "fp8":
                    out[name] = jax.tree.map(jax.lax.stop_gradient, w)
        return out

    def _expert_stacks(self):
        """The params' routed-expert stacks of the MoE layers ({"gate_proj": [L, E, D, F], ...}), their
        per-layer views if the params carry them (see expert_views), or None (init, or no MoE layers)."""
        if self.has_variable("params", EXPERT_VIEWS):
            stacks = self.get_variable("params", EXPERT_VIEWS)
        elif self.has_variable("params", "moe_layers"):
            stacks = self.get_variable("params", "moe_layers").get("mlp", {}).get("experts")
        else:
            return None
        # Values only: derivatives reach the experts through the scan's per-layer slices (see MoE).
        return jax.lax.stop_gradient(stacks)


# What a block keeps from its forward pass for the backward pass: everything ("none": no remat), only its
# inputs ("full": the block is recomputed), or also the weight matmuls' outputs ("save_matmuls": attention
# scores and elementwise work are recomputed).
REMAT_POLICIES = {"none": None, "full": jax.checkpoint_policies.nothing_saveable,
                  "save_matmuls": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def scanned_blocks(length: int, remat: str = "none"):
    """DecoderBlock repeated `length` times under nn.scan: params stacked on a leading, unsharded 'layers'
    axis, so compile time does not grow with depth. Each block gets its layer index; positions, kv_valid,
    the cache (read only: the blocks return their new latents, written in after the last layer, since a
    cache scanned in and out with the layers would be copied whole on every step) and the routed-expert
    stacks (see MoE) are shared by all layers. Sown intermediates (router statistics) are stacked on the
    layer axis too. remat: see REMAT_POLICIES."""
    if remat not in REMAT_POLICIES:
        raise ValueError(f"remat policy must be one of {tuple(REMAT_POLICIES)}, got {remat!r}")
    block = DecoderBlock
    if remat != "none":
        block = nn.remat(DecoderBlock, policy=REMAT_POLICIES[remat], prevent_cse=False)  # scan stops CSE
    return nn.scan(block, variable_axes={"params": 0, "intermediates": 0}, split_rngs={"params": True},
                   in_axes=(nn.broadcast,) * 4 + (0,), length=length,
                   metadata_params={nn.PARTITION_NAME: "layers"})


# Where expert_views puts its per-layer views: {"gate_proj": (L arrays [E, D, F] or QuantizedWeight), ...}.
EXPERT_VIEWS = "_moe_expert_views"


def expert_views(params, output_major: bool = False):
    """params plus per-layer arrays of the MoE layers' routed-expert stacks (under EXPERT_VIEWS), for a
    runtime's own jitted steps on one XLA:CPU device (k2jax.runtime.runner): the same tree otherwise.

    XLA:CPU copies any slice of an array that feeds a matmul, and a layer's experts sliced out of the stacked
    params inside a step are such a slice. k2jax.ops.moe reads them out of the stacks block by block, which
    costs a prefill little but doubles what decode, bound by reading the chosen experts, moves. A view is a
    separate jax array over the stack's own memory (a numpy view of the CPU buffer put back without a copy),
    so a switch on the layer reads it in place. When the backend would copy (not on one CPU device, or
    abstract params), the params come back unchanged. The views share the stacks' memory: they are valid
    while the stacks are, and must not outlive them (do not delete or donate the params).

    output_major: the plain gate and up stacks are instead copied, a layer at a time, into per-layer
    k2jax.ops.moe.OutputMajor arrays [E, F, D], which XLA:CPU's few-row dots read faster (see OutputMajor):
    two thirds of the routed experts' bytes held a second time, for a faster decode step. down_proj and
    quantized experts stay views.
    """
    stacks = params.get("moe_layers", {}).get("mlp", {}).get("experts") if isinstance(params, dict) else None
    if stacks is None or EXPERT_VIEWS in params:
        return params
    if not all(_on_one_cpu(a) for a in jax.tree.leaves(stacks)):
        return params
    by_layer = {}
    for name, stack in stacks.items():  # a plain array or a QuantizedWeight (values and scales)
        if output_major and name in ("gate_proj", "up_proj") and isinstance(stack, jax.Array):
            by_layer[name] = _output_major_layers(stack)
            continue
        leaves, treedef = jax.tree.flatten(stack)
        largest = max(range(len(leaves)), key=lambda j: leaves[j].nbytes)
        # The values must be views; a QuantizedWeight's few scales may be copied (a layer's scales can start
        # off the alignment a zero-copy array needs).
        per_leaf = [_layer_views(a, copy_ok=j != largest) for j, a in enumerate(leaves)]
        if any(v is None for v in per_leaf):
            return params
        by_layer[name] = tuple(treedef.unflatten([v[i] for v in per_leaf]) for i in range(leaves[0].shape[0]))
    return params | {EXPERT_VIEWS: by_layer}


def copied_expert_bytes(params) -> int:
    """Bytes of the output-major copies that expert_views(params, output_major=True) added (0: none)."""
    views = params.get(EXPERT_VIEWS, {}) if isinstance(params, dict) else {}
    return sum(w.w_FD.nbytes for layers in views.values() for w in layers if isinstance(w, OutputMajor))


def head_major_kv(params, K: int):
    """params with each layer group's plain kv_b_proj stack [L, R, N, K + V] (K the nope head dim) replaced by
    its k2jax.ops.ragged.HeadMajorKV copy ([L, N, R, K] and [L, N, V, R], made on the host), which only the
    ragged attention takes: for a runtime's ragged steps on one XLA:CPU device (k2jax.runtime.runner).
    Quantized stacks, arrays elsewhere and abstract params stay as they are."""
    if not isinstance(params, dict):
        return params
    out = dict(params)
    for group in ("dense_layers", "moe_layers"):
        attn = params.get(group, {}).get("self_attn", {})
        w = attn.get("kv_b_proj")
        if not _on_one_cpu(w):
            continue
        host = np.asarray(w)
        head_major = HeadMajorKV(_host_copy(np.transpose(host[..., :K], (0, 2, 1, 3)), w),
                                 _host_copy(np.transpose(host[..., K:], (0, 2, 3, 1)), w))
        out[group] = params[group] | {"self_attn": attn | {"kv_b_proj": head_major}}
    return out


def head_major_bytes(params) -> int:
    """Bytes of the HeadMajorKV copies that head_major_kv(params) holds (0: none)."""
    groups = [params.get(g, {}).get("self_attn", {}).get("kv_b_proj") for g in ("dense_layers", "moe_layers")]
    return sum(w.uk_NRK.nbytes + w.uv_NVR.nbytes for w in groups if isinstance(w, HeadMajorKV))


def _output_major_layers(stack_LEDF) -> tuple:
    """Each layer of a [L, E, D, F] stack as OutputMajor([E, F, D]), transposed on the host one layer at a
    time (so at most one layer's temporary beside the copies)."""
    host = np.asarray(stack_LEDF)
    return tuple(OutputMajor(_host_copy(np.swapaxes(host[i], -1, -2), stack_LEDF)) for i in range(host.shape[0]))


def _on_one_cpu(a) -> bool:
    """Whether a is a concrete jax array held whole on one CPU device: where the runtime's per-layer views
    and layout copies are made."""
    return (isinstance(a, jax.Array) and len(a.devices()) == 1 and a.is_fully_addressable
            and next(iter(a.devices())).platform == "cpu")


def _host_copy(host, like):
    """host (a numpy array, e.g. a transpose of like's host view) copied contiguous onto like's device."""
    return jax.device_put(np.ascontiguousarray(host), next(iter(like.devices())))


def _layer_views(a, copy_ok: bool = False):
    """a[0], a[1], ... as jax arrays over a's own memory; None if the backend copies, unless copy_ok."""
    host = np.asarray(a)  # on CPU: a numpy view of the array's own buffer
    device = next(iter(a.devices()))
    views = []
    for i in range(a.shape[0]):
        views.append(jax.device_put(host[i], device))
        if not copy_ok and views[-1].unsafe_buffer_pointer() != host[i].ctypes.data:
            return None  # copied: dropped before any more are made
    return tuple(views)


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
