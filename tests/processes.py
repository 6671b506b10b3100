"""Running the two cooperating processes of a multi-host test and reading back what each reports.

A worker prints its answer as one `RESULT <json>` line on stdout. Its stderr (gloo's and XLA's C++ logging)
goes to a separate file: merged into the same pipe, a C++ write can land inside the answer's line once
Python's buffer fills mid-line, and the line no longer parses."""

import json
import subprocess
import tempfile


def run_all(argvs: list[list[str]], envs: list[dict], timeout: float, cwd=None) -> list[str]:
    """Start every argv at once (each with its env); -> each one's stdout followed by its stderr (so a
    `RESULT` line, from stdout, is whole). Fails, after killing them all, if any
    exits non-zero (showing the tail of its stderr and stdout) or they overrun `timeout` seconds."""
    errs = [tempfile.TemporaryFile(mode="w+") for _ in argvs]  # noqa: SIM115 (closed below, after the processes)
    procs = [subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=err, text=True)
             for argv, env, err in zip(argvs, envs, errs)]
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    texts = []
    for rank, (p, out, err) in enumerate(zip(procs, outs, errs)):
        with err:
            err.seek(0)
            texts.append(out + "\n" + err.read())
        assert p.returncode == 0, f"process {rank} exited with {p.returncode}:\n{texts[-1][-4000:]}"
    return texts


def result(out: str):
    """The JSON of the `RESULT ...` line a worker printed on stdout."""
    return json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[len("RESULT "):])
