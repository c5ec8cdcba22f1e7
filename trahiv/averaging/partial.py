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
failed), never as complete: see `ReportingMixin.round_counts` and `Swarm.metrics()`.

Deadlines (`Deadlines`) come from the round's payload and the bandwidth measured in earlier complete rounds: a sender or
reducer that sends nothing for `chunk_timeout` is dropped, and the whole round is bounded by `round_timeout`. A peer
that is counted in a group but never starts costs the others about `2 x chunk_timeout` (seconds), not the engine's
allreduce_timeout (60-120 s, or unbounded).
"""

from __future__ import annotations

import asyncio
import logging
import math
import multiprocessing as mp
import queue
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.partition import AllreduceException

from trahiv.averaging.robust import (
    MEAN,
    Aggregation,
    RobustGradientAverager,
    RobustTrainingStateAverager,
    run_robust_allreduce_,
)
from trahiv.averaging.traffic import Traffic, TrafficCountingRunner

logger = logging.getLogger("trahiv.averaging")

__all__ = [
    "Deadlines",
    "PartialRoundRunner",
    "ReportingAverager",
    "ReportingGradientAverager",
    "ReportingMixin",
    "ReportingStateAverager",
    "RobustAverager",
    "RoundReport",
    "compressed_sizes",
    "payload_bytes",
]


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
            f"peer {p} did not return {v / total:.1%} of the values (kept local)"
            for p, v in self.local_fallback.items()
        ]
        parts += [
            f"peer {p}'s contribution is missing from {v / total:.1%} of the values"
            for p, v in self.missing_senders.items()
        ]
        if self.error is not None:
            parts.append(f"failed: {self.error}")
        parts += [f"peer {p}: {why}" for p, why in self.reasons.items()]
        return f"{self.status} averaging round with {len(self.peers)} peers in {self.seconds:.2f} s: " + (
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


class PartialRoundRunner(TrafficCountingRunner):
    """The robust runner that records which reducers failed this peer (`local_fallback`, by peer index) and counts
    the bytes it exchanges (trahiv.averaging.traffic)."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.local_fallback: dict[int, int] = {}
        container = self.tensor_part_container
        register_failed_reducer = container.register_failed_reducer

        def record_failed_reducer(peer_index: int) -> None:
            before = container.failed_size
            register_failed_reducer(peer_index)
            self.local_fallback[peer_index] = self.local_fallback.get(peer_index, 0) + container.failed_size - before

        container.register_failed_reducer = record_failed_reducer  # type: ignore[method-assign]
        self.reasons: dict[str, str] = {}

    async def _communicate_with_peer(self, peer_id: Any) -> None:
        try:
            await super()._communicate_with_peer(peer_id)
        except Exception as e:  # hivemind logs this at DEBUG only: keep it for the round's report
            self.reasons[peer_id.to_base58()] = repr(e) or type(e).__name__
            raise

    async def _ban_sender(self, peer_id: Any) -> None:
        self.reasons.setdefault(peer_id.to_base58(), "stopped sending (or never started) before its deadline")
        await super()._ban_sender(peer_id)

    def missing_senders(self) -> dict[int, int]:
        """sender index -> values this peer reduced without that sender (it stopped or never started sending)."""
        reducer = self.tensor_part_reducer
        missing = {}
        for sender, failed_after in enumerate(reducer.sender_failed_after):
            if failed_after != float("inf"):
                values = sum(math.prod(shape) for shape in reducer.part_shapes[int(failed_after) :])
                if values:
                    missing[sender] = values
        return missing

    def report(self, seconds: float, payload: int, error: BaseException | None) -> RoundReport:
        names = [peer.to_base58() for peer in self.ordered_peer_ids]
        senders = [peer.to_base58() for peer in self.sender_peer_ids]
        return RoundReport(
            peers=tuple(names),
            total_values=self.tensor_part_container.total_size,
            seconds=seconds,
            payload_bytes=payload,
            local_fallback={names[i]: v for i, v in self.local_fallback.items() if v},
            missing_senders={senders[i]: v for i, v in self.missing_senders().items()},
            error=None if error is None else repr(error),
            reasons=dict(self.reasons),
        )


