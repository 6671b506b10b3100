"""Client for the reference oracle (tests/oracle/oracle.py), usable from k2jax's Python 3.12 tests and bench/.

Pure Python + numpy: torch lives only in the oracle's own interpreter, started once as `oracle.py --serve`
and fed one JSON request per line (see oracle.py's docstring for the request fields and npz keys).

    from tests.oracle.client import Oracle, require_oracle
    with Oracle() as oracle:
        out = oracle.run({"config": cfg, "seed": 0, "inputs": {"input_ids": ids}, "capture": True})
        out["logits"]  # np.ndarray [B, T, V] float32

Environment:
    K2JAX_ORACLE_PYTHON    the oracle interpreter (default: <repo>/.oracle-venv/bin/python)
    K2JAX_REQUIRE_ORACLE   "1": a missing oracle is an error (CI), not a skip
    K2JAX_ORACLE_LOG       file for the oracle's stderr (default: a temp file, tail quoted in errors)
    ORACLE_THREADS         torch threads in the oracle (default 2)
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import uuid
from pathlib import Path

import numpy as np

ORACLE_SCRIPT = Path(__file__).resolve().with_name("oracle.py")
REPO_ROOT = Path(__file__).resolve().parents[2]


class OracleError(RuntimeError):
    """The oracle failed, timed out, or is not installed."""


def oracle_python() -> Path:
    """Path of the oracle interpreter: $K2JAX_ORACLE_PYTHON, else <repo>/.oracle-venv/bin/python."""
    env = os.environ.get("K2JAX_ORACLE_PYTHON")
    return Path(env) if env else REPO_ROOT / ".oracle-venv" / "bin" / "python"


def _json_default(x):
    """Let requests carry numpy arrays and scalars (e.g. input_ids)."""
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON serializable: {type(x).__name__}")


class Oracle:
    """A lazily started `oracle.py --serve` subprocess; one request at a time (thread-safe)."""

    def __init__(self, python: str | os.PathLike | None = None, timeout: float = 600.0,
                 log_path: str | os.PathLike | None = None, threads: int | None = None):
        self.python = Path(python) if python else oracle_python()
        self.timeout = timeout
        self.threads = threads
        self._tmp = tempfile.mkdtemp(prefix="k2jax-oracle-")
        self.log_path = Path(log_path or os.environ.get("K2JAX_ORACLE_LOG") or os.path.join(self._tmp, "stderr.log"))
        self._proc: subprocess.Popen | None = None
        self._lines: queue.Queue | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------------------------------- status
    @staticmethod
    def available(python: str | os.PathLike | None = None) -> bool:
        """Whether the oracle interpreter and script exist (does not start it)."""
        py = Path(python) if python else oracle_python()
        return py.exists() and ORACLE_SCRIPT.exists()

    @staticmethod
    def unavailable_reason() -> str:
        return (f"reference oracle not installed: {oracle_python()} missing (build it with "
                f"tests/oracle/requirements.txt, or set K2JAX_ORACLE_PYTHON)")

    # ---------------------------------------------------------------------------------------------- lifecycle
    def _start(self) -> None:
        if not self.available(self.python):
            raise OracleError(self.unavailable_reason())
        env = dict(os.environ)
        if self.threads is not None:
            env["ORACLE_THREADS"] = str(self.threads)
        env.setdefault("HF_HUB_OFFLINE", "1")  # the oracle never needs the network
        env.setdefault("TRANSFORMERS_OFFLINE", "1")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        try:
            self._proc = subprocess.Popen(
                [str(self.python), str(ORACLE_SCRIPT), "--serve"], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=log, env=env, text=True, bufsize=1)
        finally:
            log.close()  # the child holds its own descriptor
        # A reader thread turns stdout into a queue, so a request can wait with a timeout.
        self._lines = queue.Queue()
        proc, lines = self._proc, self._lines

        def pump():
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)  # EOF: the child exited

        threading.Thread(target=pump, daemon=True).start()

    def _stderr_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return "(no oracle log)"

    def close(self) -> None:
        """Stop the subprocess (if started) and remove temp files."""
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                proc.stdin.close()
                proc.wait(timeout=10)
            except Exception:  # stuck or already gone: make sure it is gone
                proc.kill()
                proc.wait()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()

    def __enter__(self) -> "Oracle":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # ------------------------------------------------------------------------------------------------ request
    def request(self, request: dict, timeout: float | None = None) -> dict:
        """Send one request; return the oracle's JSON answer (raises OracleError unless ok)."""
        timeout = self.timeout if timeout is None else timeout
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            try:
                self._proc.stdin.write(json.dumps(request, default=_json_default) + "\n")
                self._proc.stdin.flush()
            except (BrokenPipeError, OSError) as e:
                self._kill()
                raise OracleError(f"oracle died: {e}\n--- oracle stderr ---\n{self._stderr_tail()}") from e
            try:
                line = self._lines.get(timeout=timeout)
            except queue.Empty:
                self._kill()
                raise OracleError(f"oracle timed out after {timeout} s (killed)\n"
                                  f"--- oracle stderr ---\n{self._stderr_tail()}") from None
            if line is None:
                self._kill()
                raise OracleError(f"oracle exited\n--- oracle stderr ---\n{self._stderr_tail()}")
        resp = json.loads(line)
        if not resp.get("ok"):
            raise OracleError(f"oracle request failed:\n{resp.get('error')}")
        return resp

    def run(self, request: dict, timeout: float | None = None) -> dict[str, np.ndarray]:
        """Run a request; return its outputs as {npz key: array}. A temp npz is used unless `out` is given."""
        request = dict(request)
        temp = "out" not in request
        if temp:
            request["out"] = os.path.join(self._tmp, f"{uuid.uuid4().hex}.npz")
        resp = self.request(request, timeout)
        with np.load(resp["out"]) as npz:
            arrays = {k: npz[k] for k in npz.files}
        if temp:
            os.remove(resp["out"])
        return arrays


def require_oracle() -> Oracle | None:
    """An (unstarted) Oracle if installed; else None so the caller can skip, with Oracle.unavailable_reason().

    With K2JAX_REQUIRE_ORACLE=1 a missing oracle raises OracleError instead: CI must fail, not skip.
    """
    if Oracle.available():
        return Oracle()
    if os.environ.get("K2JAX_REQUIRE_ORACLE") == "1":
        raise OracleError(Oracle.unavailable_reason() + " and K2JAX_REQUIRE_ORACLE=1")
    return None
