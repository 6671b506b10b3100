"""Multi-host runs: one process per host under `jax.distributed`, and the few helpers they need.

Launch the same command on every host of a TPU slice (the slice's environment tells JAX who is who):

    k2jax generate --distributed --checkpoint gs-fuse/k2 --mesh expert=64,tensor=4 ...

or anywhere else (CPU processes, GPU hosts) with the coordinator named explicitly:

    k2jax generate --coordinator 10.0.0.1:1234 --num-processes 2 --process-id 0 ...   # host 0
    k2jax generate --coordinator 10.0.0.1:1234 --num-processes 2 --process-id 1 ...   # host 1

After `initialize`, `jax.devices()` is the global device list, meshes span every host, `k2jax.load` reads on
each process only the checkpoint chunks its own devices hold, and only process 0 prints (`print0`, `is_main`).
"""

from __future__ import annotations

import argparse
import sys

import jax
import numpy as np
from jax.experimental import multihost_utils


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The launch flags shared by `k2jax generate` and `k2jax convert`."""
    g = p.add_argument_group("multi-host (one process per host; see the README)")
    g.add_argument("--distributed", action="store_true",
                   help="initialise jax.distributed from the environment (a Cloud TPU slice, SLURM, ...): run the "
                        "same command on every host")
    g.add_argument("--coordinator", metavar="HOST:PORT",
                   help="address of process 0's coordinator, e.g. 10.0.0.1:1234 (with --num-processes, "
                        "--process-id)")
    g.add_argument("--num-processes", type=int, metavar="N", help="how many processes take part (with --coordinator)")
    g.add_argument("--process-id", type=int, metavar="I", help="this process's index, 0..N-1 (with --coordinator)")


def initialize_from_args(args: argparse.Namespace) -> bool:
    """Initialise jax.distributed as the flags of `add_arguments` ask; -> whether it was initialised."""
    return initialize(getattr(args, "coordinator", None), getattr(args, "num_processes", None),
                      getattr(args, "process_id", None), auto=getattr(args, "distributed", False))


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               *, auto: bool = False) -> bool:
    """`jax.distributed.initialize` from an explicit coordinator (all three arguments) or, with auto=True,
    from the environment (no arguments: what a TPU slice provides). Nothing given: single process, -> False.

    Must run before anything touches the devices. On CPU, cross-process collectives go through gloo.
    Raises ValueError for an incomplete or inconsistent set of arguments.
    """
    explicit = (coordinator, num_processes, process_id)
    if any(x is not None for x in explicit):
        if any(x is None for x in explicit):
            raise ValueError("--coordinator HOST:PORT, --num-processes N and --process-id I go together: give all "
                             "three (or --distributed to take them from a TPU slice's environment)")
        if auto:
            raise ValueError("--distributed takes the launch from the environment: give it or --coordinator, "
                             "not both")
        host, _, port = coordinator.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--coordinator {coordinator!r}: expected HOST:PORT, e.g. 10.0.0.1:1234")
        if num_processes < 1 or not 0 <= process_id < num_processes:
            raise ValueError(f"--process-id {process_id} / --num-processes {num_processes}: need 0 <= I < N")
    elif not auto:
        return False
    try:  # CPU processes exchange data through gloo (the TPU/GPU backends bring their own collectives)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except Exception:  # noqa: BLE001 - an older or newer jax without the option: its default
        pass
    if auto:
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id)
    return True


def process_index() -> int:
    return jax.process_index()


def process_count() -> int:
    return jax.process_count()


def is_main() -> bool:
    """True on process 0 (and in a single-process run): the one that prints and reports."""
    return process_index() == 0


def print0(*args, **kwargs) -> None:
    """print() on process 0 only."""
    if is_main():
        print(*args, **kwargs)


def log0(*args, **kwargs) -> None:
    """print() to stderr on process 0 only (progress and timing lines)."""
    if is_main():
        print(*args, file=sys.stderr, **kwargs)


def share(n: int, index: int | None = None, count: int | None = None) -> range:
    """This process's contiguous part of range(n), split as evenly as possible over the processes (the first
    n % count processes get one more)."""
    index = process_index() if index is None else index
    count = process_count() if count is None else count
    q, r = divmod(n, count)
    start = index * q + min(index, r)
    return range(start, start + q + (index < r))


def gather_strings(name: str, value: str) -> list[str]:
    """Every process's `value`, in process order (a single process: [value]); every process must call it, in
    the same order. Through two collectives over the global devices (jax.experimental.multihost_utils): the
    lengths, then the UTF-8 bytes padded to the longest. `name` labels the exchange in errors."""
    if jax.process_count() == 1:
        return [value]
    data = np.frombuffer(value.encode(), np.uint8)
    try:
        lengths = np.asarray(multihost_utils.process_allgather(np.array([data.size], np.int64))).reshape(-1)
        padded = np.zeros(int(lengths.max()), np.uint8)
        padded[:data.size] = data
        rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(lengths), -1)
    except Exception as e:  # noqa: BLE001 - say which exchange failed; the cause is chained
        raise RuntimeError(f"k2jax.distributed: exchange {name!r} across {jax.process_count()} processes failed: "
                           f"{e}") from e
    return [bytes(row[:n]).decode() for row, n in zip(rows, lengths)]


def broadcast_string(value: str) -> str:
    """Process 0's `value` on every process (a single process: value); every process must call it, in the same
    order (the others' `value` is ignored). Through two collectives (jax.experimental.multihost_utils): the
    length, then the UTF-8 bytes."""
    if jax.process_count() == 1:
        return value
    data = np.frombuffer(value.encode(), np.uint8) if jax.process_index() == 0 else np.zeros(0, np.uint8)
    n = int(np.asarray(multihost_utils.broadcast_one_to_all(np.array(data.size, np.int64))))
    buf = data if jax.process_index() == 0 else np.zeros(n, np.uint8)
    return bytes(np.asarray(multihost_utils.broadcast_one_to_all(buf))).decode()


def barrier(name: str) -> None:
    """Wait until every process reaches the barrier `name` (no-op in a single process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def running_distributed() -> bool:
    """Whether jax.distributed is initialised in this process (without touching the devices)."""
    return jax.distributed.is_initialized()
