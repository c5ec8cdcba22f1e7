"""Access tokens: what the auth server signs and every peer checks.

A token is hivemind's `AccessToken` protobuf: `username`, `public_key` (the peer's RSA key, OpenSSH format),
`expiration_time` (ISO 8601, UTC) and `signature`, the experiment key's signature over the other three
(`trahiv.auth.keys.token_message`). The peer's libp2p identity is that same RSA key, so the token also names exactly
one peer ID (`peer_id_of(public_key)`): averaging RPCs, which libp2p authenticates by peer ID, are checked against it.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from datetime import datetime

import multihash
from cryptography.hazmat.primitives import serialization
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.crypto import RSAPrivateKey

from trahiv.auth import keys
from trahiv.engine.identity import private_key_from_der

__all__ = [
    "AccessToken",
    "TokenError",
    "TokenInfo",
    "load_identity",
    "peer_id_of",
    "private_key_from_der",
    "sign_access_token",
    "token_from_bytes",
    "verify_access_token",
]


class TokenError(ValueError):
    """A token (or a key) that must not be accepted; the message says why."""


@dataclass(frozen=True)
class TokenInfo:
    """What a verified token grants: `username` may act as `peer_id` until `expires_at` (UNIX time)."""

    username: str
    peer_id: PeerID
    expires_at: float


def sign_access_token(experiment_key: bytes, username: str, public_key: bytes, expires_at: float) -> AccessToken:
    """A token letting `username` act with `public_key` until `expires_at`, signed by the experiment's key (DER)."""
    expiration_time = keys.expiration_string(expires_at)
    message = keys.token_message(username, public_key, expiration_time)
    signature = keys.sign(keys.load_private_key(experiment_key), message)
    return AccessToken(username=username, public_key=public_key, expiration_time=expiration_time, signature=signature)


def verify_access_token(token: AccessToken, experiment_key: bytes, now: float) -> TokenInfo:
    """Check the signature (experiment key: OpenSSH) and the expiry; return what the token grants, or raise
    TokenError with the reason."""
    if not token.username or not token.public_key or not token.signature:
        raise TokenError("the access token is empty or incomplete")
    message = keys.token_message(token.username, token.public_key, token.expiration_time)
    if not keys.verify(_public_key(experiment_key), message, token.signature):
        raise TokenError("the access token is not signed by this experiment's key")
    try:
        expires_at = datetime.fromisoformat(token.expiration_time).timestamp()
    except ValueError:
        raise TokenError(f"malformed expiration time {token.expiration_time!r}") from None
    if expires_at <= now:
        raise TokenError(f"the access token of {token.username!r} expired at {token.expiration_time}")
    return TokenInfo(token.username, peer_id_of(token.public_key), expires_at)


def _public_key(openssh: bytes) -> keys.rsa.RSAPublicKey:
    try:
        return keys.load_public_key(openssh)
    except keys.KeyError_ as e:
        raise TokenError(str(e)) from None


def token_from_bytes(data: bytes) -> AccessToken:
    """Parse a serialized token (raises TokenError on garbage)."""
    if not isinstance(data, bytes) or len(data) > 8192:
        raise TokenError("an access token must be at most 8192 bytes")
    try:
        return AccessToken.FromString(data)
    except Exception as e:  # protobuf's DecodeError and friends
        raise TokenError(f"malformed access token: {e}") from None


def peer_id_of(public_key: bytes) -> PeerID:
    """The libp2p peer ID of a peer whose identity is this RSA key (OpenSSH format), per the libp2p spec."""
    der = _public_key(public_key).public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return PeerID(multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256")))


def load_identity(path: str, create: bool = True) -> RSAPrivateKey:
    """The RSA private key of a libp2p identity file (hivemind's format); create the file if it does not exist."""
    if not os.path.exists(path):
        if not create:
            raise TokenError(f"identity file {path!r} does not exist")
        from hivemind.p2p import P2P

        P2P.generate_identity(path)
    with open(path, "rb") as f:
        data = f.read()
    try:
        proto = crypto_pb2.PrivateKey.FromString(data)
        keys.load_private_key(proto.data)
    except Exception as e:
        raise TokenError(
            f"identity file {path!r} is not an RSA libp2p private key ({e}); with auth the identity must be an RSA "
            "key: delete the file to let trahiv create one, or create it with hivemind.P2P.generate_identity"
        ) from None
    if proto.key_type != crypto_pb2.RSA:
        raise TokenError(f"identity file {path!r} holds a non-RSA key; with auth the identity must be an RSA key")
    return private_key_from_der(proto.data)
