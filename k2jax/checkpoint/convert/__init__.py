"""HF safetensors (the released FP8 checkpoint, Kimi-K2-Thinking's INT4, Kimi-K2.5's text model) -> k2jax Orbax
checkpoint (layout: k2jax.checkpoint.orbax_layout): streaming, verified, resumable, multi-process.

    source headers --verify all--> the stored tree's arrays --per piece of a tensor: 2 threads read ahead,
        N threads--> check -> dequantize / keep e4m3 or INT4 -> k2jax layout -> write its (layer, expert) slot
        of the stacked array -> unit done marker -> all units done: config.json, Orbax _METADATA, manifest (the
        completion marker), last

One job per module: verify (the source), destination (DST's state and the resume markers), codec (one tensor),
pool (the reading and converting threads), processes (agreement under jax.distributed), job (`convert`, and
the manifest), cli (the command line).

Memory: the readers fill buffers lent from a fixed budget, and each converting thread converts one piece at a
time (a big tensor goes in pieces of whole chunks) in buffers it reuses, so the peak is a few tensors' worth,
independent of the number of blocks (pool.memory_bound). Data moves with O_DIRECT (filling and flushing the
page cache would cost more CPU than the conversion itself), reads and writes in flight together.
"""

from k2jax.checkpoint.convert.cli import DESCRIPTION, add_arguments, main, run
from k2jax.checkpoint.convert.errors import ConvertError
from k2jax.checkpoint.convert.job import Stats, convert

__all__ = ["DESCRIPTION", "ConvertError", "Stats", "add_arguments", "convert", "main", "run"]
