"""Run the test files each in a fresh pytest process, a few at a time: python tests/run_files.py [PYTEST ARGS]

XLA:CPU workaround. Under pytest-xdist, a worker runs file after file in one process, and in four full runs a
worker died in native code (a segfault, in XLA:CPU's compiler or in jax's persistent compilation cache) on a
test that had passed alone every time: three times test_train_masks' one-device training step, once
test_multihost's generate on 8 simulated devices, each after the worker's earlier files. A fresh process per
file gives every file the state it has when run alone, and a crash names its file and signal rather than
ending the whole run.

Arguments are pytest's. Paths among them (a file, a folder, or FILE::TEST) choose the files; without any, every
tests/test_*.py. The other arguments go to each file's pytest. K2JAX_TEST_WORKERS sets how many files run at
once (default 2; 0 runs one plain pytest in this process's child, all files together). Files start longest
first, by their times in K2JAX_TEST_TIMES (a JSON file this script keeps) when it is set. A file that runs past
K2JAX_TEST_FILE_TIMEOUT seconds (default 1800) is stopped with its process group and counts as failed.

Exit status: 0 when every file passed, 5 when no file had a test to run (pytest's "no tests collected"),
1 otherwise.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET

TESTS = pathlib.Path(__file__).resolve().parent
TAIL_LINES = 400  # of a failed file's output


def targets(args: list[str]) -> tuple[dict[str, list[str]], list[str]]:
    """Split pytest's arguments into {test file: its targets} and the rest. A file named whole is its own
    target; FILE::TEST targets only those tests."""
    files: dict[str, list[str]] = {}
    rest = []
    for a in args:
        path = pathlib.Path(a.split("::", 1)[0])
        if a.startswith("-") or not path.exists():
            rest.append(a)
        elif path.is_dir():
            for f in sorted(path.rglob("test_*.py")):
                files.setdefault(str(f), []).append(str(f))
        else:
            files.setdefault(str(path), []).append(a)
    if not files:
        cwd = pathlib.Path.cwd()
        for f in sorted(TESTS.glob("test_*.py")):
            name = str(f.relative_to(cwd)) if f.is_relative_to(cwd) else str(f)
            files[name] = [name]
    return files, rest


def counts(xml_path: pathlib.Path) -> dict[str, int]:
    """passed, failed, errors, skipped from pytest's junit XML (zeros when it wrote none)."""
    if not xml_path.exists():
        return dict(passed=0, failed=0, errors=0, skipped=0)
    suite = ET.parse(xml_path).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    return dict(passed=n["tests"] - n["failures"] - n["errors"] - n["skipped"], failed=n["failures"],
                errors=n["errors"], skipped=n["skipped"])


def describe(rc: int | None) -> str:
    if rc is None:
        return "timed out"
    if rc < 0:
        try:
            return f"crashed ({signal.Signals(-rc).name})"
        except ValueError:
            return f"crashed (signal {-rc})"
    return {0: "passed", 1: "failed", 5: "nothing selected"}.get(rc, f"exit {rc}")


class Runner:
    def __init__(self, rest: list[str], timeout: float, workdir: pathlib.Path):
        self.rest, self.timeout, self.workdir = rest, timeout, workdir
        self.lock = threading.Lock()
        self.live: set[subprocess.Popen] = set()

    def run(self, file: str, tgts: list[str]) -> dict:
        stem = pathlib.Path(file).stem
        xml, log = self.workdir / f"{stem}.xml", self.workdir / f"{stem}.log"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *self.rest,
               *tgts]
        start = time.monotonic()
        with open(log, "wb") as out:
            # a session of its own: a stop takes the servers and workers the tests started with it
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            with self.lock:
                self.live.add(proc)
            try:
                rc = proc.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                stop(proc)
                rc = None
            finally:
                with self.lock:
                    self.live.discard(proc)
        return dict(file=file, rc=rc, seconds=time.monotonic() - start, log=log, **counts(xml))

    def stop_all(self) -> None:
        with self.lock:
            for proc in list(self.live):
                stop(proc)


def stop(proc: subprocess.Popen) -> None:
    """End a file's pytest and everything it started (its process group)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def load_times(path: str | None) -> dict[str, float]:
    try:
        return json.loads(pathlib.Path(path).read_text()) if path else {}
    except (OSError, ValueError):
        return {}


def save_times(path: str | None, times: dict[str, float]) -> None:
    """Written whole to a temporary file and renamed: a run stopped midway leaves the old times."""
    if not path:
        return
    p = pathlib.Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(times, indent=0, sort_keys=True))
    tmp.replace(p)


def main(args: list[str]) -> int:
    workers = int(os.environ.get("K2JAX_TEST_WORKERS", "2"))
    if workers == 0:
        return subprocess.call([sys.executable, "-m", "pytest", *args])
    files, rest = targets(args)
    times_path = os.environ.get("K2JAX_TEST_TIMES")
    times = load_times(times_path)
    # longest first, so that the last file to start is a short one; a file with no time yet counts as long
    order = sorted(files, key=lambda f: -times.get(f, float("inf")))
    timeout = float(os.environ.get("K2JAX_TEST_FILE_TIMEOUT", "1800"))
    print(f"== {len(order)} test files, each in a fresh process, {workers} at a time", flush=True)

    total = dict(passed=0, failed=0, errors=0, skipped=0)
    bad, nothing, start = [], 0, time.monotonic()
    with tempfile.TemporaryDirectory(prefix="k2jax-tests-") as tmp:
        runner = Runner(rest, timeout, pathlib.Path(tmp))
        pool = concurrent.futures.ThreadPoolExecutor(workers)
        futures = [pool.submit(runner.run, f, files[f]) for f in order]
        try:
            for fut in concurrent.futures.as_completed(futures):
                r = fut.result()
                ok = r["rc"] in (0, 5)
                if not ok and r["failed"] + r["errors"] == 0:
                    r["errors"] = 1  # a crash or a stop before pytest's report: the file counts as one failure
                for k in total:
                    total[k] += r[k]
                nothing += r["rc"] == 5
                if r["rc"] in (0, 1):
                    times[r["file"]] = round(r["seconds"], 1)
                status = describe(r["rc"])
                print(f"{status:>18}  {r['file']}: {r['passed']} passed, {r['failed'] + r['errors']} failed, "
                      f"{r['skipped']} skipped in {r['seconds']:.0f} s", flush=True)
                if not ok:
                    bad.append((r["file"], status))
                    lines = r["log"].read_text(errors="replace").splitlines()
                    print(f"---- {r['file']}: the last {min(len(lines), TAIL_LINES)} lines of its output", flush=True)
                    print("\n".join(lines[-TAIL_LINES:]), flush=True)
                    print(f"---- end of {r['file']}", flush=True)
        except KeyboardInterrupt:
            pool.shutdown(wait=False, cancel_futures=True)
            runner.stop_all()
            print("interrupted", flush=True)
            return 130
        pool.shutdown()
    save_times(times_path, times)

    print(f"== {total['passed']} passed, {total['failed'] + total['errors']} failed, {total['skipped']} skipped, "
          f"{len(order)} files in {time.monotonic() - start:.0f} s", flush=True)
    for file, status in bad:
        print(f"FAILED {file}: {status}", flush=True)
    if bad:
        return 1
    return 5 if nothing == len(order) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
