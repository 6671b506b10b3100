"""Where checkpoints live: a local directory or a `gs://bucket/prefix` URL (Google Cloud Storage).

Two clients, each the library made for its job: tensorstore's `gcs` kvstore for the converted (Orbax) checkpoint
(the converter's chunks and markers, and, under Orbax, the restore), and gcsfs for byte ranges of the released
safetensors (`k2jax.checkpoint.safetensors_io.RemoteSafetensorsFile`). Both find credentials the same way:
Google application-default credentials when there are any (GOOGLE_APPLICATION_CREDENTIALS, `gcloud auth
application-default login`, a TPU VM's service account), anonymous otherwise (public buckets).

An emulator (tests, local development) is reached through the documented settings: STORAGE_EMULATOR_HOST for the
client libraries, which k2jax also hands to tensorstore (TENSORSTORE_GCS_HTTP_URL) unless that is set itself.

`open_dir(path)` -> a `LocalDir` or `GcsDir`: the few operations a checkpoint directory needs (read, write whole
objects atomically, list, delete), so the converter's resume markers and the manifest, written last, work alike on
both. A GCS object is whole or absent, so a write there is atomic as it stands.
"""

from __future__ import annotations

import functools
import os
import pathlib
import re

GCS_SCHEME = "gs://"
_BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]")


def location(path: str | os.PathLike) -> str:
    """A path as given: a `gs://` URL stays one (pathlib would have folded it to 'gs:/...')."""
    s = os.fspath(path)
    if s.startswith("gs:/") and not s.startswith(GCS_SCHEME) and not os.path.exists(s):
        s = GCS_SCHEME + s[len("gs:/"):]
    return s


def is_gcs(path) -> bool:
    return isinstance(path, (str, os.PathLike)) and location(path).startswith(GCS_SCHEME)


def split_gcs(url: str) -> tuple[str, str]:
    """'gs://bucket/a/b' -> ('bucket', 'a/b'); a ValueError naming the URL if the bucket name is not one."""
    rest = location(url)[len(GCS_SCHEME):]
    bucket, _, key = rest.partition("/")
    if not _BUCKET.fullmatch(bucket):
        raise ValueError(f"{url}: not a gs://BUCKET/PATH URL ({bucket!r} is not a bucket name)")
    return bucket, key.strip("/")


def configure_gcs() -> None:
    """Point tensorstore and gcsfs at the emulator of STORAGE_EMULATOR_HOST, if one is set (before either
    first talks to GCS: both read their settings once)."""
    emulator = os.environ.get("STORAGE_EMULATOR_HOST")
    if emulator:
        if "://" not in emulator:
            emulator = "http://" + emulator
        os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", emulator)
        # gcsfs's default class first asks GCS's control plane (gRPC) for the bucket's layout, which an
        # emulator does not serve (a minute's timeout per call): the plain JSON API is all we use.
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


@functools.lru_cache(maxsize=1)
def gcs_fs():
    """The gcsfs filesystem (one per process; thread-safe: its calls run on gcsfs's own event loop)."""
    configure_gcs()
    try:
        from gcsfs.core import GCSFileSystem  # the JSON API client, without the gRPC bucket-layout probe
    except ImportError as e:  # pragma: no cover - a base install has it
        raise ImportError("gs:// paths need gcsfs: pip install gcsfs") from e
    token = "anon" if os.environ.get("STORAGE_EMULATOR_HOST") else None
    return GCSFileSystem(token=token)


def credentials_hint() -> str:
    """Why a GCS request may have been refused, and what to do about it."""
    path = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
    if path and not os.path.isfile(path):
        return f"GOOGLE_APPLICATION_CREDENTIALS={path} names no file"
    adc = pathlib.Path(os.environ.get("CLOUDSDK_CONFIG") or pathlib.Path.home() / ".config" / "gcloud")
    if not path and not (adc / "application_default_credentials.json").is_file():
        return ("no Google Cloud credentials were found (requests went anonymous): run `gcloud auth "
                "application-default login`, or set GOOGLE_APPLICATION_CREDENTIALS to a service account key; on a "
                "TPU VM, check its service account's storage scope")
    return "the credentials in use lack access to it (roles/storage.objectViewer to read, objectAdmin to write)"


def check_credentials(url: str) -> None:
    """Refuse a credentials file setting that names no file before any request (else the clients would
    silently go anonymous and the bucket would seem to refuse access)."""
    path = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
    if path and not os.path.isfile(path):
        raise PermissionError(f"{url}: GOOGLE_APPLICATION_CREDENTIALS={path} names no file: point it at a service "
                              f"account key, or unset it to use `gcloud auth application-default login`")


def gcs_error(url: str, e: BaseException, what: str = "object") -> OSError:
    """A client library's error about `url` -> an OSError whose message names the URL and the cause."""
    text = str(e)
    code = getattr(e, "code", None)
    if isinstance(e, FileNotFoundError) or code == 404 or "NOT_FOUND" in text or "404" in text.split("]")[0]:
        bucket = split_gcs(url)[0]
        if not bucket_exists(bucket):
            return FileNotFoundError(f"{url}: no such bucket gs://{bucket}")
        return FileNotFoundError(f"{url}: no such {what}")
    if code in (401, 403) or "PERMISSION_DENIED" in text or "UNAUTHENTICATED" in text or \
            re.search(r"\b40[13]\b", text):
        return PermissionError(f"{url}: access refused: {credentials_hint()}")
    first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
    return OSError(f"{url}: {re.sub(r'\s*\[source locations=.*', '', first)}")


