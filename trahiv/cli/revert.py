"""`trahiv revert`: a moderator returns a moderated swarm to a checkpoint (e.g. one the auxiliary peer saved).

It joins the swarm as a peer (hivemind_config with `auth`: the moderator's user token), serves the checkpoint's state,
asks the auth server (with the moderator token) for a revert order naming this peer, the checkpoint's step and the
digest of its weights, publishes the signed order in the DHT, and keeps serving for `--serve-for` seconds, while the
trainers download the state and continue from it (see trahiv/revert.py).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("revert", help="moderators: return the swarm to a checkpoint (needs the auth server)")
    parser.add_argument("--config", required=True, help="hivemind_config (JSON string or file) with dht, opt, auth")
    parser.add_argument(
        "--checkpoint",
        required=True,
        help="a checkpoint folder: the auxiliary peer's (checkpoint-N), or a swarm trainer's output_dir/checkpoint-N",
    )
    parser.add_argument("--admin-token-file", required=True, help="file holding the auth server's moderator token")
    parser.add_argument("--reason", default="", help="why (kept with the order; at most 500 characters)")
    parser.add_argument("--serve-for", type=float, default=300.0, help="seconds to serve the checkpoint (default 300)")
    parser.add_argument("--order-file", default=None, help="also write the signed order (JSON) there")
    parser.set_defaults(run=run)


class _Terminated(Exception):
    pass


def _terminated(*_: Any) -> None:
    raise _Terminated


def post_revert(server: str, run_id: str, admin_token: str, body: dict[str, Any], timeout: float = 30.0) -> Any:
    """POST the order request; the server's signed order, or ValueError with the server's reason."""
    request = urllib.request.Request(
        f"{server.rstrip('/')}/api/experiments/{run_id}/revert", data=json.dumps(body).encode(), method="POST"
    )
    request.add_header("Content-Type", "application/json")
    request.add_header("Authorization", f"Bearer {admin_token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as e:
        from trahiv.auth.client import http_error_detail

        raise ValueError(f"the auth server refused the revert order (HTTP {e.code}): {http_error_detail(e)}") from None
    except (urllib.error.URLError, OSError) as e:
        raise ValueError(f"could not reach the auth server at {server}: {e}") from None


def run(args: argparse.Namespace) -> int:
    from trahiv.config import HivemindConfig

    if not 0 < args.serve_for <= 7 * 86400:
        raise ValueError(f"--serve-for {args.serve_for}: expected 0 < seconds <= 604800")
    if len(args.reason) > 500:
        raise ValueError("--reason: at most 500 characters")
    config = HivemindConfig.load(args.config)
    if config.auth is None:
        raise ValueError("reverting needs a moderated swarm: give hivemind_config an 'auth' section (server, token)")
    admin_token = Path(args.admin_token_file).read_text().strip()

    from trahiv.auxiliary.checkpoints import SwarmState, load_checkpoint
    from trahiv.revert import state_from_trainer_checkpoint

    run_id, folder = config.opt.run_id, Path(args.checkpoint)
    state: SwarmState
    if (folder / "optimizer.pt").is_file() and not (folder / "trahiv_state.json").is_file():
        state, _ = state_from_trainer_checkpoint(folder)  # a trainer's own save (output_dir/checkpoint-N)
    else:
        checkpoint = load_checkpoint(folder)  # ValueError if it is not one
        if checkpoint.run_id and checkpoint.run_id != run_id:
            raise ValueError(f"{folder} is a checkpoint of run {checkpoint.run_id!r}, not {run_id!r}")
        state = checkpoint.swarm_state()

    from trahiv import engine
    from trahiv.auth import AuthGate
    from trahiv.auth.revert import SignedRevertOrder, verify_order
    from trahiv.lifecycle import Lifecycle, join_swarm
    from trahiv.revert import RevertWatcher, parameters_digest, serve_state
    from trahiv.swarm import _start_auth

    digest = parameters_digest(state.parameters)
    previous = signal.signal(signal.SIGTERM, _terminated)
    lifecycle = Lifecycle()  # auth -> DHT -> token -> the state mirror; the reverse on exit
    try:
        # refused: an AuthError, shown by trahiv/cli/main.py as one message
        member = join_swarm(lifecycle, config.dht, auth=lambda: _start_auth(config), watch_reverts=False)
        dht, auth = member.dht, member.auth
        assert auth is not None  # (config.auth is set)

        def start_mirror() -> Any:
            with engine.children_ignore_sigint():  # [DiLoCo] serve_state: a DiLoCo outer state under its own prefix
                return serve_state(dht, run_id, state, AuthGate(run_id, auth.experiment_public_key))

        _mirror, prefix = lifecycle.enter("state mirror", start_mirror, lambda served: served[0].shutdown())
        peer_id = dht.peer_id.to_base58()
        print(f"Serving {args.checkpoint} (collaborative step {state.step}) as peer {peer_id}", file=sys.stderr)
        _wait_declared(dht, prefix, state.step)
        body = {"step": state.step, "source": peer_id, "parameters_sha256": digest, "reason": args.reason}
        signed = SignedRevertOrder.model_validate(post_revert(config.auth.server, run_id, admin_token, body))
        order = verify_order(signed, auth.experiment_public_key, run_id)  # the server signs with the key peers trust
        RevertWatcher(dht, run_id, auth.experiment_public_key).publish(signed)
        if args.order_file:
            Path(args.order_file).write_text(signed.model_dump_json())
        print(f"Revert order #{order.revert_id}: the swarm returns to step {order.step}", file=sys.stderr, flush=True)
        deadline = time.monotonic() + args.serve_for
        while time.monotonic() < deadline:
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    except (_Terminated, KeyboardInterrupt):
        print("Stopping", file=sys.stderr)
    finally:
        signal.signal(signal.SIGTERM, previous)
        lifecycle.close()  # the mirror, the token, the DHT
    return 0


def _wait_declared(dht: Any, prefix: str, step: int, timeout: float = 60.0) -> None:
    """Until peers can see that this one serves `step` (its state declaration is in the DHT)."""
    own, deadline = dht.peer_id.to_bytes(), time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = dht.get(f"{prefix}.all_averagers", latest=True)
        entries = found.value if found is not None and isinstance(found.value, dict) else {}
        if own in entries and getattr(entries[own], "value", None) == step:
            return
        time.sleep(0.5)
    raise ValueError(f"the checkpoint's state declaration did not reach the DHT in {timeout:.0f} s")
