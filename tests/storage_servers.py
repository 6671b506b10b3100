"""Real servers for the storage tests, all on 127.0.0.1 and started by the tests, nothing reached outside:

- `emulator()`: a GCS emulator (gcp-storage-emulator, a subprocess, in memory), one per test process: tensorstore
  reads its endpoint setting once per process, so every test in a process talks to the same one. Reached through
  a `Proxy`, which passes every request on and records it (method, object, Range, bytes returned), and can
  refuse anonymous requests to some buckets (as GCS refuses them for a private bucket).
- `HubStub`: a Hugging Face Hub endpoint serving repos made of local directories, with the API calls
  huggingface_hub makes for ours: revision info (`/api/models/{repo}/revision/{rev}`), the tree listing,
  `paths-info`, and `/{repo}/resolve/{rev}/{file}` (HEAD and GET, ETag / X-Repo-Commit / X-Linked-* headers,
  Range); unknown repos, revisions and files answer with the Hub's error codes; a private repo wants a token.
"""

from __future__ import annotations

import atexit
import hashlib
import http.client
import http.server
import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.parse

from tests.processes import free_port

BUCKET = "k2jax-test"



class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True


def _serve(handler_cls) -> tuple[_Server, str]:
    srv = _Server(("127.0.0.1", 0), handler_cls)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


