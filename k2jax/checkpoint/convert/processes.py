"""Several processes (jax.distributed, one per host) converting into one DST: they agree through the
collectives of k2jax.distributed (process 0 prepares DST and marks it complete; every process learns every
other's problems, so all fail together and none waits forever)."""

from __future__ import annotations

import json

from k2jax import distributed
from k2jax.checkpoint.convert.errors import ConvertError, first_line


def processes() -> tuple[int, int]:
    """(this process's index, how many) under jax.distributed; (0, 1) otherwise."""
    if not distributed.running_distributed():
        return 0, 1
    return distributed.process_index(), distributed.process_count()


def on_process_zero(name: str, index: int, fn):
    """Run fn() -> (result, local value) on process 0 only; every process returns (its result, the local value
    on process 0, None elsewhere), or raises process 0's error."""
    value, local, error = "", None, ""
    if index == 0:
        try:
            result, local = fn()
            value = json.dumps(result)
        except ConvertError as e:
            error = str(e)
    posted = distributed.gather_strings(name, json.dumps({"value": value, "error": error}))
    first = json.loads(posted[0])
    if first["error"]:
        raise ConvertError(first["error"] if index == 0 else f"process 0: {first['error']}")
    return json.loads(first["value"]), local


def on_every_process(name: str, fn) -> list[str]:
    """Run fn() -> problems (list of str) on every process; -> all processes' problems, an exception on any
    process counting as one (so all of them raise)."""
    try:
        mine = {"problems": fn()}
    except ConvertError as e:
        mine = {"problems": [str(e)]}
    except Exception as e:  # noqa: BLE001 - reported by every process, then raised here
        mine = {"problems": [f"{type(e).__name__}: {first_line(e)}"]}
    posted = [json.loads(x) for x in distributed.gather_strings(name, json.dumps(mine))]
    return [f"process {i}: {p}" for i, r in enumerate(posted) for p in r["problems"]]
