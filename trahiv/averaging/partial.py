"""No silent averaging failures: partial rounds are detected, reported and counted; waits have payload-based deadlines.

In hivemind 1.1.12 an all-reduce round in which a reducer failed (its stream broke or timed out) leaves the affected
slice of every peer's tensors at its local values, and a sender that failed is silently dropped from the slices it had
not sent yet; `step()` still returns success. Here every round ends with a `RoundReport` (from this peer's view):

- `local_fallback`: peer -> values of *this* peer's tensors that kept their local values because that peer, as a
  reducer, did not return them (a broken stream, a timeout, no usable copy);
- `missing_senders`: peer -> values that *this* peer reduced without that peer's contribution (it stopped sending);
- `error`: the round failed outright (hivemind then falls back to local values, e.g. local gradients).

A round is complete only when all three are empty. Handling is deliberate: un-averaged values keep their local values
(hivemind's fallback), the round is logged at WARNING with the peers and fractions, and it is counted as partial (or
failed), never as complete: see `trahiv.engine.averagers.ReportingMixin` and `Swarm.metrics()`.

Deadlines (`Deadlines`) come from the round's payload and the bandwidth measured in earlier complete rounds: a sender or
reducer that sends nothing for `chunk_timeout` is dropped, and the whole round is bounded by `round_timeout`. A peer
that is counted in a group but never starts costs the others about `2 x chunk_timeout` (seconds), not the engine's
allreduce_timeout (60-120 s, or unbounded).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger("trahiv.averaging")

__all__ = ["Deadlines", "RoundReport", "butterfly_bytes", "compressed_sizes", "payload_bytes"]


@dataclass(frozen=True)
class RoundReport:
    """One all-reduce round as this peer saw it (values are counts of tensor elements)."""

    peers: tuple[str, ...]
    total_values: int
    seconds: float
    payload_bytes: int
    local_fallback: dict[str, int] = field(default_factory=dict)
    missing_senders: dict[str, int] = field(default_factory=dict)
    error: str | None = None
    reasons: dict[str, str] = field(default_factory=dict)  # peer -> why its exchange with this peer failed
    unaveraged: str = "kept local"  # what this peer's values left unaveraged became ('set to zero': DiLoCo's)
    allreduce: str = "butterfly"  # how the round ran: hivemind's butterfly or trahiv's ring (trahiv.engine.ring)

    @property
    def complete(self) -> bool:
        return self.error is None and not self.local_fallback and not self.missing_senders

    @property
    def status(self) -> str:
        return "failed" if self.error is not None else "complete" if self.complete else "partial"

    @property
    def averaged_fraction(self) -> float:
        """Fraction of this peer's values that were averaged with the group (0 for a failed round)."""
        if self.error is not None:
            return 0.0
        return 1.0 - sum(self.local_fallback.values()) / max(self.total_values, 1)

    def describe(self) -> str:
        total = max(self.total_values, 1)
        parts = [
            f"peer {p} did not return {v / total:.1%} of the values ({self.unaveraged})"
            for p, v in self.local_fallback.items()
        ]
        parts += [
            f"peer {p}'s contribution is missing from {v / total:.1%} of the values"
            for p, v in self.missing_senders.items()
        ]
        if self.error is not None:
            parts.append(f"failed: {self.error}")
        parts += [f"peer {p}: {why}" for p, why in self.reasons.items()]
        how = " (ring)" if self.allreduce == "ring" else ""
        return f"{self.status} averaging round with {len(self.peers)} peers{how} in {self.seconds:.2f} s: " + (
            "; ".join(parts) or "every value averaged"
        )


@dataclass
class Deadlines:
    """Bounds on one all-reduce from its payload and the measured bandwidth.

    bandwidth: bytes/s this peer moves in each direction; `assumed_bandwidth` until a complete round was measured,
    then an average of the measured ones (each measured round: butterfly bytes / duration, which includes overheads,
    so it underestimates the link: deadlines err long). A round that timed out halves the estimate.
    """

    assumed_bandwidth: float = 10e6 / 8  # 10 Mbit/s
    floor: float = 5.0  # seconds: no wait is shorter (process start-up, CPU hiccups on a busy machine)
    safety: float = 4.0  # a wait may last this many times the bandwidth-bound time
    measured: float | None = None

    def __post_init__(self) -> None:
        if not (self.assumed_bandwidth > 0 and self.floor > 0 and self.safety >= 1):
            raise ValueError(f"Deadlines need assumed_bandwidth > 0, floor > 0, safety >= 1; got {self}")

    @property
    def bandwidth(self) -> float:
        return self.measured if self.measured is not None else self.assumed_bandwidth

    def chunk_timeout(self, part_bytes: int, group_size: int) -> float:
        """Longest silence of a sender or reducer: one part to each of the others, both ways, shares the link."""
        return self.floor + self.safety * 2 * part_bytes * max(group_size - 1, 1) / self.bandwidth

    def round_timeout(self, payload: int, group_size: int) -> float:
        return 2 * self.floor + self.safety * butterfly_bytes(payload, group_size) / self.bandwidth

    def observe(self, payload: int, group_size: int, seconds: float) -> None:
        rate = butterfly_bytes(payload, group_size) / max(seconds, 1e-3)
        self.measured = rate if self.measured is None else 0.5 * (self.measured + rate)

    def observe_timeout(self) -> None:
        self.measured = self.bandwidth / 2


def butterfly_bytes(payload: int, group_size: int) -> float:
    """Bytes each peer sends (and receives) in a butterfly all-reduce of `payload` bytes: 2 (N - 1) / N x S."""
    return 2 * (group_size - 1) / group_size * payload


def compressed_sizes(
    tensors: Sequence[torch.Tensor], compression: Any, tensor_infos: Sequence[Any] | None
) -> list[int]:
    """The compressed size of each tensor as the engine estimates it when splitting tensors into parts."""
    from hivemind.compression import CompressionInfo, NoCompression

    compression = compression if compression is not None else NoCompression()
    infos = tensor_infos or [CompressionInfo.from_tensor(t, key=i) for i, t in enumerate(tensors)]
    return [
        int(t.numel() * t.element_size() * compression.estimate_compression_ratio(info))
        for t, info in zip(tensors, infos, strict=True)
    ]


def payload_bytes(tensors: Sequence[torch.Tensor], compression: Any, tensor_infos: Sequence[Any] | None) -> int:
    """The compressed size of `tensors` (S in the bound 2 (N - 1) / N x S / B)."""
    return sum(compressed_sizes(tensors, compression, tensor_infos))
