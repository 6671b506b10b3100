"""`python -m k2jax ...`: the same command line as `k2jax ...` (k2jax.cli)."""

from k2jax.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
