"""Ahead-of-time compilation for TPU slices on any host: the runtime's real programs compiled by the TPU
compiler (libtpu, `pip install 'k2jax[tpu-aot]'`) for a topology such as v5p:4x4x4, with nothing allocated
and nothing run, and the compiled programs read for their per-chip bytes, collectives and weight copies.

- k2jax.aot.topology: the topology's devices and a k2jax mesh over them;
- k2jax.aot.compile: the programs (k2jax.runtime.runner's steps) compiled and measured;
- k2jax.aot.hlo: reading optimized HLO text;
- k2jax.aot.report: what `k2jax plan --compile` prints.

Not imported by `import k2jax` (libtpu is optional)."""
