"""Revert orders: a moderator's signed instruction that the swarm return to a checkpoint.

The auth server signs each order with the experiment's key (the one that signs access tokens), so any peer can check
an order it finds in the DHT or gets from the server, and nobody else can issue one. An order names the collaborative
`step` of the checkpoint, the peer that serves it (`source`, a libp2p peer ID; empty: any peer serving that step), and
the SHA-256 of its trainable tensors (`parameters_sha256`; empty: unchecked), so that peers load exactly that state.
`revert_id` grows by one with every order of a run: peers apply each order once, the newest first.

This module uses `cryptography` and pydantic only (the auth server imports it); peers follow orders in
`trahiv.revert`.
"""

from __future__ import annotations

import json
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trahiv.auth import keys

__all__ = [
    "ORDER_FORMAT",
    "PEER_ID_PATTERN",
    "SHA256_PATTERN",
    "RevertOrder",
    "RevertOrderError",
    "SignedRevertOrder",
    "order_message",
    "sign_order",
    "verify_order",
]

ORDER_FORMAT: Final = "trahiv-revert/1"
PEER_ID_PATTERN = r"^([1-9A-HJ-NP-Za-km-z]{32,128})?$"  # base58 libp2p peer ID, or empty
SHA256_PATTERN = r"^([0-9a-f]{64})?$"
MAX_ORDER_BYTES = 8192


class RevertOrderError(ValueError):
    """A revert order that must not be followed; the message says why."""


class RevertOrder(BaseModel):
    """What the experiment key signs."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    format: Literal["trahiv-revert/1"] = ORDER_FORMAT
    run_id: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,128}$")
    revert_id: int = Field(ge=1, le=2**62)
    step: int = Field(ge=0, le=2**62, description="collaborative step of the checkpoint")
    source: str = Field("", pattern=PEER_ID_PATTERN, description="peer ID serving the checkpoint ('' = any)")
    parameters_sha256: str = Field("", pattern=SHA256_PATTERN, description="digest of the trainable tensors")
    issued_at: float = Field(ge=0)
    reason: str = Field("", max_length=500)


class SignedRevertOrder(BaseModel):
    """An order and the experiment key's signature over `order_message(order)` (base64, RSA-PSS/SHA-256)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    order: RevertOrder
    signature: str = Field(min_length=16, max_length=2048)

    def to_bytes(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def from_bytes(cls, data: object) -> SignedRevertOrder:
        """Parse a serialized order (RevertOrderError on anything else)."""
        if not isinstance(data, bytes) or len(data) > MAX_ORDER_BYTES:
            raise RevertOrderError(f"a revert order is a JSON document of at most {MAX_ORDER_BYTES} bytes")
        try:
            return cls.model_validate_json(data)
        except ValidationError as e:
            reasons = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
            raise RevertOrderError(f"malformed revert order: {reasons}") from None


def order_message(order: RevertOrder) -> bytes:
    """The signed bytes: a domain prefix (no access token signature can pass for an order) + canonical JSON."""
    return b"trahiv-revert-order-v1" + json.dumps(order.model_dump(), sort_keys=True, separators=(",", ":")).encode()


def sign_order(private_key: keys.rsa.RSAPrivateKey, order: RevertOrder) -> SignedRevertOrder:
    return SignedRevertOrder(order=order, signature=keys.sign(private_key, order_message(order)).decode())


def verify_order(signed: SignedRevertOrder, experiment_public_key: bytes, run_id: str) -> RevertOrder:
    """The order if it is for `run_id` and signed by the experiment key (OpenSSH); RevertOrderError otherwise."""
    try:
        public_key = keys.load_public_key(experiment_public_key)
    except keys.KeyError_ as e:
        raise RevertOrderError(f"unusable experiment key: {e}") from None
    if not keys.verify(public_key, order_message(signed.order), signed.signature.encode()):
        raise RevertOrderError(f"revert order #{signed.order.revert_id} is not signed by this experiment's key")
    if signed.order.run_id != run_id:
        raise RevertOrderError(f"revert order #{signed.order.revert_id} is for run {signed.order.run_id!r}")
    return signed.order
