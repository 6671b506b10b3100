"""Multi-host serving: every process steps the same engine program; process 0 (which runs HTTP) decides.

Each engine step, process 0 posts the requests it takes in and the cancellations under one key of
jax.distributed's key-value store (`k2jax/serve/<step>`); every other process reads that key before its
step, so all processes admit, prefill and decode the same requests in the same order. Keys are deleted a
few steps later (the processes run in lockstep: each step's collectives wait for all of them).
"""

from __future__ import annotations

import dataclasses
import json

from k2jax.serving.engine import Request, SamplingParams

KEEP_STEPS = 64  # keys older than this are deleted by process 0
STOP_TIMEOUT_MS = 60_000
POLL_MS = 10_000  # a follower waits this long per try for process 0's next step (idle servers wait forever)


class StepSync:
    """engine.sync: (new requests, cancelled ids) on process 0 -> the same on every process."""

    def __init__(self):
        import jax
        from jax._src import distributed

        self.client = distributed.global_state.client
        self.rank = jax.process_index()
        self.step = 0
        self.stopped = False

    def _key(self, step: int) -> str:
        return f"k2jax/serve/{step}"

    def __call__(self, new, cancels):
        key = self._key(self.step)
        self.step += 1
        if self.rank == 0:
            msg = {"new": [[r.id, r.prompt, dataclasses.asdict(r.params)] for r in new], "cancel": sorted(cancels)}
            self.client.key_value_set(key, json.dumps(msg))
            if self.step > KEEP_STEPS:
                self.client.key_value_delete(self._key(self.step - 1 - KEEP_STEPS))
            return new, cancels
        msg = json.loads(self._get(key))
        if msg.get("stop"):
            self.stopped = True
            self.client.wait_at_barrier("k2jax/serve/stop", STOP_TIMEOUT_MS)
            return [], set()
        reqs = [Request(prompt, SamplingParams(**{k: _tuples(v) for k, v in p.items()}), _ignore, id=rid)
                for rid, prompt, p in msg["new"]]
        return reqs, set(msg["cancel"])

    def _get(self, key: str) -> str:
        while True:
            try:
                return self.client.blocking_key_value_get(key, POLL_MS)
            except Exception as e:  # noqa: BLE001 - jax raises its runtime error on a timeout: keep waiting
                if "DEADLINE" not in str(e).upper() and "TIMEOUT" not in str(e).upper() and \
                        "TIMED OUT" not in str(e).upper():
                    raise

    def close(self) -> None:
        """Process 0: tell the followers to stop (their next step reads this)."""
        if self.rank == 0:
            self.client.key_value_set(self._key(self.step), json.dumps({"stop": True}))
            # process 0 holds the coordination service: it must not exit before the others have read this
            self.client.wait_at_barrier("k2jax/serve/stop", STOP_TIMEOUT_MS)


def _tuples(v):
    """JSON lists back to the tuples SamplingParams holds (logit_bias: pairs in a tuple)."""
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


def _ignore(_event) -> None:
    """Followers do not answer."""
