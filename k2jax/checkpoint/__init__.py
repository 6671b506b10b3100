"""HuggingFace checkpoints: the name table, FP8 block scales, safetensors reading, in-memory load/save."""

from k2jax.checkpoint.fp8 import dequantize, ensure_numpy_float8, quantize, scale_shape
from k2jax.checkpoint.hf import check_checkpoint, load_hf, save_hf
from k2jax.checkpoint.names import (
    RULES, SKIP, T, Target, UnknownTensorError, expected_names, global_names, layer_names, resolve,
    source_shape,
)
from k2jax.checkpoint.safetensors_io import Checkpoint, SafetensorsError, SafetensorsFile, TensorInfo

__all__ = [
    "RULES", "SKIP", "T", "Checkpoint", "SafetensorsError", "SafetensorsFile", "Target", "TensorInfo",
    "UnknownTensorError", "check_checkpoint", "dequantize", "ensure_numpy_float8", "expected_names",
    "global_names", "layer_names", "load_hf", "quantize", "resolve", "save_hf", "scale_shape", "source_shape",
]
