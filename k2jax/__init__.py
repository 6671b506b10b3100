"""k2jax: Kimi K2 (DeepSeek-V3 architecture) in JAX/Flax."""

from k2jax.checkpoint import load_hf
from k2jax.checkpoint.orbax_io import load
from k2jax.config import K2Config
from k2jax.inference.generate import generate
from k2jax.nn.model import K2Model, abstract_params, init_params, param_axes, split_experts, stack_experts
from k2jax.nn.quantized import dequantize_params, quantize_params
from k2jax.sharding import make_mesh, param_shardings, use_mesh
from k2jax.train import default_optimizer, loss_and_metrics, make_train_step

__version__ = "0.1.0"

__all__ = ["K2Config", "K2Model", "abstract_params", "default_optimizer", "dequantize_params", "generate", "init_params", "load",
           "load_hf", "loss_and_metrics", "make_mesh", "make_train_step", "param_axes", "param_shardings", "quantize_params",
           "split_experts", "stack_experts", "use_mesh", "__version__"]
