"""A Hugging Face Hub for tests: a folder served over HTTP on 127.0.0.1 in the Hub's API layout.

Enough of the Hub for ``huggingface_hub.snapshot_download`` (its 2.x client): a repo's revision
(``GET /api/models/{repo}/revision/{rev}``), its file tree (``GET /api/models/{repo}/tree/{sha}``)
and each file (``HEAD`` and ``GET /{repo}/resolve/{sha}/{path}`` with ``ETag`` and
``X-Repo-Commit``). Every repo name serves the same folder; ``missing`` names answer 404 with the
Hub's ``X-Error-Code: RepoNotFound``. Point a process at it with ``HF_ENDPOINT=hub.url``.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

SHA = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self, folder: Path, missing: tuple[str, ...] = ()) -> None:
        self.files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        self.missing, self.requests = set(missing), []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                hub._answer(self, head=True)

            def do_GET(self) -> None:
                hub._answer(self, head=False)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _answer(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        path = h.path.split("?")[0]
        self.requests.append(f"{h.command} {path}")
        parts = path.strip("/").split("/")
        api = parts[:2] == ["api", "models"]
        repo = "/".join(parts[2:4] if api else parts[0:2])
        if repo in self.missing:
            return self._send(h, 404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"}, head)
        if api and parts[4:5] == ["revision"]:
            body = {"id": repo, "sha": SHA, "siblings": [{"rfilename": f} for f in self.files]}
            return self._send(h, 200, json.dumps(body).encode(), {"Content-Type": "application/json"}, head)
        if api and parts[4:5] == ["tree"]:
            tree = [{"type": "file", "path": f, "size": len(d), "oid": hashlib.sha1(d).hexdigest()}
                    for f, d in self.files.items()]
            return self._send(h, 200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, head)
        name = "/".join(parts[4:])
        if not api and parts[2:3] == ["resolve"] and name in self.files:
            data = self.files[name]
            return self._send(h, 200, data, {"ETag": f'"{hashlib.sha1(data).hexdigest()}"', "X-Repo-Commit": SHA}, head)
        return self._send(h, 404, b"{}", {"X-Error-Code": "EntryNotFound"}, head)

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, status: int, body: bytes, headers: dict, head: bool) -> None:
        h.send_response(status)
        for k, v in {**headers, "Content-Length": str(len(body))}.items():
            h.send_header(k, v)
        h.end_headers()
        if not head:
            h.wfile.write(body)
