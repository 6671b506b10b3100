"""A TPU topology without a TPU: its devices from libtpu's compiler (deviceless ahead-of-time compilation),
and a k2jax mesh over them.

`jax.experimental.topologies.get_topology_desc(topology_name="v5p:4x4x4", platform="tpu")` gives the devices
of a slice that is not attached; programs lowered with shardings over a mesh of them compile with the real
TPU compiler (libtpu, `pip install 'k2jax[tpu-aot]'`) on any host. Nothing runs and nothing is allocated.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re

import jax
import numpy as np
from jax.sharding import AxisType

from k2jax.sharding import MESH_AXES, make_mesh, parse_mesh_spec

INSTALL_HINT = ("compiling for a TPU topology needs libtpu, the TPU compiler, matching the installed jax "
                f"({jax.__version__}): pip install 'k2jax[tpu-aot]' (which installs jax[tpu]'s libtpu)")
_TOPOLOGY = re.compile(r"^(v[0-9]+[a-z]*):([0-9]+(?:x[0-9]+)*)$")


def chip_name(topology: str) -> str:
    """"v5p" of "v5p:4x4x4"; ValueError naming the topology if it is not NAME:AxBxC."""
    m = _TOPOLOGY.match(topology.strip().lower())
    if m is None:
        raise ValueError(f"--compile {topology!r}: expected a TPU topology such as v5p:4x4x4 or v6e:8x8")
    return m.group(1)


def chips_in(topology: str) -> int:
    """The chip count a topology name spells: 64 for v5p:4x4x4."""
    chip_name(topology)
    return math.prod(int(n) for n in topology.split(":")[1].split("x"))


def has_libtpu() -> bool:
    return importlib.util.find_spec("libtpu") is not None


def load_topology(topology: str):
    """The devices of `topology` ("v5p:4x4x4") from libtpu's compiler, on any host -> TopologyDescription.

    Raises ValueError with what to install when libtpu is missing, or the compiler's message for a topology
    it does not know."""
    chip_name(topology)
    if not has_libtpu():
        raise ValueError(INSTALL_HINT)
    # libtpu reads the host's slice from these; a CPU host has none (without them it logs warnings and
    # guesses). They describe this host only: the topology compiled for is the one named.
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1")
    # libtpu takes a host-wide lock file (for the TPU's sake); compiling needs no TPU, so processes may share
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    try:
        return topologies.get_topology_desc(topology_name=topology, platform="tpu")
    except Exception as e:  # libtpu's own error types
        raise ValueError(f"--compile {topology!r}: the TPU compiler does not accept it: {e}") from None


def topology_mesh(devices, spec: str | dict[str, int]) -> jax.sharding.Mesh:
    """A mesh over MESH_AXES (k2jax.sharding) on a topology's devices. A mesh that splits a physical axis of
    the slice (tensor=2 on v6e:8x8) is laid out with allow_split_physical_axes."""
    try:
        return make_mesh(spec, devices=devices)
    except ValueError:
        if math.prod(parse_mesh_spec(spec).values()) != len(devices):
            raise
    except (AssertionError, NotImplementedError):
        pass
    from jax.experimental import mesh_utils

    shape = tuple(parse_mesh_spec(spec).values())
    grid = mesh_utils.create_device_mesh(shape, devices=list(devices), allow_split_physical_axes=True)
    return jax.sharding.Mesh(np.asarray(grid), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