# ------------------------------------------------------------------------------------------------------
class Proxy:
    """An HTTP proxy in front of `upstream`: `log` holds (method, bucket, object, Range header, bytes sent) for
    every request; buckets in `private` answer 401 to a request without an Authorization header."""

    def __init__(self, upstream: str, private: set[str] = frozenset()):
        self.upstream = urllib.parse.urlparse(upstream)
        self.private, self.log, self.lock = set(private), [], threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _forward(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                bucket, obj = _gcs_object(self.path)
                if bucket in proxy.private and "authorization" not in {k.lower() for k in self.headers}:
                    msg = json.dumps({"error": {"code": 401, "message": "Anonymous caller does not have "
                                                                        "storage.objects.get access"}}).encode()
                    self.send_response(401)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                conn.request(self.command, self.path, body=body or None, headers=headers)
                r = conn.getresponse()
                data = r.read()
                with proxy.lock:
                    proxy.log.append((self.command, bucket, obj, self.headers.get("Range"), len(data)))
                self.send_response(r.status)
                for k, v in r.getheaders():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _forward

        self.server, self.url = _serve(Handler)

    def reads(self, bucket: str | None = None) -> list[tuple]:
        """(object, Range, bytes) of every media GET (a read of an object's data)."""
        with self.lock:
            return [(o, rng, n) for m, b, o, rng, n in self.log if m == "GET" and o is not None and
                    (bucket is None or b == bucket)]

    def clear(self) -> None:
        with self.lock:
            self.log.clear()

    def close(self) -> None:
        self.server.shutdown()


def _gcs_object(path: str) -> tuple[str | None, str | None]:
    """(bucket, object) of a JSON API request path; object None for anything but an object's data (alt=media,
    or the /download/ form)."""
    u = urllib.parse.urlparse(path)
    m = re.match(r"^(?:/download)?/storage/v1/b/([^/]+)(?:/o/(.+))?$", u.path)
    if not m:
        return None, None
    media = "alt=media" in u.query
    return m.group(1), (urllib.parse.unquote(m.group(2)) if m.group(2) and media else None)


_EMULATOR: dict = {}


def emulator() -> tuple[str, Proxy]:
    """(the emulator's own URL, the proxy in front of it) for this process: started once, with a bucket
    BUCKET, stopped at exit."""
    if not _EMULATOR:
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1",
                                 "--port", str(port), "--in-memory", "--default-bucket", BUCKET, "--quiet"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        atexit.register(lambda: (proc.kill(), proc.wait()))
        url = f"http://127.0.0.1:{port}"
        for _ in range(200):
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError("the GCS emulator did not start")
                time.sleep(0.1)
        proxy = Proxy(url)
        _EMULATOR.update(url=url, proxy=proxy, proc=proc)
    return _EMULATOR["url"], _EMULATOR["proxy"]


def gcs_env(url: str) -> dict:
    """The settings that point gcsfs (STORAGE_EMULATOR_HOST) and tensorstore (its own) at `url`; no credentials
    are looked for (HOME-independent: NO_GCE_CHECK, no GOOGLE_APPLICATION_CREDENTIALS)."""
    return {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
            "NO_GCE_CHECK": "true"}


def upload(local: pathlib.Path, url: str) -> str:
    """Copy a local directory to gs://BUCKET/... (through gcsfs); -> the URL."""
    from k2jax.checkpoint.storage import gcs_fs

    fs = gcs_fs()
    for p in sorted(local.rglob("*")):
        if p.is_file():
            fs.pipe_file(f"{url[5:]}/{p.relative_to(local)}", p.read_bytes())
    return url


def download(url: str) -> dict[str, bytes]:
    """Every object under a gs:// prefix: {relative name: bytes}."""
    from k2jax.checkpoint.storage import gcs_fs

    fs = gcs_fs()
    root = url[5:].rstrip("/")
    return {k[len(root) + 1:]: fs.cat_file(k) for k in fs.find(root, refresh=True)}


# ------------------------------------------------------------------------------------------------------
class HubStub:
    """A Hugging Face Hub endpoint (see the module doc) for `repos`: {repo id: {revision name: directory}}; a
    revision is also reachable by its commit (sha1 of repo and name). `private`: repos that answer 401 without
    `Authorization: Bearer <token>`. `lie`: {(repo, file): sha256} listed instead of the file's own.
    `log` records (method, repo, file, Range) of every file request."""

    def __init__(self, repos: dict[str, dict[str, pathlib.Path]], private=(), token: str = "hf_test_token",
                 lie: dict | None = None):
        self.repos, self.private, self.token, self.lie = repos, set(private), token, dict(lie or {})
        self.log, self.lock, self._meta = [], threading.Lock(), {}
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _send(self, status, body=b"", headers=None, head=False):
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _error(self, status, code, head=False):
                body = json.dumps({"error": code}).encode()
                self._send(status, body, {"X-Error-Code": code, "X-Error-Message": code,
                                          "Content-Type": "application/json"}, head)

            def _handle(self, head=False):
                if self.command == "POST":
                    self.rfile.read(int(self.headers.get("Content-Length") or 0))
                u = urllib.parse.urlparse(self.path)
                path = urllib.parse.unquote(u.path)
                m = (re.match(r"^/api/models/([^/]+/[^/]+)/(revision|tree|paths-info)/([^/]+)(?:/(.*))?$", path)
                     or re.match(r"^/([^/]+/[^/]+)/(resolve)/([^/]+)/(.+)$", path))
                if not m:
                    return self._error(404, "NotFound", head)
                repo, kind, rev, rest = m.groups()
                if repo not in stub.repos:
                    return self._error(404, "RepoNotFound", head)
                if repo in stub.private and self.headers.get("Authorization") != f"Bearer {stub.token}":
                    return self._error(401, "RepoNotFound", head)
                sha, root = stub.resolve(repo, rev)
                if sha is None:
                    return self._error(404, "RevisionNotFound", head)
                if kind == "revision":
                    info = {"id": repo, "modelId": repo, "sha": sha, "private": repo in stub.private,
                            "siblings": [{"rfilename": f} for f in stub.files(root)], "tags": [], "downloads": 0,
                            "likes": 0, "lastModified": "2025-01-01T00:00:00.000Z"}
                    return self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, head)
                if kind in ("tree", "paths-info"):
                    entries = [stub.entry(repo, root, f) for f in stub.files(root)
                               if kind == "paths-info" or not rest or f.startswith(rest.rstrip("/") + "/")]
                    return self._send(200, json.dumps(entries).encode(), {"Content-Type": "application/json"}, head)
                f = root / rest
                if not f.is_file():
                    return self._error(404, "EntryNotFound", head)
                data = f.read_bytes()
                e = stub.entry(repo, root, rest)
                etag = e["lfs"]["oid"] if "lfs" in e else e["oid"]
                hdrs = {"X-Repo-Commit": sha, "ETag": f'"{etag}"', "Accept-Ranges": "bytes",
                        "Content-Type": "application/octet-stream"}
                if "lfs" in e:
                    hdrs |= {"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(data))}
                rng = self.headers.get("Range")
                with stub.lock:
                    stub.log.append((self.command, repo, rest, rng))
                status = 200
                if rng:
                    a, b = re.match(r"bytes=(\d+)-(\d*)", rng).groups()
                    a, b = int(a), min(int(b) + 1 if b else len(data), len(data))
                    if a >= len(data):
                        return self._send(416, b"", hdrs | {"Content-Range": f"bytes */{len(data)}"}, head)
                    hdrs["Content-Range"] = f"bytes {a}-{b - 1}/{len(data)}"
                    data, status = data[a:b], 206
                self._send(status, data, hdrs, head)

            def do_GET(self):
                self._handle()

            def do_POST(self):
                self._handle()

            def do_HEAD(self):
                self._handle(head=True)

        self.server, self.url = _serve(Handler)

    def resolve(self, repo: str, rev: str):
        for name, root in self.repos[repo].items():
            if rev in (name, self.sha(repo, name)):
                return self.sha(repo, name), root
        return None, None

    @staticmethod
    def sha(repo: str, name: str) -> str:
        return hashlib.sha1(f"{repo}@{name}".encode()).hexdigest()

    @staticmethod
    def files(root: pathlib.Path) -> list[str]:
        return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())

    def entry(self, repo: str, root: pathlib.Path, f: str) -> dict:
        p = root / f
        key = (str(p), p.stat().st_mtime_ns)
        if key not in self._meta:
            data = p.read_bytes()
            self._meta[key] = (hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest(),
                               hashlib.sha256(data).hexdigest(), len(data))
        oid, sha256, size = self._meta[key]
        e = {"type": "file", "oid": oid, "size": size, "path": f}
        if f.endswith((".safetensors", ".model")):  # what the Hub keeps in LFS
            e["lfs"] = {"oid": self.lie.get((repo, f), sha256), "size": size, "pointerSize": 134}
        return e

    def gets(self, repo: str) -> list[tuple[str, str | None]]:
        """(file, Range) of every GET of a repo's files."""
        with self.lock:
            return [(f, rng) for m, r, f, rng in self.log if m == "GET" and r == repo]

    def close(self) -> None:
        self.server.shutdown()


def hub_env(url: str, home: pathlib.Path) -> dict:
    """The settings that point huggingface_hub at `url` with its cache under `home` (no token, no telemetry)."""
    return {"HF_ENDPOINT": url, "HF_HOME": str(home), "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_XET": "1",
            "HF_HUB_ETAG_TIMEOUT": "30", "XDG_CACHE_HOME": str(home / "xdg")}


if __name__ == "__main__":  # pragma: no cover - a manual check: python -m tests.storage_servers
    print(emulator())
    os._exit(0)
