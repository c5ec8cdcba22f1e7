"""`trahiv auth-server`: the web service that screens a collaborative run's peers (allowlist, bans, access tokens)."""

from __future__ import annotations

import argparse
import signal
import socket
import sys
from pathlib import Path
from typing import Any


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("auth-server", help="run the auth server: moderators, allowlists, bans, access tokens")
    parser.add_argument("--db", default="sqlite:///trahiv-auth.db", help="SQLAlchemy database URL")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8765, help="port to listen on (0: any free port)")
    parser.add_argument(
        "--admin-token-file",
        default="trahiv-auth-admin-token",
        help="where the moderator token created at first start is written (owner-readable only)",
    )
    parser.add_argument("--url-file", default=None, help="also write the server's URL there once it listens")
    parser.set_defaults(run=run)


class _Terminated(Exception):
    pass


def _terminated(*_: Any) -> None:
    raise _Terminated


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from trahiv.auth.server import AuthServerState, create_app, open_database

    if not (0 <= args.port < 65536):
        raise ValueError(f"--port {args.port}: expected 0-65535")
    state = AuthServerState(open_database(args.db))
    token = state.ensure_admin()
    if token is not None:
        path = Path(args.admin_token_file)
        path.unlink(missing_ok=True)
        path.touch(mode=0o600)
        path.write_text(token + "\n")
        print(f"Created the moderator token (Authorization: Bearer ...) in {path}", file=sys.stderr)
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(128)  # clients that connect before uvicorn runs wait in the backlog
    url = f"http://{args.host}:{sock.getsockname()[1]}"
    print(f"trahiv auth server at {url} (database {args.db})", file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(create_app(state), log_level="warning"))
    if args.url_file:
        Path(args.url_file).write_text(url)
    # uvicorn stops gracefully on SIGTERM, then raises the signal again: exit 0 then, as `trahiv dht` does
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        server.run(sockets=[sock])
    except (_Terminated, KeyboardInterrupt):
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        sock.close()
    return 0
