"""Where a HuggingFace checkpoint's files are: a local directory, a `gs://` prefix, or a Hugging Face Hub repo id
(`moonshotai/Kimi-K2-Instruct`). `open_source(location)` -> a FileSource (see safetensors_io.LocalFiles for the
interface) that `Checkpoint` opens, plus the parsed config.json.

- gs://: every read is a ranged read of the object through gcsfs: headers on open, then only the tensors
  (or rows of them) asked for; nothing is downloaded whole.
- a Hub repo: config.json and the index are fetched at once; `fetch(files)` downloads the safetensors files
  named (huggingface_hub: the shared HF cache, one progress display of files and bytes) and checks each
  against the sha256 the Hub lists for it; the headers of files not fetched are read with ranged requests
  (huggingface_hub's HfFileSystem), so a host that converts some layers downloads only the files that hold
  them and still verifies every header.
"""

from __future__ import annotations

import json
import os
import pathlib

from k2jax.checkpoint import storage
from k2jax.checkpoint.safetensors_io import INDEX_NAME, SINGLE_NAME, LocalFiles, RemoteSafetensorsFile, parse_index


class GcsFiles:
    """The files under a gs:// prefix (FileSource)."""

    def __init__(self, url: str):
        storage.configure_gcs()
        self.url = storage.location(url).rstrip("/")
        self.bucket, self.prefix = storage.split_gcs(self.url)
        storage.check_credentials(self.url)
        self.fs = storage.gcs_fs()
        try:
            listing = self.fs.ls(self._key(""), detail=True, refresh=True) if self.prefix else \
                self.fs.ls(self.bucket, detail=True, refresh=True)
        except FileNotFoundError:
            listing = []
        except Exception as e:  # noqa: BLE001
            raise storage.gcs_error(self.url, e, "prefix") from None
        # {file name: size} of the objects directly under the prefix
        self.sizes = {item["name"].rsplit("/", 1)[-1]: int(item.get("size") or 0) for item in listing
                      if item.get("type") == "file"}
        if not self.sizes:
            err = FileNotFoundError(f"{self.url}: no such object or prefix")
            if not storage.bucket_exists(self.bucket):
                err = FileNotFoundError(f"{self.url}: no such bucket gs://{self.bucket}")
            raise err

    def __str__(self) -> str:
        return self.url

    def _key(self, f: str) -> str:
        return "/".join(p for p in (self.bucket, self.prefix, f) if p)

    def name(self, f: str) -> str:
        return f"{self.url}/{f}"

    def exists(self, f: str) -> bool:
        return f in self.sizes

    def read(self, f: str) -> bytes:
        try:
            return self.fs.cat_file(self._key(f))
        except Exception as e:  # noqa: BLE001
            raise storage.gcs_error(self.name(f), e) from None

    def open(self, f: str, direct: bool = False) -> RemoteSafetensorsFile:
        name = self.name(f)
        return RemoteSafetensorsFile(self.fs, self._key(f), name, self.sizes.get(f),
                                     errors=lambda e: storage.gcs_error(name, e))

    def fetch(self, files) -> None:
        """Nothing to fetch: tensors are read where they are."""


def open_source(location, revision: str | None = None, quiet: bool = False):
    """-> (FileSource, config.json as a dict) for a local directory, a gs:// URL or a Hub repo id. A missing
    location is a FileNotFoundError naming it; `revision` (a branch, tag or commit) only for a repo id."""
    loc = storage.location(location)
    if storage.is_gcs(loc):
        files = GcsFiles(loc)
    elif os.path.exists(loc):
        if not os.path.isdir(loc):
            raise NotADirectoryError(f"{loc}: not a directory (expected a HuggingFace checkpoint directory)")
        files = LocalFiles(loc)
    else:
        from k2jax.checkpoint import hub

        if not hub.is_repo_id(loc):
            raise FileNotFoundError(f"{loc}: no such file or directory (nor a gs:// URL or a Hugging Face repo id "
                                    f"like moonshotai/Kimi-K2-Instruct)")
        files = hub.HubFiles(loc, revision, quiet=quiet)
    if revision is not None and not hasattr(files, "repo_id"):
        raise ValueError(f"--revision {revision!r}: only for a Hugging Face repo id, not {loc}")
    return files, read_config(files)


def read_config(files) -> dict:
    """config.json of a FileSource, parsed; errors name the file."""
    where = files.name("config.json")
    if not files.exists("config.json"):
        raise FileNotFoundError(f"no config.json at {where}")
    try:
        raw = json.loads(files.read("config.json"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a JSON object")
    return raw


def config_from(raw: dict, where: str):
    """K2Config of a parsed config.json; its errors name `where` (the file) instead of 'config'."""
    from k2jax.config import K2Config

    try:
        return K2Config.from_hf_config(raw)
    except ValueError as e:
        msg = str(e)
        raise ValueError(where + msg[len("config"):] if msg.startswith("config:") else f"{where}: {msg}") from None


def load_config(location):
    """K2Config of a config.json at a local path (file or directory), a gs:// URL (the file or its directory) or
    in a Hugging Face repo (its id)."""
    from k2jax.config import K2Config

    loc = storage.location(location)
    if not storage.is_gcs(loc):
        from k2jax.checkpoint import hub

        if not os.path.exists(loc) and hub.is_repo_id(loc):
            files = hub.HubFiles(loc, quiet=True)
            return config_from(read_config(files), files.name("config.json"))
        return K2Config.from_hf_config(loc)
    if loc.endswith(".json"):
        d = storage.open_dir(loc.rsplit("/", 1)[0])
        name = loc.rsplit("/", 1)[1]
    else:
        d, name = storage.open_dir(loc), "config.json"
    raw = d.read(name)
    if raw is None:
        raise FileNotFoundError(f"no {name} at {d.name(name)}")
    try:
        parsed = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{d.name(name)}: not valid JSON: {e}") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"{d.name(name)}: expected a JSON object")
    return config_from(parsed, d.name(name))


def weight_map(files) -> dict[str, str] | None:
    """The index's {tensor: file} of a FileSource (None for a single model.safetensors)."""
    if not files.exists(INDEX_NAME):
        return None
    return parse_index(files.read(INDEX_NAME), files.name(INDEX_NAME))


def safetensors_files(files) -> list[str]:
    wm = weight_map(files)
    return [SINGLE_NAME] if wm is None else sorted(set(wm.values()))


def local_path(files) -> pathlib.Path | None:
    """The local directory of a FileSource that has one (a local checkpoint)."""
    return files.root if isinstance(files, LocalFiles) else None
