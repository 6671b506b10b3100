"""Running the two cooperating processes of a multi-host test and reading back what each reports.

A worker prints its answer as one `RESULT <json>` line on stdout. Its stderr (gloo's and XLA's C++ logging)
goes to a separate file: merged into the same pipe, a C++ write can land inside the answer's line once
Python's buffer fills mid-line, and the line no longer parses."""

import contextlib
import json
import random
import socket
import subprocess
import tempfile

# Loopback ports for test servers and coordinators come from below the kernel's ephemeral range (32768-60999
# on Linux), where neither bind(("", 0)) nor an outgoing connection can take them between our pick and the
# server's bind. Test files run two at a time, each picking at random from 12,000 ports, and one process
# never hands out the same port twice: two `bind(0)` picks in a row could (a coordinator then answered a
# server's health check in gRPC).
_PORTS = range(20000, 32000)
_GIVEN: set[int] = set()


def free_port() -> int:
    """-> a loopback TCP port that binds now and that this process has not handed out before."""
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.choice(_PORTS)
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    raise RuntimeError(f"no free loopback port in {_PORTS.start}-{_PORTS.stop - 1} after 200 tries")


def run_all(argvs: list[list[str]], envs: list[dict], timeout: float, cwd=None) -> list[str]:
    """Start every argv at once (each with its env); -> each one's stdout followed by its stderr (so a
    `RESULT` line, from stdout, is whole). Both go to files, not pipes: a process cannot block on a full pipe
    nobody reads while another is waited for. Fails, after killing them all, if any exits non-zero (showing
    the tail of its output) or they overrun `timeout` seconds."""
    with contextlib.ExitStack() as files:
        outs = [(files.enter_context(tempfile.TemporaryFile(mode="w+")),
                 files.enter_context(tempfile.TemporaryFile(mode="w+"))) for _ in argvs]
        procs = [subprocess.Popen(argv, env=env, cwd=cwd, stdout=out, stderr=err, text=True)
                 for argv, env, (out, err) in zip(argvs, envs, outs)]
        try:
            for p in procs:
                p.wait(timeout=timeout)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        texts = []
        for out, err in outs:
            out.seek(0)
            err.seek(0)
            texts.append(out.read() + "\n" + err.read())
    for rank, (p, text) in enumerate(zip(procs, texts)):
        assert p.returncode == 0, f"process {rank} exited with {p.returncode}:\n{text[-4000:]}"
    return texts


def result(out: str):
    """The JSON of the `RESULT ...` line a worker printed on stdout."""
    return json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[len("RESULT "):])
