"""Errors a volunteer can act on: one message that says what is wrong, where, and how to fix it.

`user_message(exc)` turns the exceptions that mean "bad input or an unreachable swarm" into that message (None for
anything else: a bug, which keeps its traceback); the `trahiv` command prints it and exits with code 2 (see
trahiv/cli/main.py). `join_error_message` builds the message of a DHT that could not join its initial peers, in place of
hivemind's, which tells the user to "set ensure_bootstrap_success=False", a key trahiv's config refuses.
Tracebacks come back with `--debug` or the environment variable TRAHIV_DEBUG=1.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

__all__ = ["DEBUG_ENV", "UserError", "debug_enabled", "explain_validation", "join_error_message", "user_message"]

DEBUG_ENV = "TRAHIV_DEBUG"
NOT_ANSWERED = "none of the initial_peers responded"  # hivemind's DHTNode: the p2p link worked, the DHT refused
NOT_CONNECTED = "failed to connect to bootstrap peers"  # the p2p daemon: nothing answered at the addresses
FILE_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)


class UserError(ValueError):
    """A mistake the user can fix (input, file, address): shown as one message, no traceback; exit code 2."""


def debug_enabled() -> bool:
    """True with TRAHIV_DEBUG=1 (or true/yes): show tracebacks for user errors too."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def join_error_message(initial_peers: Sequence[str], host_maddrs: Sequence[str], error: BaseException, *,
                       authenticated: bool, attempts: int = 1) -> str:  # fmt: skip
    """Why a DHT could not start or join, and what to do, from the engine's exception."""
    reason = str(error).strip()
    if not initial_peers:
        return f"could not start the DHT on host_maddrs={list(host_maddrs)}: {reason}. Check that these addresses are "\
            "this machine's and that the ports are free (tcp/0 picks a free one)"  # fmt: skip
    peers = list(initial_peers)
    if NOT_ANSWERED in reason and not authenticated:
        return (
            f"the peers at initial_peers={peers} were reached but refused this peer: this swarm requires a token "
            "(hivemind_config.auth: {'server': <the swarm's auth server URL>, 'token': <your token>}, or "
            "token_file, or TRAHIV_AUTH_TOKEN). Ask the swarm's moderator for a token. (Also check that the peers "
            "run trahiv with the same hivemind version.)"
        )
    if NOT_ANSWERED in reason:
        return (
            f"the peers at initial_peers={peers} were reached but did not accept this peer's access token: check "
            "that hivemind_config.auth.server is this swarm's auth server and opt.run_id its run_id"
        )
    if NOT_CONNECTED in reason:
        reason = "nothing answered at these addresses" + (f" ({attempts} attempts)" if attempts > 1 else "")
    else:
        reason = reason.removesuffix("(set ensure_bootstrap_success=False to ignore)").strip()
    return (
        f"could not join the swarm through initial_peers={peers}: {reason}. Check that a peer is running there, that "
        "the address and /p2p/ ID were copied whole, and that the port is reachable from this machine"
    )


def user_message(error: BaseException) -> str | None:
    """One line (or a few) for an error the user can fix; None for an unexpected error (a bug)."""
    from pydantic import ValidationError

    if isinstance(error, ValidationError):
        return explain_validation(error)
    if isinstance(error, ValueError):  # UserError, and trahiv raises ValueError with the key and the fix
        return str(error)
    if isinstance(error, FILE_ERRORS):
        if getattr(error, "filename", None) and error.strerror:
            return f"{error.filename}: {error.strerror}. Check the path and its permissions"
        return f"{error}. Check the path and its permissions"
    name = type(error).__name__
    # (matched by name: importing them would start the engine)
    if name in ("SwarmJoinError", "SwarmLostError", "AuthError"):
        return str(error)
    if name == "ArgumentError" and type(error).__module__.startswith("sqlalchemy"):
        return f"{error}: give a database URL such as sqlite:///trahiv.db or postgresql://user@host/db"
    try:
        import yaml
    except ImportError:  # pragma: no cover - a dependency
        return None
    if isinstance(error, yaml.YAMLError):
        return f"invalid YAML: {error}"
    return None


def explain_validation(error: Any, *, as_flags: bool = False) -> str:
    """A pydantic error as `field: reason` lines, without the input dump and documentation URL; with `as_flags`, the
    fields named as the command-line flags that set them (host_maddrs -> --host-maddrs)."""
    lines = []
    for item in error.errors():
        loc = [str(part) for part in item["loc"]]
        if as_flags and loc:
            loc = ["--" + loc[0].replace("_", "-")]  # (the flag, not the list index)
        where = ".".join(loc) or "(top level)"
        lines.append(f"{where}: {item['msg'].removeprefix('Value error, ')}")
    return "invalid value:\n  " + "\n  ".join(lines) if len(lines) > 1 else f"invalid value: {lines[0]}"
