"""Hugging Face Hub repos as checkpoint and tokenizer sources, through huggingface_hub: the revision resolved to
a commit once (so every file comes from the same commit), downloads into the shared HF cache (HF_HOME,
HF_HUB_CACHE; a file already there is not fetched again), credentials from HF_TOKEN or `huggingface-cli login`,
the endpoint from HF_ENDPOINT. Each downloaded file's sha256 is checked against the one the Hub lists for it
(huggingface_hub itself checks sizes only); a checked file is remembered (by its hash, size and mtime) so a
rerun does not hash it again.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import os
import pathlib
import re
import sys

from k2jax.checkpoint.safetensors_io import RemoteSafetensorsFile, SafetensorsFile

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}")
TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json", "chat_template.jinja")


def is_repo_id(s) -> bool:
    """'owner/name' (not a path that exists here, not a URL)."""
    s = os.fspath(s)
    return bool(_REPO_ID.fullmatch(s)) and ".." not in s and not s.endswith(".json") and not os.path.exists(s)


def endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def hub_error(repo_id: str, revision: str | None, e: BaseException, file: str | None = None) -> Exception:
    """A huggingface_hub error -> one that names the repo (and revision, file) and says what to do."""
    from huggingface_hub import errors

    where = f"{repo_id}" + (f"@{revision}" if revision else "") + (f"/{file}" if file else "")
    if isinstance(e, errors.GatedRepoError):
        return PermissionError(f"{where}: a gated repo: accept its terms on the Hub, then log in "
                               f"(`huggingface-cli login`, or HF_TOKEN) with that account")
    if isinstance(e, errors.RepositoryNotFoundError):
        return FileNotFoundError(f"{repo_id}: no such Hugging Face repo at {endpoint()} (nor a local directory); if it "
                                 f"is private, log in (`huggingface-cli login`, or HF_TOKEN) with an account that can "
                                 f"read it")
    if isinstance(e, errors.RevisionNotFoundError):
        return FileNotFoundError(f"{repo_id}: no revision {revision!r} (a branch, tag or commit of the repo)")
    if isinstance(e, (errors.RemoteEntryNotFoundError, errors.EntryNotFoundError)):
        return FileNotFoundError(f"{where}: no such file in the repo")
    if isinstance(e, errors.OfflineModeIsEnabled):
        return OSError(f"{where}: HF_HUB_OFFLINE is set and the files are not all in the HF cache")
    if isinstance(e, errors.HfHubHTTPError):
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return OSError(f"{where}: the Hub answered {first}")
    return OSError(f"{where}: cannot reach the Hugging Face Hub at {endpoint()}: {type(e).__name__}: {e}")


class HubFiles:
    """A repo at one commit (FileSource, see safetensors_io.LocalFiles): the file list and sizes from the Hub;
    config.json and the index fetched at once; `fetch(files)` downloads safetensors files; `open(f)` reads a
    fetched file from the HF cache and any other for its header only (ranged requests)."""

    def __init__(self, repo_id: str, revision: str | None = None, quiet: bool = False):
        from huggingface_hub import HfApi
        from huggingface_hub.hf_api import RepoFile

        self.repo_id, self.revision, self.quiet = repo_id, revision, quiet
        self.api = HfApi()
        try:
            self.sha = self.api.repo_info(repo_id, revision=revision or "main").sha
            tree = list(self.api.list_repo_tree(repo_id, revision=self.sha, recursive=True))
        except Exception as e:  # noqa: BLE001 - mapped to a message naming the repo
            raise hub_error(repo_id, revision, e) from None
        self.entries = {f.path: f for f in tree if isinstance(f, RepoFile)}
        self.snapshot: pathlib.Path | None = None
        self.fetched: set[str] = set()
        self.fetch([f for f in ("config.json", "model.safetensors.index.json") if f in self.entries])

    def __str__(self) -> str:
        return self.repo_id

    def name(self, f: str) -> str:
        if f in self.fetched and self.snapshot is not None:
            return str(self.snapshot / f)
        return f"{self.repo_id}/{f}"

    def exists(self, f: str) -> bool:
        return f in self.entries

    def read(self, f: str) -> bytes:
        if f not in self.fetched:
            self.fetch([f])
        return (self.snapshot / f).read_bytes()

    def open(self, f: str, direct: bool = False):
        if f in self.fetched:
            return SafetensorsFile(self.snapshot / f, direct)
        from huggingface_hub import HfFileSystem

        name = self.name(f)
        return RemoteSafetensorsFile(_Ranges(HfFileSystem()), f"{self.repo_id}@{self.sha}/{f}", name,
                                     self.entries[f].size, errors=lambda e: hub_error(self.repo_id, self.sha, e, f))

    def fetch(self, files) -> None:
        """Download `files` (at the resolved commit) into the HF cache, then check their sha256."""
        from huggingface_hub import snapshot_download
        from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

        todo = sorted(set(files) - self.fetched)
        if not todo:
            return
        big = [f for f in todo if f.endswith(".safetensors")]
        if big and not self.quiet:
            gb = sum(self.entries[f].size for f in big) / 1e9
            print(f"{self.repo_id}@{self.sha[:12]}: fetching {len(big)} file(s), {gb:.2f} GB, into the HF cache",
                  file=sys.stderr)
        if self.quiet or not big:
            disable_progress_bars()
        try:
            snap = snapshot_download(self.repo_id, revision=self.sha, allow_patterns=todo)
        except Exception as e:  # noqa: BLE001
            raise hub_error(self.repo_id, self.revision, e) from None
        finally:
            if self.quiet or not big:
                enable_progress_bars()
        self.snapshot = pathlib.Path(snap)
        verify_hashes(self.snapshot, {f: self.entries[f] for f in todo}, self.quiet)
        self.fetched |= set(todo)


class _Ranges:
    """`cat_file(path, start, end)` on HfFileSystem reading exactly [start, end) (one ranged request, no
    read-ahead: a header read must not pull megabytes of tensor data with it)."""

    def __init__(self, fs):
        self.fs = fs

    def cat_file(self, path: str, start: int, end: int) -> bytes:
        with self.fs.open(path, "rb", block_size=max(1, end - start), cache_type="none") as f:
            f.seek(start)
            return f.read(end - start)

    def size(self, path: str) -> int:
        return self.fs.size(path)


def _stamp_dir() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "k2jax" / "hub-verified"


def verify_hashes(root: pathlib.Path, entries: dict, quiet: bool) -> None:
    """Check each LFS file's sha256 against the Hub's (on `workers` threads: hashlib runs without the GIL);
    an OSError naming every file that differs (its cached copy is removed, so a rerun fetches it again)."""
    todo = []
    for f, e in entries.items():
        sha = getattr(getattr(e, "lfs", None), "sha256", None)
        if sha is None:
            continue  # a small git file: git's own object id, checked by the Hub's ETag
        path = root / f
        st = path.stat()
        stamp = _stamp_dir() / sha
        if stamp.is_file() and stamp.read_text() == f"{st.st_size} {st.st_mtime_ns}":
            continue
        todo.append((f, path, sha, stamp, st))
    if not todo:
        return
    from tqdm import tqdm

    bar = tqdm(total=sum(t[4].st_size for t in todo), unit="B", unit_scale=True, desc="sha256", disable=quiet,
               dynamic_ncols=True)

    def check(item):
        f, path, sha, stamp, st = item
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            while chunk := fh.read(16 << 20):
                h.update(chunk)
                bar.update(len(chunk))
        if h.hexdigest() != sha:
            return f"{f}: sha256 {h.hexdigest()}, the Hub lists {sha}"
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.write_text(f"{st.st_size} {st.st_mtime_ns}")
        return None

    with bar, cf.ThreadPoolExecutor(min(len(todo), os.cpu_count() or 1)) as pool:
        bad = [b for b in pool.map(check, todo) if b]
    if bad:
        for f, path, *_ in todo:
            if any(b.startswith(f + ":") for b in bad):
                real = path.resolve()
                path.unlink(missing_ok=True)
                real.unlink(missing_ok=True)
        raise OSError(f"{root}: {len(bad)} downloaded file(s) differ from the Hub's (removed from the HF cache; rerun "
                      f"to fetch them again):\n  - " + "\n  - ".join(bad))


def fetch_small(repo_id: str, names, revision: str | None = None) -> pathlib.Path:
    """The directory (in the HF cache) holding those of `names` the repo has: e.g. a tokenizer's files."""
    files = HubFiles(repo_id, revision, quiet=True)
    files.fetch([n for n in names if files.exists(n)])
    if files.snapshot is None:
        raise FileNotFoundError(f"{repo_id}: none of {', '.join(names)} in the repo")
    return files.snapshot
