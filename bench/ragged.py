"""Ragged steps against rectangular ones, side by side in one run (`k2jax serve --step-layout ragged` vs
`--step-layout rectangular`, over HTTP with a streaming client):

1. Cold start: `serve --demo --compile-cache none` until /health answers, and the step programs it compiled
   (its start-up log says how many, and why). Goal: within 60 s, at most 12 programs.
2. Batching: 16 concurrent requests (12-token prompts, 12 new tokens each) against one alone on
   `serve --demo --dtype float32 --max-batch 16`: the ratio of their wall times. Goal: at most 4x.

    python bench/ragged.py [--skip 1,2] [--log FILE]

The CPU is what it is: compare only within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from runtime import Server, _concurrency  # noqa: E402  (bench/runtime.py)

LAYOUTS = ("ragged", "rectangular")


def cold_start(layout: str, log_path: str) -> tuple[float, int]:
    """-> (seconds until healthy, step programs compiled) of `serve --demo` with no compile cache."""
    with open(log_path, "w") as log:
        s = Server(["--demo", "--step-layout", layout], log, "none")
    try:
        text = open(log_path).read()
        programs = int(re.search(r"compiling (\d+) step programs", text).group(1))
        return s.up_s, programs
    finally:
        s.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip", default="", help="comma-separated goal numbers to skip")
    ap.add_argument("--log", default=None, help="keep the servers' output in this file")
    args = ap.parse_args()
    skip = {int(x) for x in args.skip.split(",") if x}
    rows = []
    with tempfile.TemporaryDirectory() as d:
        log_path = args.log or os.path.join(d, "serve.log")
        if 1 not in skip:
            got = {lay: cold_start(lay, log_path + f".{lay}") for lay in LAYOUTS}
            rows.append(("1", "serve --demo --compile-cache none: healthy after",
                         {lay: f"{s:.0f} s, {n} programs" for lay, (s, n) in got.items()},
                         got["ragged"][0] / got["rectangular"][0], "<= 60 s, <= 12 programs"))
        if 2 not in skip:
            rng = np.random.default_rng(0)
            prompts = [rng.integers(2, 1000, 12).tolist() for _ in range(16)]
            got = {}
            for lay in LAYOUTS:
                with open(log_path + f".{lay}.batch", "w") as log:
                    s = Server(["--demo", "--dtype", "float32", "--max-batch", "16", "--step-layout", lay], log,
                               os.path.join(d, "xla"))
                try:
                    got[lay] = asyncio.run(_concurrency(s.url, prompts))
                finally:
                    s.close()
            rows.append(("2", "16 concurrent 12-token requests / one alone",
                         {lay: f"{r:.2f}x ({many:.2f} s vs {one:.2f} s)" for lay, (r, one, many) in got.items()},
                         got["ragged"][0] / got["rectangular"][0], "<= 4x"))
    print()
    for goal, what, by, ratio, want in rows:
        print(f"{goal}. {what}: ragged {by['ragged']}; rectangular {by['rectangular']} "
              f"(ragged / rectangular {ratio:.2f}; goal {want})")


if __name__ == "__main__":
    main()
