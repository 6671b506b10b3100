"""k2jax: Kimi K2 (DeepSeek-V3 architecture) in JAX/Flax."""

from k2jax import _versions

_versions.check()  # before jax is imported: a too-old jax fails here with the versions named

from k2jax.checkpoint import load_hf  # noqa: E402
from k2jax.checkpoint.orbax_restore import load  # noqa: E402
from k2jax.config import K2Config  # noqa: E402
from k2jax.runtime.generate import generate  # noqa: E402
from k2jax.nn.model import K2Model, abstract_params, init_params, param_axes  # noqa: E402
from k2jax.nn.quantized import dequantize_params, quantize_params  # noqa: E402
from k2jax.ops.quant import QuantizedWeight  # noqa: E402
from k2jax.placement import param_shardings  # noqa: E402
from k2jax.sharding import make_mesh, use_mesh  # noqa: E402
from k2jax.train import default_optimizer, loss_and_metrics, make_train_step  # noqa: E402

__version__ = "0.1.0"

__all__ = ["K2Config", "K2Model", "QuantizedWeight", "abstract_params", "default_optimizer", "dequantize_params", "generate", "init_params", "load",
           "load_hf", "loss_and_metrics", "make_mesh", "make_train_step", "param_axes", "param_shardings", "quantize_params",
           "use_mesh", "__version__"]
