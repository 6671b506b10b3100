"""Training: masked next-token cross-entropy, a jitted (optionally sharded) optax step, router statistics and
DeepSeek-V3's auxiliary-loss-free load balancing.

    step = make_train_step(K2Model(cfg), optax.adamw(1e-3), mesh=None, balance_gamma=1e-3)
    params = step.place(params)
    opt_state = step.init(params)
    params, opt_state, metrics = step(params, opt_state, {"tokens": tokens_BT, "loss_mask": mask_BT})

Batch (a dict of [B, T] arrays): `tokens` int32; `loss_mask` optional, 1 where token t is a target (the
prediction made at position t-1 counts; prompt tokens 0); `attention_mask` optional, 1 = real token (padding
is attended by nobody, is never a target and predicts nothing).

Metrics: loss (the mean cross-entropy over target tokens), tokens (their count), grad_norm (global norm of the
gradient of the optimized loss), balance_loss (when balance_alpha > 0), and per MoE layer: load [L, E] (tokens
routed to each expert, padding included) and bias_changed [L] (fraction of tokens whose top-k set differs from
the choice the router would make with a zero correction bias).

Quantized params (k2jax.nn.quantized: FP8 blocks, INT4 routed experts) train with those leaves frozen: their
fp8 / packed-integer values are not differentiable, so the gradient, the optimizer state and the update cover
the plain params only (norms, router, embeddings, lm_head, and with "int4" attention, dense and shared MLPs);
the activations still flow back through the dequantized weights to everything before them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from k2jax.nn.model import K2Model, abstract_params, subtree, with_subtree
from k2jax.ops.quant import is_quantized

BIAS_PATH = ("moe_layers", "mlp", "gate", "e_score_correction_bias")  # [L, E], moved only by balancing
NO_DECAY = ("weight", "e_score_correction_bias")  # RMSNorm weights and the router bias


# ------------------------------------------------------------------------------------------------------ loss
def next_token_targets(tokens_BT, loss_mask_BT=None, attention_mask_BT=None):
    """tokens [B, T] -> (labels [B, T] int32, weights [B, T] float32): position t predicts tokens[t+1] with
    weight loss_mask[t+1] · attention_mask[t+1] · attention_mask[t] (a padding position predicts nothing,
    not even the first real token after left padding); the last position predicts nothing."""
    def shift(x_BT):
        return jnp.concatenate([x_BT[:, 1:], jnp.zeros_like(x_BT[:, :1])], axis=1)

    labels_BT = shift(tokens_BT).astype(jnp.int32)
    # The last position has no next token: its weight is 0 whatever masks are given (the shifted masks
    # would zero it, but with no mask at all it would be trained to predict the filler label 0).
    w_BT = jnp.ones(tokens_BT.shape, jnp.float32).at[:, -1].set(0.0)
    if loss_mask_BT is not None:
        w_BT = w_BT * shift(loss_mask_BT.astype(jnp.float32))
    if attention_mask_BT is not None:
        real_BT = attention_mask_BT.astype(jnp.float32)
        w_BT = w_BT * shift(real_BT) * real_BT
    return labels_BT, w_BT


def token_nll(h_BTD, head_DV, labels_BT, chunk: int = 512):
    """-log softmax(h · head)[label] per position, float32 [B, T], from the final hidden states h [B, T, D]
    and the output projection head [D, V].

    Memory-aware: the float32 logits exist for `chunk` positions at a time ([B, chunk, V]), and the backward
    pass recomputes them chunk by chunk (jax.checkpoint) instead of keeping [B, T, V]. Chunks run along the
    positions, so the batch (data-sharded) and the vocabulary (tensor-sharded) stay whole in each chunk.
    """
    B, T, D = h_BTD.shape
    C = max(1, min(chunk, T))
    pad = -T % C
    h_BTD = jnp.pad(h_BTD, ((0, 0), (0, pad), (0, 0)))
    labels_BT = jnp.pad(labels_BT, ((0, 0), (0, pad)))
    n = (T + pad) // C
    h_nBCD = h_BTD.reshape(B, n, C, D).swapaxes(0, 1)
    y_nBC = labels_BT.reshape(B, n, C).swapaxes(0, 1)

    @jax.checkpoint
    def one_chunk(_, inp):
        h_BCD, y_BC = inp
        logits_BCV = jnp.einsum("BCD,DV->BCV", h_BCD, head_DV, preferred_element_type=jnp.float32)
        picked_BC = jnp.sum(logits_BCV * jax.nn.one_hot(y_BC, logits_BCV.shape[-1], dtype=jnp.float32), -1)
        return None, jax.nn.logsumexp(logits_BCV, axis=-1) - picked_BC

    _, nll_nBC = jax.lax.scan(one_chunk, None, (h_nBCD, y_nBC))
    return nll_nBC.swapaxes(0, 1).reshape(B, n * C)[:, :T]


def _is_final_norm(module: nn.Module, method: str) -> bool:
    return module.scope is not None and module.scope.path == ("norm",) and method == "__call__"


def loss_and_metrics(model: K2Model, params, batch: dict, *, balance_alpha: float = 0.0, loss_chunk: int = 512):
    """(loss, metrics) of one batch (see the module docstring): the masked next-token cross-entropy in
    float32, plus balance_alpha × Σ_layers of DeepSeek-V3's sequence-wise balance term when balance_alpha > 0.

    params may be stored in a wider dtype than the model's (float32 master weights): they are cast to the
    model's param dtypes here, so gradients come back in the stored dtype. The correction bias is held
    constant (stop_gradient): its gradient is exactly zero.
    """
    cfg = model.cfg
    params = with_subtree(params, BIAS_PATH, jax.lax.stop_gradient)
    params = jax.tree.map(lambda p, a: p if is_quantized(p) else p.astype(a.dtype), params,
                          _abstract(cfg, model.param_dtype), is_leaf=is_quantized)
    # The model's logits are not used (nor computed: jit drops them); the final norm's output is taken
    # instead, for the chunked loss above.
    _, state = model.apply({"params": params}, batch["tokens"], None, batch.get("attention_mask"),
                           capture_intermediates=_is_final_norm, mutable=["intermediates"])
    inter = state["intermediates"]
    h_BTD = inter["norm"]["__call__"][0]
    head_DV = params["embed_tokens"].T if cfg.tie_word_embeddings else params["lm_head"]
    labels_BT, w_BT = next_token_targets(batch["tokens"], batch.get("loss_mask"), batch.get("attention_mask"))
    tokens = w_BT.sum()
    ce = jnp.sum(token_nll(h_BTD, head_DV, labels_BT, loss_chunk) * w_BT) / jnp.maximum(tokens, 1.0)
    metrics = {"loss": ce, "tokens": tokens}
    loss = ce
    if cfg.num_moe_layers:
        gate = inter["moe_layers"]["mlp"]["gate"]
        metrics["load"], metrics["bias_changed"] = gate["load"][0], gate["bias_changed"][0]
        if balance_alpha:
            metrics["balance_loss"] = balance_alpha * gate["seq_balance"][0].sum()
            loss = loss + metrics["balance_loss"]
    return loss, metrics


def balance_bias(bias_LE, load_LE, gamma: float):
    """DeepSeek-V3's auxiliary-loss-free update: bias += gamma · sign(mean load - load), per layer."""
    return bias_LE + gamma * jnp.sign(load_LE.mean(-1, keepdims=True) - load_LE)


