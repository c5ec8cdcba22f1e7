"""`trahiv dht`: a bootstrap peer, the swarm's stable entry point; it prints the addresses volunteers join with."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("dht", help="run a bootstrap DHT peer (stable entry point of a swarm)")
    parser.add_argument("--initial-peers", nargs="*", default=[], help="multiaddrs of other bootstrap peers")
    parser.add_argument("--host-maddrs", nargs="+", default=["/ip4/127.0.0.1/tcp/0"], help="addresses to listen on")
    parser.add_argument("--announce-maddrs", nargs="*", default=None, help="public addresses to announce")
    parser.add_argument("--identity-path", default=None, help="key file fixing the peer ID (created if missing)")
    parser.add_argument("--no-nat-port-map", dest="nat_port_map", action="store_false", help="do not ask the gateway")
    parser.add_argument("--addresses-file", default=None, help="also write the join addresses there (JSON)")
    parser.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    parser.add_argument("--auth-server", default=None, help="moderated swarm: URL of its `trahiv auth-server`")
    parser.add_argument("--run-id", default=None, help="moderated swarm: the run_id the access token is for")
    parser.add_argument(
        "--auth-token-file", default=None, help="moderated swarm: file holding its token (or $TRAHIV_AUTH_TOKEN)"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from trahiv import connectivity
    from trahiv.config import DHTConfig
    from trahiv.engine import interrupt_on_signals
    from trahiv.errors import UserError, explain_validation
    from trahiv.swarm import join_addresses, start_dht

    try:
        config = DHTConfig(
            initial_peers=args.initial_peers,
            host_maddrs=args.host_maddrs,
            announce_maddrs=args.announce_maddrs,
            identity_path=args.identity_path,
            nat_port_map=args.nat_port_map,
        )
    except ValidationError as e:
        raise UserError(explain_validation(e, as_flags=True)) from None
    if args.identity_path:
        _ensure_identity(args.identity_path)
    auth = _start_auth(args)
    try:
        dht = start_dht(config, **(auth.dht_kwargs() if auth is not None else {}))
        if auth is not None:
            auth.attach(dht)
    except BaseException:
        if auth is not None:
            auth.close()
        raise
    deadline = None if args.duration is None else time.monotonic() + args.duration
    try:
        with interrupt_on_signals():  # before announcing: a SIGTERM right after the address is printed stops cleanly
            addresses = join_addresses(dht)
            for line in connectivity.join_lines(addresses, config.initial_peers, client_mode=dht.client_mode):
                print(line, flush=True)
            if args.addresses_file:
                with open(args.addresses_file, "w") as f:
                    json.dump(addresses, f)
            while dht.is_alive() and (deadline is None or time.monotonic() < deadline):
                time.sleep(0.5)
    except KeyboardInterrupt:
        print("Stopping the bootstrap peer", file=sys.stderr)
        return 0
    finally:
        crashed = not dht.is_alive()
        if auth is not None:
            auth.close()
        dht.shutdown()
    if crashed:
        print("The DHT process stopped unexpectedly", file=sys.stderr)
        return 1
    return 0


def _start_auth(args: argparse.Namespace) -> Any:
    """With --auth-server: this peer's access token, so that the swarm's authenticated peers accept it."""
    if args.auth_server is None:
        return None
    import os
    from pathlib import Path

    from trahiv.auth import PeerAuth
    from trahiv.config import TOKEN_ENV

    env_token = os.environ.get(TOKEN_ENV, "").strip()
    if not args.run_id or not (args.auth_token_file or env_token):
        raise ValueError(
            f"--auth-server needs --run-id and --auth-token-file (or ${TOKEN_ENV}): the user token a moderator issued"
        )
    token = Path(args.auth_token_file).read_text().strip() if args.auth_token_file else env_token
    # refused or unreachable: an AuthError with the reason, shown by trahiv/cli/main.py as one message
    return PeerAuth.start(args.auth_server, token, args.run_id, identity_path=args.identity_path)


def _ensure_identity(path: str) -> None:
    """Create the key file on first use, so the peer ID (and the join address) survive restarts."""
    import os

    if os.path.exists(path):
        return
    from hivemind.p2p import P2P

    P2P.generate_identity(path)
    print(f"Created a new peer identity in {path}", file=sys.stderr)
