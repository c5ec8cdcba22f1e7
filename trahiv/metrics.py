"""The per-peer metrics record that trainers publish to the DHT at each collaborative step, and its strict schema.

Key `{run_id}_metrics`, one subkey per peer: the peer's RSA public key, so hivemind's `RSASignatureValidator` lets a
peer write only its own entry. A `SchemaValidator` (strict pydantic-v1 types, as hivemind requires) rejects malformed
records at every validating DHT node, and readers parse every record again: a bad one is dropped with a warning,
never raised. Shared by the trainers (`MetricsPublisher`) and the auxiliary peer (`read_metrics`).
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any, TypeAlias

import pydantic.v1 as pydantic
from hivemind.dht.schema import BytesWithPublicKey, RSASignatureValidator, SchemaValidator
from hivemind.utils import get_dht_time

logger = logging.getLogger("trahiv.metrics")

__all__ = [
    "METRICS_TTL",
    "MetricsPublisher",
    "MetricsRecord",
    "add_metrics_validators",
    "device_kind",
    "metrics_key",
    "parse_metrics",
]

METRICS_TTL = (
    120.0  # seconds a record stays in the DHT (readers poll every few seconds; see trahiv.auxiliary.collector)
)
MAX_COUNT = 2**53  # counts beyond this lose precision as JSON numbers
MAX_FLOAT = 1e15
NAME_PATTERN = r"^[^\x00-\x1f\x7f]{1,32}\Z"  # printable, at most 32 characters
DEVICE_PATTERN = r"^[^\x00-\x1f\x7f]{1,64}\Z"
PEER_ID_PATTERN = r"^[1-9A-HJ-NP-Za-km-z]{32,128}\Z"  # a libp2p peer ID in base58


def _finite(value: float | None) -> float | None:
    if value is not None and not math.isfinite(value):
        raise ValueError("must be finite")
    return value


# strict types: hivemind's SchemaValidator rejects any record that would need a type conversion
if TYPE_CHECKING:
    Count: TypeAlias = int
    Amount: TypeAlias = float
    Loss: TypeAlias = float
    PeerIdText: TypeAlias = str
    DeviceText: TypeAlias = str
    NameText: TypeAlias = str
else:
    Count = pydantic.conint(strict=True, ge=0, le=MAX_COUNT)
    Amount = pydantic.confloat(strict=True, ge=0, le=MAX_FLOAT)
    Loss = pydantic.confloat(strict=True, ge=-MAX_FLOAT, le=MAX_FLOAT)
    PeerIdText = pydantic.constr(strict=True, regex=PEER_ID_PATTERN)
    DeviceText = pydantic.constr(strict=True, regex=DEVICE_PATTERN)
    NameText = pydantic.constr(strict=True, regex=NAME_PATTERN)


class MetricsRecord(pydantic.BaseModel):
    """What one trainer reports when the swarm completes collaborative step `step`."""

    peer_id: PeerIdText
    step: Count
    loss: Loss | None  # mean over its local steps since its previous record; may be negative
    step_samples: Count  # samples this peer contributed to `step`
    samples: Count  # samples contributed since the peer started
    samples_per_second: Amount
    seconds: Amount  # seconds in the swarm since the peer started
    device: DeviceText
    name: NameText | None
    time: Amount  # DHT time of the record

    class Config:
        extra = pydantic.Extra.forbid

    _finite_floats = pydantic.validator("loss", "samples_per_second", "seconds", "time", allow_reuse=True)(_finite)


class MetricsSchema(pydantic.BaseModel):
    """The DHT schema of `{run_id}_metrics` (with the SchemaValidator's prefix = run_id)."""

    metrics: dict[BytesWithPublicKey, MetricsRecord | None]  # type: ignore[valid-type]  # hivemind's alias


def metrics_key(run_id: str) -> str:
    return f"{run_id}_metrics"


def add_metrics_validators(dht: Any, run_id: str) -> bytes:
    """Make this DHT peer validate `{run_id}_metrics` records; return the subkey this process writes its own under
    (its process-wide RSA public key, the same one hivemind's progress tracker signs with)."""
    signature = RSASignatureValidator()
    dht.add_validators([SchemaValidator(MetricsSchema, prefix=run_id), signature])
    return signature.local_public_key


def parse_metrics(entries: Any) -> dict[bytes, MetricsRecord]:
    """Well-formed records by subkey from what `dht.get(metrics_key(run_id), latest=True).value` returned; every
    malformed entry is dropped with a warning."""
    records: dict[bytes, MetricsRecord] = {}
    if not isinstance(entries, dict):
        if entries is not None:
            logger.warning(f"Dropping metrics: expected a dictionary of records, got {type(entries).__name__}")
        return records
    for subkey, entry in entries.items():
        value = getattr(entry, "value", None)
        try:
            if not isinstance(subkey, bytes) or not RSASignatureValidator._PUBLIC_KEY_RE.fullmatch(subkey):
                raise ValueError("the subkey is not an RSA public key")
            records[subkey] = MetricsRecord.parse_obj(value)
        except (pydantic.ValidationError, ValueError, TypeError) as e:
            logger.warning(f"Dropping a malformed metrics record: {str(e)[:300]}")
    return records


def device_kind(device: Any) -> str:
    """'cpu', 'cuda:NVIDIA H100 80GB HBM3', 'mps', ... for a torch device."""
    import torch

    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return f"cuda:{torch.cuda.get_device_name(device)}"[:64]
    return device.type[:64]


class MetricsPublisher:
    """A trainer's side: stores its record under its own key at each collaborative step, without waiting."""

    def __init__(self, dht: Any, run_id: str, *, peer_id: str, device: str = "cpu", name: str | None = None):
        self.dht, self.key, self.peer_id, self.device, self.name = dht, metrics_key(run_id), peer_id, device, name
        self.subkey = add_metrics_validators(dht, run_id)
        self.last_record: MetricsRecord | None = None
        self._pending: Any = None

    def publish(
        self, *, step: int, loss: float | None, step_samples: int, samples: int, samples_per_second: float,
        seconds: float,
    ) -> MetricsRecord:  # fmt: skip
        """Validate and store this peer's record in the background (the returned record is what was sent)."""
        record = MetricsRecord(
            peer_id=self.peer_id,
            step=int(step),
            loss=None if loss is None or not math.isfinite(loss) else float(loss),
            step_samples=int(step_samples),
            samples=int(samples),
            samples_per_second=float(samples_per_second),
            seconds=float(seconds),
            device=self.device,
            name=self.name,
            time=float(get_dht_time()),
        )
        self._pending = self.dht.store(
            self.key,
            subkey=self.subkey,
            value=record.dict(),
            expiration_time=get_dht_time() + METRICS_TTL,
            return_future=True,
        )
        self.last_record = record
        return record

    def flush(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the last record to be stored (before leaving the swarm)."""
        if self._pending is None:
            return True
        try:
            return bool(self._pending.result(timeout=timeout))
        except Exception as e:  # leaving must not raise over a metrics record
            logger.debug(f"The last metrics record was not stored: {e!r}")
            return False
