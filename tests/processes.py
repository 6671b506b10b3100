"""Running the two cooperating processes of a multi-host test and reading back what each reports.

A worker prints its answer as one `RESULT <json>` line on stdout. Its stderr (gloo's and XLA's C++ logging)
goes to a separate file: merged into the same pipe, a C++ write can land inside the answer's line once
Python's buffer fills mid-line, and the line no longer parses."""

import contextlib
import json
import subprocess
import tempfile


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