def bucket_exists(bucket: str) -> bool:
    """Whether the bucket exists (True when we may not ask: the error then is about the object)."""
    try:
        return bool(gcs_fs().exists(bucket))
    except Exception:  # noqa: BLE001 - e.g. no storage.buckets.get permission
        return True


# ------------------------------------------------------------------------------------------------------
class LocalDir:
    """A local directory (see the module doc): writes are write, fsync, rename."""

    remote = False

    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path)

    def __str__(self) -> str:
        return str(self.path)

    def name(self, rel: str = "") -> str:
        """What messages call the file `rel` (relative to this directory)."""
        return str(self.path / rel) if rel else str(self.path)

    def exists(self) -> bool:
        return self.path.exists()

    def read(self, rel: str) -> bytes | None:
        """The file's bytes, None if there is none."""
        try:
            return (self.path / rel).read_bytes()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None

    def write(self, rel: str, data: bytes) -> None:
        """Write, fsync, rename: a reader sees the old file or the whole new one, never a part. (The temporary
        name is this process's own: processes sharing a filesystem may write the same file.)"""
        path = self.path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def keys(self, prefix: str = "") -> list[str]:
        """Files under `prefix` (a directory relative to this one), as paths relative to this directory."""
        root = self.path / prefix if prefix else self.path
        if not root.is_dir():
            return []
        return sorted(str(p.relative_to(self.path)) for p in root.rglob("*") if p.is_file())

    def any(self, prefix: str = "") -> bool:
        root = self.path / prefix if prefix else self.path
        return root.is_dir() and any(root.iterdir())

    def remove(self, rel: str) -> None:
        """Delete one file (if it is there)."""
        (self.path / rel).unlink(missing_ok=True)

    def delete(self, prefix: str = "") -> None:
        """Delete everything under `prefix` (all of the directory when empty)."""
        import shutil

        shutil.rmtree(self.path / prefix if prefix else self.path, ignore_errors=True)

    def kvstore(self, rel: str = "") -> dict:
        """The tensorstore kvstore spec of a subdirectory."""
        return {"driver": "file", "path": os.fspath(self.path / rel) + "/"}

    def orbax_path(self):
        return os.path.abspath(self.path)


class GcsDir:
    """A `gs://bucket/prefix` "directory" (see the module doc) through tensorstore's gcs kvstore."""

    remote = True

    def __init__(self, url: str):
        configure_gcs()
        self.url = location(url).rstrip("/")
        self.bucket, self.prefix = split_gcs(self.url)
        check_credentials(self.url)
        self._kv = None

    def __str__(self) -> str:
        return self.url

    def name(self, rel: str = "") -> str:
        return f"{self.url}/{rel}" if rel else self.url

    @property
    def kv(self):
        if self._kv is None:
            import tensorstore as ts

            self._kv = ts.KvStore.open(self.kvstore()).result()
        return self._kv

    def kvstore(self, rel: str = "") -> dict:
        path = "/".join(p for p in (self.prefix, rel) if p)
        return {"driver": "gcs", "bucket": self.bucket, "path": path + "/" if path else ""}

    def _call(self, rel: str, fn, what: str = "object"):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - tensorstore raises ValueError / OSError with a status text
            raise gcs_error(self.name(rel), e, what) from None

    def exists(self) -> bool:
        return self.any()

    def read(self, rel: str) -> bytes | None:
        r = self._call(rel, lambda: self.kv.read(rel).result())
        return bytes(r.value) if r.state == "value" else None

    def write(self, rel: str, data: bytes) -> None:
        self._call(rel, lambda: self.kv.write(rel, data).result())

    def _path(self, rel: str = "") -> str:
        return "/".join(p for p in (self.bucket, self.prefix, rel.strip("/")) if p)

    def keys(self, prefix: str = "") -> list[str]:
        # Listing and deleting by prefix go through gcsfs (the JSON API's `prefix`), which every server and
        # emulator serves; tensorstore lists a key range (startOffset / endOffset), which emulators ignore.
        root = self._path()
        try:
            found = gcs_fs().find(self._path(prefix), refresh=True) if (prefix or self.prefix) else \
                gcs_fs().find(self.bucket, refresh=True)
        except FileNotFoundError:
            return []
        except Exception as e:  # noqa: BLE001
            raise gcs_error(self.name(prefix), e, "prefix") from None
        return sorted(k[len(root) + 1:] for k in found if k.startswith(root + "/"))

    def any(self, prefix: str = "") -> bool:
        return bool(self.keys(prefix))

    def remove(self, rel: str) -> None:
        self._call(rel, lambda: self.kv.delete_range(_key_range(rel)).result())

    def delete(self, prefix: str = "") -> None:
        keys = self.keys(prefix)
        if keys:  # (gcsfs deletes in batches)
            self._call(prefix, lambda: gcs_fs().rm([self._path(k) for k in keys]), "prefix")

    def orbax_path(self):
        from etils import epath

        configure_gcs()
        return epath.Path(self.url)


def _key_range(key: str):
    """The tensorstore key range of exactly one key."""
    import tensorstore as ts

    return ts.KvStore.KeyRange(key, key + "\0")


def open_dir(path) -> LocalDir | GcsDir:
    """The checkpoint directory at a local path or gs:// URL (a LocalDir or GcsDir passes through)."""
    if isinstance(path, (LocalDir, GcsDir)):
        return path
    return GcsDir(location(path)) if is_gcs(path) else LocalDir(path)