# ------------------------------------------------------------------------------------------------- optimizer
def default_optimizer(learning_rate: float = 3e-4, weight_decay: float = 0.1, clip_norm: float = 1.0):
    """AdamW (b1 0.9, b2 0.95) after global-norm gradient clipping; weight decay on matmul weights and
    embeddings, not on RMSNorm weights or the router bias."""
    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key not in NO_DECAY, params)

    return optax.chain(optax.clip_by_global_norm(clip_norm),
                       optax.adamw(learning_rate, b1=0.9, b2=0.95, weight_decay=weight_decay, mask=decay_mask))


def opt_state_shardings(optimizer: optax.GradientTransformation, params_abstract, param_shardings, mesh):
    """Shardings of `optimizer.init(params)`: every state leaf that mirrors a param (same key path at the end
    of its own path, same shape: Adam's mu and nu, ...) gets that param's sharding; the rest (step counts,
    scalars) are replicated."""
    state = jax.eval_shape(optimizer.init, params_abstract)
    by_path = {_dict_keys(p): (a.shape, s) for (p, a), s in
               zip(jax.tree_util.tree_leaves_with_path(params_abstract), jax.tree.leaves(param_shardings))}
    replicated = NamedSharding(mesh, P())

    def place(path, leaf):
        shape, sharding = by_path.get(_dict_keys(path), (None, replicated))
        return sharding if shape == leaf.shape else replicated

    return jax.tree_util.tree_map_with_path(place, state)


