"""The auxiliary peer's collector: reads the trainers' `{run_id}_metrics` records from the DHT every few seconds,
aggregates them per collaborative step and per contributor, writes them to the MetricsStore, and logs each step
once to the experiment trackers.

Per collaborative step S (from the records of the peers that reached S):
- loss: the mean of the peers' losses weighted by the samples each contributed to S (peers without a loss skipped);
- samples: the sum of the peers' samples for S; samples/s: the sum of their samples/s; active peers: their count.
Per contributor (keyed by the libp2p peer ID the record names): its samples and seconds in the swarm, summed over
its sessions (a peer that restarts counts from zero again; the collector adds the earlier sessions).

A record names a peer ID but is signed by an RSA key: the first key seen for a peer ID owns it while its record
lives in the DHT; another key claiming the same peer ID meanwhile is ignored (with a warning).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from trahiv.auxiliary.store import MetricsStore
from trahiv.auxiliary.trackers import Tracker
from trahiv.engine.liveness import dht_answer
from trahiv.metrics import MetricsRecord, metrics_key, parse_metrics

logger = logging.getLogger("trahiv.auxiliary")

__all__ = ["Collector", "StepAggregate", "aggregate_step"]

SETTLE_SECONDS = 5.0  # a step goes to the trackers (once) when no new record for it arrived for this long
KEEP_STEPS = 64  # steps kept in memory behind the newest one (later records for older steps only count for totals)


@dataclass
class StepAggregate:
    step: int
    time: float
    loss: float | None
    active_peers: int
    samples_per_second: float
    samples: int

    def values(self) -> dict[str, float]:
        """What the trackers log for this step."""
        values = {
            "swarm/active_peers": float(self.active_peers),
            "swarm/samples_per_second": self.samples_per_second,
            "swarm/samples": float(self.samples),
        }
        if self.loss is not None:
            values["swarm/loss"] = self.loss
        return values


def aggregate_step(step: int, records: list[MetricsRecord]) -> StepAggregate:
    """The swarm's view of one collaborative step from the records of the peers that reached it."""
    with_loss = [(float(r.loss), int(r.step_samples)) for r in records if r.loss is not None]
    weight = sum(samples for _, samples in with_loss)
    loss: float | None = None
    if weight > 0:
        loss = sum(value * samples for value, samples in with_loss) / weight
    elif with_loss:
        loss = sum(value for value, _ in with_loss) / len(with_loss)
    return StepAggregate(
        step=step,
        time=max(r.time for r in records),
        loss=loss,
        active_peers=len(records),
        samples_per_second=sum(r.samples_per_second for r in records),
        samples=sum(r.step_samples for r in records),
    )


@dataclass
class _Contributor:
    owner: bytes  # the RSA subkey of the session currently counted
    base_samples: int = 0  # from earlier sessions
    base_seconds: float = 0.0
    last: MetricsRecord | None = None


@dataclass
class _Step:
    records: dict[str, MetricsRecord] = field(default_factory=dict)  # by peer ID
    changed_at: float = 0.0
    logged: bool = False


