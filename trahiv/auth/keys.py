"""RSA keys and the signed form of an access token, with `cryptography` only (the auth server imports no engine).

Signatures are RSA-PSS (MGF1-SHA256, maximal salt) over SHA-256, base64-encoded: hivemind's `RSAPrivateKey.sign`
format, so hivemind's `RSAPublicKey.verify` accepts them too. Public keys travel in OpenSSH format ('ssh-rsa ...').
"""

from __future__ import annotations

import base64
from datetime import UTC, datetime

from cryptography import exceptions
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa

__all__ = [
    "MIN_KEY_BITS",
    "KeyError_",
    "expiration_string",
    "generate_private_key",
    "load_private_key",
    "load_public_key",
    "private_key_der",
    "public_key_openssh",
    "sign",
    "token_message",
    "verify",
]

MIN_KEY_BITS = 2048
_PADDING = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.MAX_LENGTH)


class KeyError_(ValueError):  # noqa: N801 (not the builtin KeyError)
    """A key that cannot be used; the message says why."""


def generate_private_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=MIN_KEY_BITS)


def private_key_der(key: rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
    )


def load_private_key(der: bytes) -> rsa.RSAPrivateKey:
    key = serialization.load_der_private_key(der, password=None)
    if not isinstance(key, rsa.RSAPrivateKey):
        raise KeyError_("not an RSA private key")
    return key


def public_key_openssh(key: rsa.RSAPrivateKey | rsa.RSAPublicKey) -> bytes:
    public = key.public_key() if isinstance(key, rsa.RSAPrivateKey) else key
    return public.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)


def load_public_key(openssh: bytes) -> rsa.RSAPublicKey:
    """An RSA public key in OpenSSH format, at least MIN_KEY_BITS bits (KeyError_ otherwise)."""
    try:
        key = serialization.load_ssh_public_key(openssh)
    except Exception as e:
        raise KeyError_(f"not an RSA public key in OpenSSH format ('ssh-rsa AAAA...'): {e}") from None
    if not isinstance(key, rsa.RSAPublicKey):
        raise KeyError_(f"not an RSA public key in OpenSSH format ('ssh-rsa AAAA...'): {type(key).__name__}")
    if key.key_size < MIN_KEY_BITS:
        raise KeyError_(f"the RSA key has {key.key_size} bits; at least {MIN_KEY_BITS} are required")
    return key


def sign(key: rsa.RSAPrivateKey, message: bytes) -> bytes:
    return base64.b64encode(key.sign(message, _PADDING, hashes.SHA256()))


def verify(key: rsa.RSAPublicKey, message: bytes, signature: bytes) -> bool:
    try:
        key.verify(base64.b64decode(signature), message, _PADDING, hashes.SHA256())
        return True
    except (ValueError, exceptions.InvalidSignature):
        return False


def expiration_string(expires_at: float) -> str:
    return datetime.fromtimestamp(expires_at, UTC).isoformat()


def token_message(username: str, public_key: bytes, expiration_time: str) -> bytes:
    """What the experiment key signs for an access token; length-prefixed, so no two triples share a message."""
    parts = [username.encode(), public_key, expiration_time.encode()]
    return b"trahiv-access-token-v1" + b"".join(len(p).to_bytes(4, "big") + p for p in parts)
