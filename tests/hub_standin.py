"""A stand-in for the Hugging Face Hub on 127.0.0.1: just enough of its HTTP API for `huggingface_hub`'s
`create_repo` and `upload_folder` (preupload answers "regular" for every file, so contents arrive inline in the
commit). Point `HF_ENDPOINT` at `HubStandIn.url`; `commits` lists what arrived."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_REPO = r"(?P<repo>[^/]+/[^/]+)"
_PREUPLOAD = re.compile(rf"/api/models/{_REPO}/preupload/(?P<rev>[^/?]+)")
_COMMIT = re.compile(rf"/api/models/{_REPO}/commit/(?P<rev>[^/?]+)")


@dataclass
class Commit:
    repo: str
    revision: str
    summary: str
    files: dict[str, bytes]
    authorization: str | None


@dataclass
class HubStandIn:
    repos: set[str] = field(default_factory=set)
    commits: list[Commit] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)  # requests this stand-in does not implement

    def __post_init__(self) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> HubStandIn:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()


def _handler(hub: HubStandIn) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _reply(self, status: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def do_GET(self) -> None:
            hub.unknown.append(f"GET {self.path}")
            self._reply(404, {"error": "not in the stand-in"})

        def do_POST(self) -> None:
            path = self.path.split("?")[0]
            body = self._body()
            if path == "/api/repos/create":
                request = json.loads(body)
                repo = f"{request.get('organization') or 'user'}/{request['name']}"
                hub.repos.add(repo)
                self._reply(200, {"url": f"{hub.url}/{repo}", "name": repo})
            elif match := _PREUPLOAD.fullmatch(path):
                files = json.loads(body)["files"]
                answer = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]
                self._reply(200, {"files": answer})
            elif match := _COMMIT.fullmatch(path):
                self._reply(200, self._commit(match["repo"], match["rev"], body))
            else:
                hub.unknown.append(f"POST {self.path}")
                self._reply(404, {"error": "not in the stand-in"})

        def _commit(self, repo: str, revision: str, body: bytes) -> dict[str, Any]:
            summary, files = "", {}
            for line in body.splitlines():
                item = json.loads(line)
                if item["key"] == "header":
                    summary = item["value"]["summary"]
                elif item["key"] == "file":
                    files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
            hub.commits.append(Commit(repo, revision, summary, files, self.headers.get("Authorization")))
            oid = hashlib.sha1(body).hexdigest()
            return {"commitUrl": f"{hub.url}/{repo}/commit/{oid}", "commitOid": oid, "success": True}

    return Handler