# ------------------------------------------------------------------------------------------------ train step
@dataclasses.dataclass(frozen=True)
class TrainStep:
    """A jitted train step `(params, opt_state, batch) -> (params, opt_state, metrics)`; params and
    opt_state are donated. With a mesh, `place` and `init` put params and optimizer state where the step
    expects them (`param_shardings`, `opt_shardings`)."""

    fn: Callable
    optimizer: optax.GradientTransformation
    mesh: Any = None
    param_shardings: Any = None
    opt_shardings: Any = None

    def __call__(self, params, opt_state, batch):
        with self._context():
            return self.fn(params, opt_state, batch)

    def place(self, params):
        """params placed by the rules table (unchanged without a mesh)."""
        return params if self.mesh is None else jax.device_put(params, self.param_shardings)

    def init(self, params):
        """The optimizer state of `params` (its trainable part: QuantizedWeight leaves are frozen), each leaf
        sharded like its param."""
        params = trainable(params)
        if self.mesh is None:
            return jax.jit(self.optimizer.init)(params)
        with self._context():
            return jax.jit(self.optimizer.init, out_shardings=self.opt_shardings)(params)

    def _context(self):
        if self.mesh is None:
            return contextlib.nullcontext()
        from k2jax.sharding import use_mesh

        return use_mesh(self.mesh)


