"""Multi-host serving: every process steps the same engine program; process 0 (which runs HTTP) decides.

Each engine step, process 0 broadcasts the requests it takes in and the cancellations to every other process
(k2jax.distributed.broadcast_string: collectives over the global devices) before the step, so all processes
admit, prefill and decode the same requests in the same order (they run in lockstep: each step's collectives
wait for all of them). While process 0 has nothing to do, the others wait in that broadcast.
"""

from __future__ import annotations

import dataclasses
import json

from k2jax import distributed
from k2jax.runtime.requests import Request, SamplingParams

STOP_BARRIER = "k2jax/serve/stop"


class StepSync:
    """engine.sync: (new requests, cancelled ids) on process 0 -> the same on every process."""

    def __init__(self):
        self.rank = distributed.process_index()
        self.stopped = False

    def __call__(self, new, cancels):
        if self.rank == 0:
            msg = {"new": [[r.id, r.prompt, dataclasses.asdict(r.params)] for r in new], "cancel": sorted(cancels)}
            distributed.broadcast_string(json.dumps(msg))
            return new, cancels
        msg = json.loads(distributed.broadcast_string(""))
        if msg.get("stop"):
            self.stopped = True
            distributed.barrier(STOP_BARRIER)
            return [], set()
        reqs = [Request(prompt, SamplingParams(**{k: _tuples(v) for k, v in p.items()}), _ignore, id=rid)
                for rid, prompt, p in msg["new"]]
        return reqs, set(msg["cancel"])

    def close(self) -> None:
        """Process 0: tell the followers to stop (their next step reads this)."""
        if self.rank == 0:
            distributed.broadcast_string(json.dumps({"stop": True}))
            # process 0 holds the coordination service: it must not exit before the others have read this
            distributed.barrier(STOP_BARRIER)


def _tuples(v):
    """JSON lists back to the tuples SamplingParams holds (logit_bias: pairs in a tuple)."""
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


def _ignore(_event) -> None:
    """Followers do not answer."""