class ReportingMixin:
    """For hivemind averagers: run rounds with `PartialRoundRunner` under `Deadlines`, report every round.

    Reports travel from the averager process to this one through a queue; `round_reports()` collects them and
    `round_counts` counts complete / partial / failed rounds. Call `_init_reporting()` before the averager starts.
    """

    runner_cls: type[PartialRoundRunner] = PartialRoundRunner  # tests inject faults through a subclass
    aggregation: Aggregation
    deadlines: Deadlines | None
    reports: list[RoundReport]
    round_counts: dict[str, int]
    traffic: Traffic
    _report_queue: Any

    def _init_reporting(self, deadlines: Deadlines | None, aggregation: Aggregation = MEAN) -> None:
        self.aggregation, self.deadlines = aggregation, deadlines
        self.reports, self.round_counts = [], {"complete": 0, "partial": 0, "failed": 0}
        self._report_queue = mp.get_context("fork").SimpleQueue()
        self.traffic = Traffic()  # averaging_bytes_sent / averaging_bytes_received, counted in the averager process

    def round_reports(self) -> list[RoundReport]:
        """Reports of rounds finished since the last call (in the process that created the averager)."""
        new = []
        while not self._report_queue.empty():
            try:
                new.append(RoundReport(**self._report_queue.get()))
            except (queue.Empty, EOFError, OSError):
                break
        for report in new:
            self.round_counts[report.status] += 1
        self.reports = (self.reports + new)[-100:]
        return new

    async def _run_allreduce_inplace_(
        self, tensors: Sequence[torch.Tensor], group_info: Any, group_id: bytes | None = None, **kwargs: Any
    ) -> None:
        group_size = len(group_info.peer_ids)
        sizes = compressed_sizes(tensors, kwargs.get("compression"), kwargs.get("tensor_infos"))
        payload, timeout = sum(sizes), None
        if self.deadlines is not None:  # parts never span tensors: none is larger than the largest tensor
            part_bytes = min(kwargs.get("part_size_bytes", 2**19), max(sizes, default=1))
            chunk = self.deadlines.chunk_timeout(part_bytes, group_size)
            if kwargs.get("sender_timeout") is None:
                kwargs["sender_timeout"], kwargs["reducer_timeout"] = chunk, 2 * chunk
            timeout = self.deadlines.round_timeout(payload, group_size)
        if issubclass(self.runner_cls, TrafficCountingRunner):
            kwargs.setdefault("traffic", self.traffic)
        started, error = time.perf_counter(), None
        try:
            run = super()._run_allreduce_inplace_(  # type: ignore[misc]
                tensors, group_info, group_id=group_id, runner_cls=self.runner_cls, **kwargs
            )
            await asyncio.wait_for(run, timeout)
        except TimeoutError as e:
            error = AllreduceException(f"all-reduce did not finish within its deadline of {timeout:.1f} s")
            if self.deadlines is not None:
                self.deadlines.observe_timeout()
            raise error from e
        except BaseException as e:
            error = e
            raise
        finally:
            self._report_round(group_id or group_info.group_id, time.perf_counter() - started, payload, error)

    def _report_round(self, group_id: bytes, seconds: float, payload: int, error: BaseException | None) -> None:
        averager: Any = self
        future = averager._running_groups.get(group_id)
        if (
            future is None
            or not future.done()
            or future.cancelled()
            or not isinstance(future.result(), PartialRoundRunner)
        ):
            return  # the round failed before it started: hivemind's step reports that failure
        report = future.result().report(seconds, payload, error)
        if report.complete and self.deadlines is not None:
            self.deadlines.observe(payload, len(report.peers), seconds)
        (logger.debug if report.complete else logger.warning)(report.describe())
        self._report_queue.put(asdict(report))


class RobustAverager(DecentralizedAverager):
    """hivemind's DecentralizedAverager with trahiv's robust all-reduce (every peer weighs `weight`)."""

    aggregation: Aggregation

    async def _run_allreduce_inplace_(self, tensors: Sequence[torch.Tensor], group_info: Any, **kwargs: Any) -> None:
        await run_robust_allreduce_(self, self.aggregation, tensors, group_info, **kwargs)

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        return DecentralizedAverager._get_handle_name(namespace, method_name)


class ReportingAverager(ReportingMixin, RobustAverager):
    """A generic averager (any tensors) with robust aggregation, deadlines and round reports."""

    def __init__(self, *args: Any, deadlines: Deadlines | None = None, aggregation: Aggregation = MEAN, **kwargs: Any):
        self._init_reporting(deadlines if deadlines is not None else Deadlines(), aggregation)
        super().__init__(*args, **kwargs)


class ReportingGradientAverager(ReportingMixin, RobustGradientAverager):
    """trahiv's robust gradient averager with deadlines and round reports."""

    def __init__(self, *args: Any, deadlines: Deadlines | None = None, aggregation: Aggregation = MEAN, **kwargs: Any):
        self._init_reporting(deadlines if deadlines is not None else Deadlines(), aggregation)
        super().__init__(*args, aggregation=aggregation, **kwargs)


class ReportingStateAverager(ReportingMixin, RobustTrainingStateAverager):
    """trahiv's robust state averager (parameters, optimizer statistics) with deadlines and round reports."""

    def __init__(self, *args: Any, deadlines: Deadlines | None = None, aggregation: Aggregation = MEAN, **kwargs: Any):
        self._init_reporting(deadlines if deadlines is not None else Deadlines(), aggregation)
        super().__init__(*args, aggregation=aggregation, **kwargs)

    def step(
        self, *args: Any, delay_optimizer_step: bool = False, delay_averaging: bool | None = None, **kwargs: Any
    ) -> Any:
        """hivemind 1.1.12 asserts that a delayed optimizer step comes with delayed parameter averaging, even in a step
        that does not average, and trahiv refuses delayed parameter averaging (it corrupts parameters): so
        `delay_optimizer_step` crashed at the first collaborative step. Here a step without an averaging round
        delays its optimizer step (there is no averaging to delay), and a step with one runs both in the foreground."""
        if delay_optimizer_step and delay_averaging is not None and not delay_averaging:
            if kwargs.get("averaging_round"):
                delay_optimizer_step = False
            else:
                delay_averaging = True
        return super().step(*args, delay_optimizer_step=delay_optimizer_step, delay_averaging=delay_averaging, **kwargs)
