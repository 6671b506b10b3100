"""tests/run_files.py, the suite's runner: each file in a fresh process, a crash named with its file and
signal, pytest's "no tests collected" kept apart from a failure."""

import os
import subprocess
import sys

from tests.conftest import REPO

RUNNER = REPO / "tests" / "run_files.py"

PASSES = "def test_a():\n    assert 1 + 1 == 2\n\ndef test_b():\n    pass\n"
FAILS = "def test_fails():\n    assert 1 == 2\n"
CRASHES = "import os, signal\n\ndef test_crashes():\n    os.kill(os.getpid(), signal.SIGSEGV)\n"
# the process's own id: a second file that sees the first one's means the two shared a process
PID = "import os, pathlib\n\ndef test_pid(tmp_path):\n    pathlib.Path(os.environ['PIDS'], __name__).write_text(str(os.getpid()))\n"


def _run(tmp_path, *args, workers="2"):
    env = dict(os.environ, K2JAX_TEST_WORKERS=workers, K2JAX_TEST_TIMES=str(tmp_path / "times.json"),
               PIDS=str(tmp_path / "pids"))
    env.pop("PYTEST_XDIST_WORKER", None)
    return subprocess.run([sys.executable, str(RUNNER), *map(str, args)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


def _files(tmp_path, **sources):
    d = tmp_path / "t"
    d.mkdir()
    (tmp_path / "pids").mkdir()
    for name, text in sources.items():
        (d / f"test_{name}.py").write_text(text)
    return d


def test_a_crash_is_named_and_the_other_files_still_run(tmp_path):
    d = _files(tmp_path, ok=PASSES, boom=CRASHES, bad=FAILS, p1=PID, p2=PID)
    r = _run(tmp_path, d)
    out = r.stdout
    assert r.returncode == 1, out
    assert "crashed (SIGSEGV)" in out and f"FAILED {d / 'test_boom.py'}: crashed (SIGSEGV)" in out, out
    assert f"FAILED {d / 'test_bad.py'}: failed" in out and "assert 1 == 2" in out, out
    assert f"passed  {d / 'test_ok.py'}: 2 passed, 0 failed" in out, out
    assert "4 passed, 2 failed, 0 skipped, 5 files" in out, out
    pids = {p.read_text() for p in (tmp_path / "pids").iterdir()}
    assert len(pids) == 2  # test_p1 and test_p2 each in a process of its own
    times = (tmp_path / "times.json").read_text()
    assert "test_ok.py" in times and "test_boom.py" not in times  # a crashed file's time is not kept


def test_pytest_arguments_choose_files_and_tests(tmp_path):
    d = _files(tmp_path, ok=PASSES, bad=FAILS)
    r = _run(tmp_path, f"{d / 'test_ok.py'}::test_a", "-k", "test_a")
    assert r.returncode == 0, r.stdout
    assert "1 passed, 0 failed, 0 skipped, 1 files" in r.stdout, r.stdout
    # a selection that leaves nothing to run is pytest's exit 5, not a pass
    r = _run(tmp_path, d / "test_ok.py", "-k", "no_such_test")
    assert r.returncode == 5, r.stdout
    # K2JAX_TEST_WORKERS=0: one plain pytest, whose status is the runner's
    r = _run(tmp_path, d / "test_bad.py", workers="0")
    assert r.returncode == 1 and "assert 1 == 2" in r.stdout, r.stdout
