"""`trahiv dht`: a bootstrap peer, the swarm's stable entry point; it prints the addresses volunteers join with."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, Any

from trahiv.cli import write_addresses
from trahiv.config import TOKEN_ENV

if TYPE_CHECKING:
    from trahiv.config import DHTConfig


def register(commands: argparse._SubParsersAction) -> None:
    from trahiv.cli.flags import add_flags
    from trahiv.config import AuthConfig, DHTConfig, OptimizerConfig

    parser = commands.add_parser("dht", help="run a bootstrap DHT peer (stable entry point of a swarm)")
    dht = add_flags(parser, DHTConfig, notes={"identity_path": "created if missing"})
    parser.add_argument("--addresses-file", default=None, help="also write the join addresses there (JSON)")
    parser.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    group = parser.add_argument_group("moderated swarm (see `trahiv auth-server`)")
    auth = add_flags(
        group, AuthConfig, only=("server", "token_file"), prefix="auth", notes={"token_file": f"or ${TOKEN_ENV}"}
    )
    run_id = add_flags(group, OptimizerConfig, only=("run_id",), notes={"run_id": "the one the access token is for"})
    parser.set_defaults(run=run, flags_dht=dht, flags_auth=auth, flags_run_id=run_id)


def run(args: argparse.Namespace) -> int:
    # the user's input first (a bad value: one message naming the flag or file, exit code 2), then the engine's
    # imports, which take seconds
    config: DHTConfig = args.flags_dht.build(args)
    token = _auth_token(args)
    if config.identity_path:
        _ensure_identity(config.identity_path)

    from trahiv import connectivity
    from trahiv.engine import interrupt_on_signals
    from trahiv.lifecycle import Lifecycle, join_swarm
    from trahiv.swarm import join_addresses

    lifecycle = Lifecycle()  # auth -> DHT -> token; no revert watcher (a bootstrap peer holds no model)
    lost: list[str] = []  # what ended under this peer (its DHT process, its p2pd: trahiv.engine.liveness)
    dht = join_swarm(lifecycle, config, auth=lambda: _start_auth(args, config, token), watch_reverts=False,
                     on_engine_lost=lost.append).dht  # fmt: skip
    deadline = None if args.duration is None else time.monotonic() + args.duration
    try:
        with interrupt_on_signals():  # before announcing: a SIGTERM right after the address is printed stops cleanly
            addresses = join_addresses(dht)
            for line in connectivity.join_lines(addresses, config.initial_peers, client_mode=dht.client_mode):
                print(line, flush=True)
            if args.addresses_file:
                write_addresses(args.addresses_file, addresses)
            while not lost and dht.is_alive() and (deadline is None or time.monotonic() < deadline):
                time.sleep(0.5)
    except KeyboardInterrupt:
        print("Stopping the bootstrap peer", file=sys.stderr)
        return 0
    finally:
        crashed = lost[:1] or (["its DHT process ended"] if not dht.is_alive() else [])
        lifecycle.close()  # the token (no renewal while the DHT stops), then the DHT
    if crashed:
        print(f"The bootstrap peer stopped: {crashed[0]}", file=sys.stderr)
        return 1
    return 0


def _auth_token(args: argparse.Namespace) -> str | None:
    """With --auth-server: the user token a moderator issued (from --auth-token-file or the environment)."""
    import os
    from pathlib import Path

    server, token_file = args.flags_auth.value(args, "server"), args.flags_auth.value(args, "token_file")
    if server is None:
        return None
    env_token = os.environ.get(TOKEN_ENV, "").strip()
    if not args.flags_run_id.value(args, "run_id") or not (token_file or env_token):
        raise ValueError(
            f"--auth-server needs --run-id and --auth-token-file (or ${TOKEN_ENV}): the user token a moderator issued"
        )
    return Path(token_file).read_text().strip() if token_file else env_token


def _start_auth(args: argparse.Namespace, config: DHTConfig, token: str | None) -> Any:
    """With --auth-server: this peer's access token, so that the swarm's authenticated peers accept it."""
    if token is None:
        return None
    from trahiv.auth import PeerAuth

    server, run_id = args.flags_auth.value(args, "server"), args.flags_run_id.value(args, "run_id")
    # refused or unreachable: an AuthError with the reason, shown by trahiv/cli/main.py as one message
    return PeerAuth.start(server, token, run_id, identity_path=config.identity_path)


def _ensure_identity(path: str) -> None:
    """Create the key file on first use, so the peer ID (and the join address) survive restarts."""
    import os

    if os.path.exists(path):
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):  # told before hivemind's import (seconds) would fail to write there
        raise FileNotFoundError(2, f"No such directory for the identity file {path!r}", folder)
    from hivemind.p2p import P2P

    P2P.generate_identity(path)
    print(f"Created a new peer identity in {path}", file=sys.stderr)
