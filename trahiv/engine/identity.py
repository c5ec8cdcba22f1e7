"""hivemind 1.1.12 key objects built from bytes (its `RSAPrivateKey` has no public constructor from DER)."""

from __future__ import annotations

from hivemind.utils.crypto import RSAPrivateKey

__all__ = ["private_key_from_der"]


def private_key_from_der(der: bytes) -> RSAPrivateKey:
    """hivemind's RSAPrivateKey from its DER bytes (`RSAPrivateKey.to_bytes()`)."""
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": der})  # the engine's own unpickling path for DER keys
    return key
