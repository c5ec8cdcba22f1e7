"""Robust aggregation: what a reducer makes of the senders' copies of one part (engine-free; the reducer that calls it
is `trahiv.engine.averagers.RobustTensorPartReducer`).

In hivemind's butterfly all-reduce every peer reduces one slice ("part") of the averaged tensors: all senders stream
their copy of that part to it, and it returns the aggregate. hivemind 1.1.12 sums the parts as they arrive, so one
sender with `[nan, 1e30]` poisons every peer. Here the reducer buffers every sender's copy of the current part and
aggregates once all expected copies arrived:

- always: a copy with a non-finite value, a wrong shape, or a weight that is not finite and >= 0 is excluded from the
  round (weight 0) and its sender is logged (WARNING, by peer ID, once per round);
- then the weighted mean (hivemind's result) or CenteredClip (Karimireddy et al. 2020), which bounds how far one
  sender can move the aggregate, whatever it sends.

What peers receive is still decoded by hivemind's protobuf messages and compression deserializers: nothing is unpickled.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from hivemind.p2p import PeerID
from hivemind.utils.timed_storage import ValueWithExpiration

from trahiv import protocol

logger = logging.getLogger("trahiv.averaging")
WEIGHT_SLACK = 1.25  # a gradient round's weight may exceed the samples a peer reported by this factor (staleness)
MAX_EXTRAPOLATION_S = 60.0  # reported samples are extrapolated at the reported rate for at most this long

__all__ = [
    "MEAN",
    "Aggregation",
    "aggregate",
    "all_finite",
    "centered_clip",
    "optimizer_state_mismatch",
    "rejection_reason",
    "reported_sample_caps",
    "state_rejection_reason",
    "weighted_mean",
    "weighted_median",
]


@dataclass(frozen=True)
class Aggregation:
    """How a reducer combines the senders' copies of one part: `mean` (hivemind's weighted mean) or `centered_clip`
    (`n_iters` clipping iterations with radius `tau`, started from the weighted coordinate median, each copy's weight
    capped at the median copy's)."""

    name: Literal["mean", "centered_clip"] = "mean"
    tau: float = 1.0
    n_iters: int = 20

    def __post_init__(self) -> None:
        if self.name not in ("mean", "centered_clip"):
            raise ValueError(f"unknown aggregation {self.name!r}: use 'mean' or 'centered_clip'")
        if not (self.tau > 0 and self.tau != float("inf")) or self.n_iters < 1:
            raise ValueError(f"aggregation needs a finite tau > 0 and n_iters >= 1, got {self}")


MEAN = Aggregation()


def weighted_mean(parts: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """sum_i w_i x_i / sum_i w_i, summed in the given order like hivemind's streaming reducer."""
    total = parts[0] * weights[0]
    for part, weight in zip(parts[1:], weights[1:], strict=True):
        total.add_(part, alpha=weight)
    return total.div_(sum(weights))


def weighted_median(stacked: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Coordinate-wise weighted median of `stacked` [senders, ...] (the lower one on a tie)."""
    values, order = stacked.sort(dim=0)
    cumulative = weights[order].cumsum(dim=0)
    below_half = (cumulative < cumulative[-1:] / 2).sum(dim=0, keepdim=True)
    return values.gather(0, below_half.clamp_(max=stacked.shape[0] - 1)).squeeze(0)


def centered_clip(parts: Sequence[torch.Tensor], weights: Sequence[float], tau: float, n_iters: int) -> torch.Tensor:
    """CenteredClip: v <- v + sum_i w_i clip(x_i - v, tau) / sum_i w_i with clip(z, tau) = z min(1, tau / ||z||),
    `n_iters` times from the weighted coordinate median (stops early once v moves by less than 1e-6 tau).

    No copy weighs more than the median copy (the lower one for an even count): a peer's weight is the samples it
    says it accumulated, which a Byzantine peer can inflate up to what it reports, or reach honestly by being the
    fastest in a round. With half the total weight it would be the weighted median of every coordinate where its
    values are extreme, and pull v to itself; capped, a minority of peers never outweighs the others."""
    stacked = torch.stack([part.reshape(-1).float() for part in parts])
    w = torch.tensor(weights, dtype=stacked.dtype)
    w = torch.minimum(w, w.median())
    w = w / w.sum()
    center = weighted_median(stacked, w)
    deltas = torch.empty_like(stacked)
    for _ in range(n_iters):
        torch.sub(stacked, center, out=deltas)
        norms = torch.linalg.vector_norm(deltas, dim=1)
        coefficients = w * (tau / norms.clamp_min(1e-30)).clamp_(max=1.0)
        if not bool(torch.isfinite(norms).all()):  # x_i - v overflowed: that copy's clipped contribution is 0
            deltas[~torch.isfinite(norms)] = 0.0
        step = coefficients @ deltas
        center += step
        if float(step.norm()) <= 1e-6 * tau:
            break
    return center.reshape(parts[0].shape).to(parts[0].dtype)


def aggregate(parts: Sequence[torch.Tensor], weights: Sequence[float], aggregation: Aggregation = MEAN) -> torch.Tensor:
    """The aggregate of usable copies of one part (finite values, weights finite and >= 0, positive total weight)."""
    if aggregation.name == "centered_clip" and len(parts) > 1:
        return centered_clip(parts, weights, aggregation.tau, aggregation.n_iters)
    return weighted_mean(parts, weights)


def rejection_reason(part: torch.Tensor, weight: float, shape: torch.Size) -> str | None:
    """Why a received copy of a part must not be aggregated, or None if it may."""
    if not (weight >= 0 and weight != float("inf")):  # also catches NaN
        return f"invalid weight {weight!r}"
    if part.shape != shape:
        return f"shape {tuple(part.shape)} instead of {tuple(shape)}"
    if not all_finite(part):
        return "non-finite values (nan/inf)"
    return None


def all_finite(values: torch.Tensor) -> bool:
    """Whether every value is finite, in one pass: the smallest and the largest are (a NaN makes both NaN), with no
    overflow to mistake for a non-finite value. The float64 sum used before took 3.6 ms per 2M float32 values on one
    thread of this machine (this: 0.46 ms); in a profile of a peer's 8-bit ring rounds (py-spy, 4 peers) it held 17%
    of the ring's samples: every received part and the peer's own are checked."""
    if values.numel() == 0:
        return True
    low, high = torch.aminmax(values)
    return math.isfinite(float(low)) and math.isfinite(float(high))


# --- the reducer --------------------------------------------------------------------------------------------------


def reported_sample_caps(
    records: Any,
    peers: Sequence[PeerID],
    now: float,
    *,
    round_epoch: int | None = None,
    step_cap: float | None = None,
) -> dict[PeerID, float]:
    """The most each peer of a group may weigh in a gradient round, from the swarm's progress records (hivemind's
    `{run_id}_progress`: samples accumulated, samples/s, time): WEIGHT_SLACK x (reported samples, extrapolated at the
    reported rate for at most MAX_EXTRAPOLATION_S) + 1. A peer without a record gets the smallest cap of the others;
    several records naming one peer count as the largest (a forged record cannot lower another peer's cap).

    Given `step_cap` (WEIGHT_SLACK x target_batch_size + 1: what a whole step holds), no cap exceeds it: a record's
    samples or rate, forged or extrapolated, cannot lift a peer above the step. Extrapolated alone, a record read 1 s
    before an attacker's round let its inflated weight (8 samples claimed as 8,000) through as 99.8, over the step's 64
    samples (`test_byzantine.py`, once); a record claiming a huge rate lifted its cap without bound.

    Given the round's step (`round_epoch`, compared modulo 2**16 as matchmaking keys carry it), a record of a later
    step says what its peer accumulated since it finished the round's step, not for it: such a peer is capped at
    `step_cap`, or the largest cap of the others. Peers that finished a round before another peer of it began
    (background averaging, a slow peer) were clamped to a few samples: 16 to 1.2 in
    benchmarks/compute_utilization.py."""
    reported: dict[bytes, float] = {}
    moved_on: set[bytes] = set()
    entries = records.items() if isinstance(records, dict) else ()
    for _, entry in entries:
        value = entry.value if isinstance(entry, ValueWithExpiration) else None
        if not isinstance(value, dict) or not isinstance(value.get("peer_id"), bytes):
            continue
        fields = [value.get(name) for name in ("samples_accumulated", "samples_per_second", "time")]
        if not all(
            isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x >= 0 for x in fields
        ):
            continue
        epoch = value.get("epoch")
        if round_epoch is not None and isinstance(epoch, int) and 0 < (epoch - round_epoch) % 2**16 < 2**15:
            moved_on.add(value["peer_id"])
            continue
        samples, rate, at = (float(x) for x in fields)  # type: ignore[arg-type]
        elapsed = min(max(now - at, 0.0), MAX_EXTRAPOLATION_S)
        estimate = samples + rate * elapsed
        reported[value["peer_id"]] = max(reported.get(value["peer_id"], 0.0), estimate)
    caps = {peer: WEIGHT_SLACK * reported[peer.to_bytes()] + 1 for peer in peers if peer.to_bytes() in reported}
    if step_cap is not None:
        caps = {peer: min(cap, step_cap) for peer, cap in caps.items()}
    moved = [peer for peer in peers if peer.to_bytes() in moved_on]
    if moved:
        cap = step_cap if step_cap is not None else max(caps.values(), default=math.inf)
        caps.update({peer: max(caps.get(peer, 0.0), cap) for peer in moved})
    if not caps:
        return {}
    smallest = min(caps.values())
    return {peer: caps.get(peer, smallest) for peer in peers}


def optimizer_state_mismatch(ours: Sequence[str], served: Any, served_tensors: int) -> str | None:
    """Why a served optimizer state (hivemind's flat form, `dump_optimizer_state`: one entry per leaf of the optimizer's
    state_dict, a tensor or a value) cannot be loaded into this peer's optimizer, whose leaves are of the kinds `ours`
    ("tensor" / "value"); None if it can. hivemind packs the served leaves into this optimizer's structure: with fewer
    it raised, and its Optimizer retried the download at once, for good (2,836 tracebacks in 28 s from a plain hivemind
    peer's SGD state, tests/test_wire_protocol.py; trahiv now stops after LOAD_ATTEMPTS); with more, values landed in
    the wrong places."""
    if not isinstance(served, list) or not all(isinstance(entry, dict) for entry in served):
        return "it has no optimizer state"
    kinds = [entry.get("type") for entry in served]
    if kinds != list(ours):
        return (
            f"its optimizer state has {kinds.count('tensor')} tensors and {kinds.count('value')} values, this peer's "
            f"optimizer {list(ours).count('tensor')} and {list(ours).count('value')} (another optimizer, or other "
            "optimizer settings)"
        )
    for entry in served:
        if entry["type"] == "tensor" and not (type(entry.get("index")) is int and 0 <= entry["index"] < served_tensors):
            return f"its optimizer state refers to tensor {entry.get('index')!r} of {served_tensors}"
        if entry["type"] == "value" and "value" not in entry:
            return "its optimizer state has a value without one"
    return None


def state_rejection_reason(
    metadata: Any, tensors: Sequence[torch.Tensor], expected: Sequence[tuple] | None
) -> str | None:
    """Why a downloaded state (hivemind's `(metadata, tensors)`) must not be loaded, or None if it may be."""
    if not isinstance(metadata, dict):
        return f"metadata is a {type(metadata).__name__}, not a dict"
    served = metadata.get("protocol")
    if served != protocol.WIRE_PROTOCOL:  # (stamped by every trahiv averager that serves: VersionedSchema)
        if served is None:
            return "it carries no wire protocol (a plain hivemind peer, or a trahiv from before protocol 2)"
        return f"it is of wire protocol {served!r}, this peer's is {protocol.WIRE_PROTOCOL} (another trahiv version)"
    epoch = metadata.get("epoch")
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
        return f"epoch {epoch!r} is not a non-negative integer"
    if expected is not None and len(tensors) != len(expected):
        return f"{len(tensors)} tensors where this model has {len(expected)}"
    for index, tensor in enumerate(tensors):
        if expected is not None and tuple(tensor.shape) != tuple(expected[index]):
            return f"tensor {index} has shape {tuple(tensor.shape)}, expected {tuple(expected[index])}"
        if tensor.is_floating_point() and not all_finite(tensor):
            return f"tensor {index} holds non-finite values"
    return None