class Collector:
    """Polls the DHT in a thread (`start()` / `stop()`), or step by step with `poll()` (tests, the aux peer)."""

    def __init__(
        self,
        dht: Any,
        run_id: str,
        store: MetricsStore,
        trackers: list[Tracker] | None = None,
        *,
        period: float = 2.0,
        settle: float = SETTLE_SECONDS,
    ):
        self.dht, self.run_id, self.store, self.trackers = dht, run_id, store, list(trackers or [])
        self.period, self.settle = period, settle
        self._contributors: dict[str, _Contributor] = {}
        self._steps: dict[int, _Step] = {}
        # steps recorded before this start are history: never rewritten nor logged again
        self.history_until = max((row["step"] for row in store.steps(limit=1)), default=0)
        self._final_until = self.history_until  # steps up to here are final (history, or dropped from memory)
        self._sessions = store.sessions()
        self._warned: set[tuple[str, bytes]] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.polls = self.errors = 0

    # --- the loop --------------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="trahiv-collector", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop polling, read the records once more (within `timeout`: the trainers' last records, published as they
        left, when the aux peer is stopped right after them, as `trahiv demo` stops it), and log every step."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if not self._thread.is_alive():  # (a poll still waiting for the DHT: no second one)
                try:
                    self.poll(timeout=timeout)
                except Exception as e:  # the DHT may be gone already: the store keeps the last poll's steps
                    logger.debug(f"Reading the metrics as the aux peer stops failed: {e!r}")
        self.flush()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
            except Exception as e:  # a bad record or a DHT hiccup must never stop the aux peer
                self.errors += 1
                logger.warning(f"Collecting metrics failed: {e!r}", exc_info=logger.isEnabledFor(logging.DEBUG))
            self._stop.wait(self.period)

    def poll(self, now: float | None = None, timeout: float | None = None) -> None:
        """Read the records once, update the store, and log the steps that settled; with a `timeout`, an error if the
        DHT does not answer within it or its process has ended."""
        if timeout is None:
            found = self.dht.get(metrics_key(self.run_id), latest=True)
        else:
            request = self.dht.get(metrics_key(self.run_id), latest=True, return_future=True)
            found = dht_answer(self.dht, request, timeout)
        records = parse_metrics(found.value if found is not None else None)
        self.ingest(records, now=time.monotonic() if now is None else now)
        self.polls += 1

    def flush(self) -> None:
        """Log every step not logged yet (at stop), then close the trackers."""
        self._log_settled(now=float("inf"))
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception as e:
                logger.warning(f"Closing a tracker failed: {e!r}")
        self.trackers = []

    # --- aggregation ------------------------------------------------------------------------------------------

    def ingest(self, records: dict[bytes, MetricsRecord], now: float) -> None:
        live_owners: dict[str, set[bytes]] = {record.peer_id: set() for record in records.values()}
        for subkey, record in records.items():
            live_owners[record.peer_id].add(subkey)
        changed: set[int] = set()
        for subkey, record in sorted(records.items(), key=lambda item: item[1].time):
            if not self._owns(subkey, record, live_owners[record.peer_id]):
                continue
            if self._update_contributor(subkey, record) and record.step > self._final_until:
                step = self._steps.setdefault(record.step, _Step())
                if step.records.get(record.peer_id) != record:
                    step.records[record.peer_id] = record
                    step.changed_at = now
                    changed.add(record.step)
        for number in sorted(changed):
            aggregate = aggregate_step(number, list(self._steps[number].records.values()))
            self.store.add_step(**vars(aggregate))
        self._log_settled(now)
        newest = max(self._steps, default=0)
        for number in [n for n, s in self._steps.items() if n < newest - KEEP_STEPS and s.logged]:
            del self._steps[number]
            self._final_until = max(self._final_until, number)

    def _owns(self, subkey: bytes, record: MetricsRecord, live: set[bytes]) -> bool:
        """Whether `subkey` may speak for `record.peer_id` (first key seen keeps it while its record lives)."""
        known = self._contributors.get(record.peer_id)
        if known is None or known.owner == subkey or known.owner not in live:
            return True
        if (record.peer_id, subkey) not in self._warned:
            self._warned.add((record.peer_id, subkey))
            logger.warning(
                f"Ignoring metrics for peer {record.peer_id} signed by another key than its records so far (step "
                f"{record.step}; key {_key_id(subkey)}, its records' key {_key_id(known.owner)}; "
                f"{len(live)} live keys claim this peer)"
            )
        return False

    def _update_contributor(self, subkey: bytes, record: MetricsRecord) -> bool:
        """Count a new record for its contributor; False if it was already counted."""
        peer = self._contributors.get(record.peer_id)
        if peer is None:
            peer = self._contributors[record.peer_id] = self._resume_contributor(subkey, record)
        elif peer.last is not None and peer.owner == subkey and record.time <= peer.last.time:
            return False
        elif peer.owner != subkey or (peer.last is not None and record.samples < peer.last.samples):
            if peer.last is not None:  # a new session of this peer: keep what the earlier ones contributed
                peer.base_samples += peer.last.samples
                peer.base_seconds += peer.last.seconds
        peer.owner, peer.last = subkey, record
        self.store.upsert_contributor(
            record.peer_id,
            name=record.name,
            device=record.device,
            samples=peer.base_samples + record.samples,
            seconds=peer.base_seconds + record.seconds,
            last_seen=record.time,
            base_samples=peer.base_samples,
            base_seconds=peer.base_seconds,
        )
        return True

    def _resume_contributor(self, subkey: bytes, record: MetricsRecord) -> _Contributor:
        """A contributor first seen since this start: continue the totals stored before a restart."""
        if record.peer_id not in self._sessions:
            return _Contributor(owner=subkey)
        base_samples, base_seconds, samples, seconds = self._sessions[record.peer_id]
        if record.samples >= samples - base_samples:  # the session stored last is still running
            return _Contributor(owner=subkey, base_samples=base_samples, base_seconds=base_seconds)
        return _Contributor(owner=subkey, base_samples=samples, base_seconds=seconds)  # a new session since

    def _log_settled(self, now: float) -> None:
        for number in sorted(self._steps):
            step = self._steps[number]
            if not step.logged and step.records and now - step.changed_at >= self.settle:
                step.logged = True
                values = aggregate_step(number, list(step.records.values())).values()
                for tracker in self.trackers:
                    tracker.log(number, values)


def _key_id(subkey: bytes) -> str:
    """A short, stable name of a record's signing key (its subkey) for the logs."""
    return hashlib.sha256(subkey).hexdigest()[:10]
