"""Authentication, allowlists and moderation of a swarm.

- `keys`: RSA keys and signatures (no engine import: the auth server uses only this);
- `server`: the auth server (FastAPI + SQLAlchemy), run by `trahiv auth-server`;
- `tokens`: the access token (username + peer key + expiry, signed by the experiment's key) and peer IDs;
- `client`: a peer's token: obtained at start, renewed, published, used to sign DHT requests;
- `gate`: averaging RPCs served only to peers whose libp2p identity holds a valid token.

Importing `trahiv.auth` is cheap: the names below load their module (and hivemind) on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["AuthClient", "AuthError", "AuthGate", "PeerAuth", "SwarmAuthorizer", "TokenError", "TokenInfo"]

_LAZY = {
    "AuthClient": "trahiv.auth.client",
    "AuthError": "trahiv.auth.client",
    "PeerAuth": "trahiv.auth.client",
    "SwarmAuthorizer": "trahiv.auth.client",
    "AuthGate": "trahiv.auth.gate",
    "TokenError": "trahiv.auth.tokens",
    "TokenInfo": "trahiv.auth.tokens",
}

if TYPE_CHECKING:
    from trahiv.auth.client import AuthClient, AuthError, PeerAuth, SwarmAuthorizer
    from trahiv.auth.gate import AuthGate
    from trahiv.auth.tokens import TokenError, TokenInfo


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'trahiv.auth' has no attribute {name!r}")
