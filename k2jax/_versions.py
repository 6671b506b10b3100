"""The lowest versions of the dependencies k2jax runs on (setup.cfg's install_requires says the same; CI runs
the fast tests on an environment built with exactly these), checked when k2jax is imported: an older jax
fails here, naming the versions, instead of with an AttributeError deep in a call (jax.set_mesh and
jax.shard_map at the top level, AxisType and get_abstract_mesh are what the floor is set by)."""

from __future__ import annotations

import importlib.metadata
import re

FLOORS = {
    "jax": "0.7.1",
    "jaxlib": "0.7.1",
    "flax": "0.10.0",
    "orbax-checkpoint": "0.11.17",
    "optax": "0.2.2",
    "chex": "0.1.87",
    "safetensors": "0.4.2",
    "tiktoken": "0.5.2",
    "jinja2": "3.1.6",  # chat templates are untrusted code: older releases have sandbox escapes
    "llguidance": "1.9.1",
}


def parse(version: str) -> tuple[int, ...]:
    """'0.7.1' -> (0, 7, 1); pre-release and local suffixes ('0.8.0rc1', '0.7.1+cuda') are ignored."""
    return tuple(int(p) for p in re.match(r"\d+(?:\.\d+)*", version).group().split("."))


def check(installed=importlib.metadata.version) -> None:
    """Raise ImportError naming every installed dependency older than its floor (absent ones are left to
    their own import error)."""
    old = []
    for name, floor in FLOORS.items():
        try:
            have = installed(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        if parse(have) < parse(floor):
            old.append(f"{name} {have} is installed, k2jax needs {name}>={floor}")
    if old:
        raise ImportError("k2jax: dependencies too old: " + "; ".join(old) +
                          ". Upgrade them, e.g. pip install -U " + " ".join(f"'{n}>={FLOORS[n]}'" for n in
                                                                          (o.split()[0] for o in old)))
