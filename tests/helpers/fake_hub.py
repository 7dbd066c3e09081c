"""A small HTTP server speaking the Hub endpoints ``snapshot_download`` uses.

Serves one repository (the files of a local directory) at one commit:
``/api/models/ORG/NAME[/revision/REV]`` (model info), ``.../tree/REV``
(file listing) and ``/ORG/NAME/resolve/REV/FILE`` (HEAD and GET, with Range
for resumed downloads). Every request needs ``Authorization: Bearer TOKEN``
when a token is set; a wrong one gets 401 as from the Hub. Requests are
recorded so tests can tell what was downloaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse


class FakeHub:
    def __init__(
        self,
        repo_id: str,
        directory: str,
        commit: str,
        *,
        token: str | None = None,
        branches: tuple[str, ...] = ("main",),
    ) -> None:
        self.repo_id = repo_id
        self.commit = commit
        self.token = token
        self.revisions = {*branches, commit}
        self.files: dict[str, bytes] = {}
        for root, _, names in os.walk(directory):
            for name in names:
                path = os.path.join(root, name)
                self.files[os.path.relpath(path, directory)] = open(path, "rb").read()  # noqa: SIM115
        self.requests: list[tuple[str, str]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                hub._handle(self, head=True)

            def do_GET(self) -> None:
                hub._handle(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(10)

    def downloads(self) -> list[str]:
        """Paths of files whose bytes were sent (GET on resolve)."""
        return [p for m, p in self.requests if m == "GET" and "/resolve/" in p]

    # -- responses -----------------------------------------------------------------

    def _send(self, h, status: int, body: bytes = b"", headers: dict | None = None, head=False):
        h.send_response(status)
        for k, v in (headers or {}).items():
            h.send_header(k, str(v))
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if not head:
            h.wfile.write(body)

    def _error(self, h, status: int, code: str | None, message: str, head: bool) -> None:
        headers = {"X-Error-Message": message, "Content-Type": "application/json"}
        if code:
            headers["X-Error-Code"] = code
        self._send(h, status, json.dumps({"error": message}).encode(), headers, head)

    def _entry(self, path: str) -> dict:
        data = self.files[path]
        entry = {
            "type": "file",
            "path": path,
            "size": len(data),
            "oid": hashlib.sha1(data, usedforsecurity=False).hexdigest(),  # git's object id
        }
        if path.endswith(".safetensors"):
            entry["lfs"] = {
                "oid": hashlib.sha256(data).hexdigest(),
                "size": len(data),
                "pointerSize": 134,
            }
        return entry

    def _handle(self, h, head: bool) -> None:
        url = urlparse(h.path)
        path = unquote(url.path)
        self.requests.append(("HEAD" if head else "GET", path))
        if self.token is not None and h.headers.get("Authorization") != f"Bearer {self.token}":
            return self._error(h, 401, None, "Invalid credentials in Authorization header", head)
        prefix = f"/api/models/{self.repo_id}"
        if path.startswith("/api/models/") and not path.startswith(prefix):
            return self._error(h, 404, "RepoNotFound", "Repository not found", head)
        if path.startswith(prefix):
            rest = path[len(prefix) :].strip("/").split("/")
            revision = "main"
            if rest and rest[0] in ("revision", "tree") and len(rest) > 1:
                revision = rest[1]
            if revision not in self.revisions:
                return self._error(h, 404, "RevisionNotFound", "Invalid rev id", head)
            if rest and rest[0] == "tree":
                body = [self._entry(p) for p in sorted(self.files)]
                return self._send(h, 200, json.dumps(body).encode(), {}, head)
            info = {
                "id": self.repo_id,
                "modelId": self.repo_id,
                "sha": self.commit,
                "private": self.token is not None,
                "siblings": [{"rfilename": p} for p in sorted(self.files)],
            }
            return self._send(h, 200, json.dumps(info).encode(), {}, head)
        resolve = f"/{self.repo_id}/resolve/"
        if not path.startswith(resolve):
            return self._error(h, 404, "RepoNotFound", "Repository not found", head)
        revision, _, filename = path[len(resolve) :].partition("/")
        if revision not in self.revisions:
            return self._error(h, 404, "RevisionNotFound", "Invalid rev id", head)
        if filename not in self.files:
            return self._error(h, 404, "EntryNotFound", "Entry not found", head)
        data = self.files[filename]
        entry = self._entry(filename)
        etag = entry["lfs"]["oid"] if "lfs" in entry else entry["oid"]
        headers = {"X-Repo-Commit": self.commit, "ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
        status = 200
        ranged = h.headers.get("Range")
        if ranged and ranged.startswith("bytes=") and not head:
            start = int(ranged[len("bytes=") :].split("-")[0])
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            data, status = data[start:], 206
        if head:
            h.send_response(200)
            for k, v in headers.items():
                h.send_header(k, v)
            h.send_header("Content-Length", str(len(self.files[filename])))
            h.end_headers()
            return None
        return self._send(h, status, data, headers)
