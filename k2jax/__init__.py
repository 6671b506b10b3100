"""k2jax: Kimi K2 (DeepSeek-V3 architecture) in JAX/Flax."""

from k2jax.config import K2Config
from k2jax.nn.model import K2Model, abstract_params, init_params, param_axes
from k2jax.checkpoint import load_hf

__version__ = "0.1.0"

__all__ = ["K2Config", "K2Model", "abstract_params", "init_params", "load_hf", "param_axes", "__version__"]
