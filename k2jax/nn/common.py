"""Small helpers shared by the modules: parameters with logical axis names."""

from __future__ import annotations

import flax.linen as nn

from k2jax.ops.matmul import einsum  # noqa: F401  (the modules' matmul; kept importable from here)
from k2jax.ops.quant import is_quantized
from k2jax.ops.ragged import HeadMajorKV

# Same scale as transformers' initializer_range; real weights come from checkpoints.
DEFAULT_INIT = nn.initializers.normal(stddev=0.02)


def param(module: nn.Module, name: str, shape, axes: tuple[str | None, ...], dtype, init=DEFAULT_INIT):
    """Create a parameter annotated with logical axis names (mapped to mesh axes by k2jax.sharding).

    A k2jax.ops.quant.QuantizedWeight held under that name is returned as it is (the modules' matmuls take
    it), after checking its logical shape: flax's own check compares array leaves, and packed INT4 values
    are half as wide as the weight. So is a runtime's head-major kv_b_proj (k2jax.ops.ragged.HeadMajorKV,
    which only its ragged attention takes).
    """
    assert len(axes) == len(shape), (name, shape, axes)
    if module.has_variable("params", name):
        held = module.get_variable("params", name)
        if isinstance(held, HeadMajorKV):
            return held
        if is_quantized(held):
            if held.shape != tuple(shape):
                raise ValueError(f"quantized param {'/'.join(module.path + (name,))}: shape {held.shape}, "
                                 f"the model expects {tuple(shape)}")
            return held
    return module.param(name, nn.with_logical_partitioning(init, axes), tuple(shape), dtype)
