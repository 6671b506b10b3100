"""Kernels: the matmul variants, attention kernels and MoE dispatch that the modules in k2jax.nn call.

Imports go one way: k2jax.nn -> k2jax.ops, never back. Backend workarounds (XLA:CPU) live here, named as such.
"""