def make_train_step(model: K2Model, optimizer: optax.GradientTransformation | None = None, mesh=None, *,
                    balance_gamma: float = 0.0, balance_alpha: float = 0.0, loss_chunk: int = 512,
                    quant: str | None = None) -> TrainStep:
    """A jitted train step for `model` (its param_dtype, moe_impl and remat apply) with an optax optimizer
    (default: `default_optimizer()`).

    mesh: a mesh from k2jax.sharding.make_mesh; params and optimizer state are sharded by the rules table
    (param_shardings) and the batch over ("data", "fsdp"). balance_gamma > 0: after each step the correction
    bias moves by `balance_bias` from the step's load (the optimizer never changes the bias; with
    balance_gamma 0 it stays as loaded). balance_alpha > 0: adds the sequence-wise balance loss.
    loss_chunk: positions per chunk of the cross-entropy (see token_nll). quant: the params' quantization
    ("fp8" | "int4", see k2jax.nn.quantized), needed with a mesh to shard them; its QuantizedWeight leaves are
    frozen (no gradient, no optimizer state) and come back unchanged.
    """
    cfg = model.cfg
    optimizer = default_optimizer() if optimizer is None else optimizer

    def step(params, opt_state, batch):
        frozen = jax.tree.map(lambda p: p if is_quantized(p) else None, params, is_leaf=is_quantized)
        train = trainable(params)

        def loss_fn(model, train, batch, **kw):
            return loss_and_metrics(model, _merge(train, frozen), batch, **kw)

        grad_fn = jax.value_and_grad(loss_fn, argnums=1, has_aux=True)
        (_, metrics), grads = grad_fn(model, train, batch, balance_alpha=balance_alpha, loss_chunk=loss_chunk)
        metrics["grad_norm"] = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32)))
                                            for g in jax.tree.leaves(grads)))
        updates, opt_state = optimizer.update(grads, opt_state, train)
        new_params = _merge(optax.apply_updates(train, updates), frozen)
        if cfg.num_moe_layers:
            bias_LE = subtree(params, BIAS_PATH)
            if balance_gamma:
                bias_LE = balance_bias(bias_LE, metrics["load"], balance_gamma)
            new_params = with_subtree(new_params, BIAS_PATH, lambda _: bias_LE)
        return new_params, opt_state, metrics

    if mesh is None:
        return TrainStep(jax.jit(step, donate_argnums=(0, 1)), optimizer)
    from k2jax.placement import param_shardings

    param_sh = param_shardings(cfg, mesh, quant=quant)
    opt_sh = opt_state_shardings(optimizer, trainable(abstract_params(cfg, model.param_dtype, quant=quant)),
                                 trainable(param_sh), mesh)
    return TrainStep(_BatchShardedJit(step, mesh, param_sh, opt_sh), optimizer, mesh, param_sh, opt_sh)


class _BatchShardedJit:
    """The jitted step on a mesh, with the batch split over ("data", "fsdp") as far as its size allows (the
    same per-dim fallback as the params, k2jax.sharding.logical_to_spec): one jit per batch sharding."""

    def __init__(self, step, mesh, param_sh, opt_sh):
        self.step, self.mesh, self.param_sh, self.opt_sh, self.jits = step, mesh, param_sh, opt_sh, {}

    def _jit(self, batch):
        from k2jax.sharding import logical_to_spec

        spec = logical_to_spec(("batch", "length"), batch["tokens"].shape, dict(self.mesh.shape))
        if spec not in self.jits:
            self.jits[spec] = jax.jit(self.step, in_shardings=(self.param_sh, self.opt_sh,
                                                               NamedSharding(self.mesh, spec)),
                                      out_shardings=(self.param_sh, self.opt_sh, NamedSharding(self.mesh, P())),
                                      donate_argnums=(0, 1))
        return self.jits[spec]

    def __call__(self, params, opt_state, batch):
        return self._jit(batch)(params, opt_state, batch)

    def lower(self, params, opt_state, batch):
        return self._jit(batch).lower(params, opt_state, batch)


# ------------------------------------------------------------------------------------------------ helpers
_ABSTRACT: dict = {}


def trainable(params):
    """params with every QuantizedWeight leaf replaced by None (an empty subtree): what is differentiated
    and optimized. Works on param, abstract and sharding trees alike."""
    return jax.tree.map(lambda p: None if is_quantized(p) else p, params, is_leaf=is_quantized)


def _merge(train, frozen):
    """Undo the split of step(): the frozen QuantizedWeight leaves back into the trainable tree's None slots."""
    return jax.tree.map(lambda t, f: f if t is None else t, train, frozen,
                        is_leaf=lambda x: x is None or is_quantized(x))


def _abstract(cfg, dtype):
    key = (cfg, jnp.dtype(dtype))
    if key not in _ABSTRACT:
        _ABSTRACT[key] = abstract_params(cfg, dtype)
    return _ABSTRACT[key]


def _dict_keys(path) -> tuple:
    """The trailing run of dict keys of a pytree path (a param's path inside an optimizer state)."""
    keys = []
    for k in reversed(path):
        if not isinstance(k, jax.tree_util.DictKey):
            break
        keys.append(k.key)
    return tuple(reversed(keys))


