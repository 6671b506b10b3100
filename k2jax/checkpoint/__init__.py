"""Checkpoints, one job per module:

- names: the HuggingFace tensor-name table (release name -> k2jax param, re-layout)
- fp8, int4: the release's quantized formats (FP8 blocks of Kimi-K2-Instruct, compressed-tensors INT4 packing
  of Kimi-K2-Thinking / K2.5)
- safetensors_io: safetensors headers, index and reads
- hf_validate, hf_read, hf_write: a HF checkpoint's validation, `load_hf`, and `save_hf` /
  `write_release_checkpoint`
- convert: the streaming HF -> Orbax converter; orbax_layout, chunk_writer, orbax_restore: the converted
  checkpoint's layout, its writer, and `restore` / `k2jax.load`
"""

from k2jax.checkpoint.fp8 import dequantize_fp8_blocks, ensure_numpy_float8, quantize_fp8_blocks, scale_shape
from k2jax.checkpoint.hf_read import load_hf
from k2jax.checkpoint.hf_validate import check_checkpoint
from k2jax.checkpoint.hf_write import save_hf, write_release_checkpoint
from k2jax.checkpoint.names import (
    RULES, SKIP, Relayout, Target, UnknownTensorError, expected_names, global_names, layer_names, resolve,
    source_shape,
)
from k2jax.checkpoint.safetensors_io import Checkpoint, SafetensorsError, SafetensorsFile, TensorInfo

__all__ = [
    "RULES", "SKIP", "Checkpoint", "Relayout", "SafetensorsError", "SafetensorsFile", "Target", "TensorInfo",
    "UnknownTensorError", "check_checkpoint", "dequantize_fp8_blocks", "ensure_numpy_float8", "expected_names",
    "global_names", "layer_names", "load_hf", "quantize_fp8_blocks", "resolve", "save_hf", "scale_shape",
    "source_shape", "write_release_checkpoint",
]
