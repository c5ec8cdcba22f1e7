"""The collaborative optimizer behind the boundary: hivemind 1.1.12's Optimizer and ProgressTracker with trahiv's
protocol fixes, and the one place where a peer's averagers are built (`grad_averager_factory`, `state_averager_cls`).

Protocol (what hivemind 1.1.12 does differently, and why it matters for small, uneven swarms):
- a step advances only once the swarm *reported* target_batch_size samples (hivemind also advances on its ETA);
- progress records are announced before the first local step, so a fast peer's first step counts the others;
- matchmaking is keyed by the collaborative step (`EpochKeyedMatchmaking`): a peer at step k never averages into k+1;
- a peer that the swarm left behind (its round is over without it) downloads the swarm's state instead of stepping
  alone with local gradients;
- a record far ahead of this peer is checked at once by downloading the swarm's state (a 2-peer swarm has no quorum to
  confirm it); forged records cannot move the swarm (see `SwarmProgressTracker`);
- a failed round steps with this peer's gradients (`RobustGradientAverager`), and is counted as failed.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import hivemind
from hivemind.averaging.control import AveragingStage
from hivemind.optim.progress_tracker import LocalTrainingProgress, ProgressTracker
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.p2p import PeerID
from hivemind.utils import ValueWithExpiration, get_dht_time

from trahiv.averaging import Aggregation, Deadlines
from trahiv.config import OptimizerConfig
from trahiv.connectivity import unreachable_peers_future
from trahiv.engine import fixes
from trahiv.engine.averagers import (
    AuxiliaryStateAverager,
    OverlappedAccumulation,
    ReportingGradientAverager,
    ReportingMixin,
    ReportingStateAverager,
    RobustGradientAverager,
    RobustPowerSGDGradientAverager,
    RobustTrainingStateAverager,
)
from trahiv.engine.gate import gated
from trahiv.engine.liveness import DHTProcessEnded, dht_answer
from trahiv.engine.state import download_state, load_state
from trahiv.engine.tell import told
from trahiv.protocol import (
    MIN_RATE,
    Contribution,
    expected_in_round,
    fills_shortfall,
    missed_round,
    own_share_done,
    peer_tiebreak,
    progress_key,
    progress_prefix,
    seconds_to_target,
    share_of_target,
    silent_too_long,
    state_priority,
    stopped_at_share,
    trusted_epoch,
)

if TYPE_CHECKING:
    from trahiv.auth.gate import AuthGate

logger = logging.getLogger("trahiv.swarm")

__all__ = [
    "SwarmOptimizer",
    "SwarmProgressTracker",
    "grad_averager_factory",
    "in_group",
    "newest_served",
    "newest_served_step",
    "stop_tracker_quietly",
    "request_timeout",
    "serve_while_late",
    "tracker_opts",
]

_GROUP_FORMED = (AveragingStage.AWAITING_TRIGGER, AveragingStage.RUNNING_ALLREDUCE)
UNCONFIRMED_CHECK_PERIOD = 120.0  # seconds between state downloads that check a lone far-ahead progress record
LEFT_BEHIND_POLL = 0.25  # seconds between looks at the swarm while this peer looks for a group
LATE_PEERS_POLL = 0.25  # seconds between looks at the swarm while a peer whose training ended serves late peers
RESYNC_PERIOD = 0.5  # seconds between attempts to re-sync after a step that left this peer's state different
PROGRESS_RECHECK_PERIOD = 0.1  # seconds between progress fetches once the swarm should have reached its target
TOLD_POLL = 0.005  # seconds between looks at the step's `told` byte while a peer waits at its share (engine.tell)
HOLD_MIN, HOLD_MAX = 2.0, 30.0  # seconds a peer that computed its share of a step waits for the others' reports
STALE_STEPS, STALE_MARGIN = 3, 1.0  # silent for its last round + 3 steps at the swarm's pace + 1 s: not waited for
PING_AGAIN_S = 10.0  # seconds: a peer far behind that answered a ping is asked again after this (`_gone`)
PING_SILENT_S = 5.0  # seconds: a record within a step of this peer's, this old, is checked with a ping too (`_gone`)
PINGS_UNANSWERED = 2  # pings in a row a peer leaves unanswered before it is left out (an overloaded one may miss one)
PROMISE_MAX_S = 1.0  # seconds: the longest batch a peer announces as it begins (`_may_promise`)
SETTLED_FETCHES = 2  # progress fetches that show the same records before the swarm's reports count as settled
DHT_READ_TIMEOUT = 10.0  # seconds: a read of the DHT from a background wait that gets no answer counts as none
WHOLE_STATE_WAIT = 10.0  # seconds an update under way may take to end before a checkpoint of the state is given up
LOAD_ATTEMPTS = 3  # state downloads whose load raised, in a row, before a peer keeps its own state (hivemind: no end)


def in_group(control: Any) -> bool:
    """A scheduled round (hivemind's StepControl) whose group formed and has not finished."""
    return control is not None and not control.done() and control.stage in _GROUP_FORMED


def newest_served_step(dht: hivemind.DHT, run_id: str) -> int:
    """The highest collaborative step another peer offers its state at: trainers and auxiliary peers declare the
    step of the state they serve as their state-sharing priority under `{run_id}_state_averager.all_averagers`."""
    return newest_served(dht, f"{run_id}_state_averager")


def read_latest(dht: hivemind.DHT, key: str) -> Any:
    """`dht.get(key, latest=True)`, but a read that gets no answer within DHT_READ_TIMEOUT (the DHT process froze with
    the read in flight), or whose DHT process has ended (`dht_answer`), is None: a background update that watched the
    swarm while its peer shut down waited for such a read for good, and held the process at exit (stop 44, 0.05 s
    steps in background mode)."""
    try:
        return dht_answer(dht, dht.get(key, latest=True, return_future=True), timeout=DHT_READ_TIMEOUT)
    except (TimeoutError, DHTProcessEnded, OSError, EOFError) as e:  # (OSError: the DHT's pipe is closed)
        logger.debug(f"No answer from the DHT for {key!r}: {e!r}")
        return None


def newest_served(dht: hivemind.DHT, prefix: str) -> int:
    """The highest state-sharing priority another averager of `prefix` declares (hivemind's `{prefix}.all_averagers`
    key: a subkey per peer, the priority as its value); trahiv's averagers declare the step of the state they serve
    (the collaborative step, or DiLoCo's outer step under `{run_id}_diloco`). 0 if none (or no answer)."""
    found = read_latest(dht, f"{prefix}.all_averagers")
    entries = found.value if found is not None and isinstance(found.value, dict) else {}
    own = dht.peer_id.to_bytes()
    steps = [getattr(entry, "value", None) for peer, entry in entries.items() if peer != own]
    valid = [int(s) for s in steps if isinstance(s, int | float) and not isinstance(s, bool) and 0 <= s < 2**62]
    return max(valid, default=0)


class SwarmProgressTracker(ProgressTracker):
    """hivemind's tracker, stricter and more talkative.

    - The collaborative step advances only once the swarm *reported* `target_batch_size` samples (or another peer
      already moved on); hivemind 1.1.12 also advances when its throughput-based ETA runs out.
    - It keeps the set of active peers and the swarm's total samples/s, and logs peers joining and leaving.
    - Forged records cannot move the swarm: a record more than one step ahead of this peer counts only if a quorum
      of peers reports that far (a lone one is checked by downloading the swarm's state, see SwarmOptimizer), and a
      record's samples_accumulated counts for at most target_batch_size.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        self.active_peers: dict[str, LocalTrainingProgress] = {}
        self.swarm_samples_per_second = 0.0
        self.ignored_records: dict[str, int] = {}  # peer -> the unconfirmed step its record reports
        self.unconfirmed_epoch = 0
        self.peer_filter: Callable[[], set[str] | None] | None = None  # after a revert: the peers that applied it
        self._reported: set[tuple[str, int]] = set()  # ignored (peer, step) records already logged
        self._latest: dict[Any, tuple[int, tuple[Any, Any]]] = {}  # peer -> (step, (subkey, record)) last read
        self.promised = 0  # samples published ahead of their batch (`promise`), not accumulated yet
        self._told_epoch: int | None = None  # the step a groupmate's round of began (`told_complete`)
        self._first_batch_pending = False  # the next report ends the first batch of training (`start_measuring`)
        self.read_at = -math.inf  # (time.monotonic) when this peer's last `refresh_now` ended
        self._rate_step: tuple[int, float] | None = None  # (step, throughput) this peer reports during that step
        # peer -> (record time, when pinged, future, pings it left unanswered before this one): `_gone`
        self._pings: dict[bytes, tuple[float, float, Any, int]] = {}
        # this peer's own progress as the last view of the swarm counted it, and a lock that orders this peer's
        # reports with the views' hand-over (the `global_progress` setter)
        self._own_lock, self._counted = threading.Lock(), None
        super().__init__(*args, **kwargs)

    @property  # type: ignore[override]
    def global_progress(self) -> Any:
        return self._global_progress

    @global_progress.setter
    def global_progress(self, progress: Any) -> None:
        """A view of the swarm counts this peer's own progress as it is now. hivemind's background fetch holds the
        records as the DHT gave them (this peer's own among them), and a report this peer made while the read was on
        its way added its samples to the view that the fetch then replaced: the step's last report was undone, and a
        peer alone computed a third batch of a 2-batch step (the measured batches of a clean-clone run's
        test_trainer_alone.py were 4 instead of 3). `_parse_swarm_progress_data` counts this peer's own progress
        instead of its record; a report made since is added here (the lock orders the two)."""
        with self._own_lock:
            counted, self._counted = self._counted, None
            local = self.local_progress
            if counted is not None and local is not counted and local.epoch == counted.epoch == progress.epoch:
                progress.samples_accumulated += local.samples_accumulated - counted.samples_accumulated
            self._global_progress = progress

    def _get_local_progress(self, local_epoch: int, samples_accumulated: int) -> LocalTrainingProgress:
        """This peer's record, with the throughput it had as the step began, the same in every report of the step.
        Each peer's share of a step follows the throughputs in the records it reads, and the others read different
        reports at different times: with the throughput of each report (it changes every batch), two peers of equal
        speed read 10.3 and 8.0 for one peer's share, on either side of a rounding point (batches of 4, target 16),
        and computed 12 + 8 samples."""
        if self._rate_step is None or self._rate_step[0] != local_epoch:
            self._rate_step = (local_epoch, self.performance_ema.samples_per_second)
        progress = super()._get_local_progress(local_epoch, samples_accumulated)
        progress.samples_per_second = self._rate_step[1]
        return progress

    @property
    def ready_to_update_epoch(self) -> bool:
        return (
            self.global_epoch > self.local_progress.epoch
            or self.global_progress.samples_accumulated - self.promised >= self.target_batch_size
            or self._told_epoch == self.local_progress.epoch
        )

    def told_complete(self, epoch: int) -> None:
        """Step `epoch` is complete: a groupmate of its gradient round began that round (trahiv.engine.tell), which it
        does once the reports it read reach the target. Until the step ends, this peer is ready to update."""
        self._told_epoch = epoch

    def promise(self, samples: int) -> None:
        """Publish now, as accumulated, the `samples` of the batch this peer is beginning: its last of the step. The
        others see the step complete as this peer computes its last batch, not a report's trip (0.1-0.5 s: store,
        then their next fetch) after it: with every peer computing its share, each peer waited for the last one's
        final report, 0.05-0.63 s a step (benchmarks/compute_utilization.py). This peer's own decisions leave the
        promised samples out until its batch is accumulated (`report_local_progress`)."""
        tracker: Any = self  # (hivemind's attributes are untyped)
        with self._own_lock:
            progress = tracker.local_progress
            if progress.epoch == tracker.global_progress.epoch:
                tracker.global_progress.samples_accumulated += samples
            tracker.local_progress = tracker._get_local_progress(progress.epoch, progress.samples_accumulated + samples)
            self.promised = samples
        tracker.should_report_progress.set()

    def report_local_progress(self, local_epoch: int, samples_accumulated: int, update_global_samples: bool = True):
        self.promised = 0  # kept (its samples, counted when promised, accumulated) or replaced by what there is
        tracker: Any = self  # (hivemind's attributes are untyped)
        first = self._first_batch_pending and samples_accumulated > tracker.local_progress.samples_accumulated
        with self._own_lock:  # (a view of the swarm handed over meanwhile counts it: `global_progress`)
            super().report_local_progress(local_epoch, samples_accumulated, update_global_samples)
        if first:  # not a measure (`start_measuring`): the next batch's time is
            self._first_batch_pending = False
            ema: Any = self.performance_ema
            ema.ema_seconds_per_sample, ema.num_updates, ema.samples_per_second = 0, 0, ema.eps
            tracker.local_progress = self._get_local_progress(local_epoch, samples_accumulated)

    @property
    def estimated_next_update_time(self) -> float:
        return get_dht_time() if self.ready_to_update_epoch else self.global_progress.eta_next_epoch

    @property
    def has_other_peers(self) -> bool:
        own = self.dht.peer_id.to_base58()
        return any(peer != own for peer in self.active_peers)

    def announce(self) -> None:
        """Publish this peer's progress record now (step, no samples yet). hivemind's reporter publishes only once a
        peer has accumulated samples, so until its first local step ended, no peer counted it: the first step of a
        fast peer then reached target_batch_size alone."""
        self.dht.store(
            key=self.training_progress_key,
            subkey=self._local_public_key,
            value=self.local_progress.dict(),
            expiration_time=get_dht_time() + self.metadata_expiration,
        )

    def peek(self) -> tuple[int, bool]:
        """The swarm's step from a fresh read of the progress records (trusted as in `_trusted_records`), without
        the tracker's lock and without updating its state: for waits while the tracker is paused. And whether another
        peer may still be there: its record passes `_without_the_gone` (a record silent for PING_SILENT_S while this
        peer trains is checked with pings; the tracker is paused, so this thread is the one that asks). A read that
        found nothing, or not this peer's own record, tells nothing: True."""
        found = read_latest(self.dht, self.training_progress_key)
        records = self._well_formed_records(found.value if found else None)
        epochs = [record.epoch for record, _ in records.values()]
        limit = trusted_epoch(epochs, self.local_progress.epoch)
        own = self.dht.peer_id.to_bytes()
        kept = [record.peer_id for record, _ in self._without_the_gone(records).values()]
        others = own not in kept or any(peer != own for peer in kept)
        return max([epoch for epoch in epochs if epoch <= limit], default=self.local_progress.epoch), others

    def start_measuring(self) -> None:
        """Training begins now: this peer's throughput (samples/s, which its share of each step follows) is measured
        from its first batch's end on. hivemind measures the first batch from the tracker's creation, through the wait
        for other peers and the state download: the peer that was ready first reported 12 samples/s against the
        other's 21 at the same speed, and the two peers' shares of 16 samples (6.1 and 10.1, batches of 4) were both
        rounded up. The first batch itself is no measure either (the data loader's start, the first forward's
        warm-up; in the tests' workers, which compute after the optimizer step, none of the compute): its time made
        one of two peers of equal speed seem 1.7x faster than the other, and it computed a third batch of step 0 (20
        samples for a target of 16, twice in 4 runs with a core kept busy). Until its second batch a peer reports no
        throughput, and the shares are equal (`trahiv.protocol.share_of_target`)."""
        self._first_batch_pending = True
        self.performance_ema.reset_timer()

    def skip_time_until_now(self) -> None:
        """Leave the time since this peer's last report out of its throughput: what the application did between
        steps once per collaborative step (the Trainer's metrics, logs, evaluation, checkpoint) is not the cost of a
        batch. Counted in the next batch's time, it made a peer that computes fewer batches a step seem slower, so
        its share shrank further: two peers of equal speed settled at shares of 10.6 and 5.4 samples of 16 (batches
        of 4, with a core kept busy), next to the rounding points where the two views of the rates gave 12 + 8."""
        self.performance_ema.reset_timer()

    def refresh_now(self, given_up: Callable[[], bool] | None = None) -> bool:
        """Fetch the swarm's progress right away (before a collaborative step: who is there to average with?); whether
        it did. With `given_up`, the wait for the DHT's answer ends as soon as `given_up()` is true (looked at every
        TOLD_POLL), and the view stays as it was: a peer waiting at its share that a groupmate tells of its round
        (trahiv.engine.tell) begins it at once, where a read under way, through links the groupmate's round fills,
        held it 10-45 ms more (benchmarks/averaging_round.py)."""
        with self.lock_global_progress:
            future = self.dht.get(self.training_progress_key, latest=True, return_future=True)
            while True:
                try:
                    found = future.result(None if given_up is None else TOLD_POLL)
                    break
                except TimeoutError:
                    if given_up is not None and given_up():
                        return False  # (hivemind drops the answer of a future nobody holds any more)
            self.global_progress = self._parse_swarm_progress_data(found.value if found is not None else None)
            self.read_at = time.monotonic()
        return True

    def refresh_if_older(self, seconds: float) -> None:
        """`refresh_now`, unless this peer's last one ended less than `seconds` ago."""
        if time.monotonic() - self.read_at >= seconds:
            self.refresh_now()

    def records_for_round(self) -> dict[Any, Any]:
        """Each peer's latest progress record as read (the DHT's form), for the weight caps of this peer's next
        gradient round (trahiv.averaging.robust.reported_sample_caps): a peer whose record is of a later step than the
        round's already finished it and is capped by the target. Its last-read record of the round's step is not used:
        it can be stale (read before the peer's last reports of that step). In background mode a peer that finished its
        share and moved on between two fetches of the other was capped by its announcement (0 samples): weight 1
        against the other's 8, its gradients nearly dropped (a 2-peer test of compute-while-waiting)."""
        return dict(entry for _, entry in self._latest.values())

    def _remember_latest(self, metadata: Any) -> None:
        for key, entry in metadata.items() if isinstance(metadata, dict) else ():
            value = getattr(entry, "value", None)
            if not isinstance(value, dict):
                continue
            epoch, peer = value.get("epoch"), value.get("peer_id")
            if isinstance(epoch, int) and not isinstance(epoch, bool) and isinstance(peer, bytes):
                if peer not in self._latest or epoch >= self._latest[peer][0]:  # (a lagging replica never goes back)
                    self._latest[peer] = (epoch, (key, entry))
        for peer in [p for p, (epoch, _) in self._latest.items() if epoch < self.local_progress.epoch - 1]:
            del self._latest[peer]  # left, or far behind: as hivemind's records, only the current ones count

    def _parse_swarm_progress_data(self, metadata: Any):
        with self._own_lock:  # this peer's own record as it is now, unchanged as the view is built (`global_progress`)
            self._counted = counted = self.local_progress
            own = self._local_public_key
            if isinstance(metadata, dict) and own in metadata:
                metadata = {**metadata, own: ValueWithExpiration(counted.dict(), metadata[own].expiration_time)}
            self._remember_latest(metadata)
            records = self._without_the_gone(self._trusted_records(self._well_formed_records(metadata)))
            sanitized = {key: ValueWithExpiration(r.dict(), expires) for key, (r, expires) in records.items()}
            progress = super()._parse_swarm_progress_data(sanitized)
        peers = {PeerID(record.peer_id).to_base58(): record for record, _ in records.values()}
        own = self.dht.peer_id.to_base58()
        for peer in peers.keys() - self.active_peers.keys():
            if peer != own:
                logger.info(f"Peer joined the swarm: {peer} ({len(peers)} active)")
        for peer in self.active_peers.keys() - peers.keys():
            if peer != own:
                logger.info(f"Peer left the swarm: {peer} ({len(peers)} active)")
        self.active_peers = peers
        others = sum(record.samples_per_second for peer, record in peers.items() if peer != own)
        self.swarm_samples_per_second = others + self.performance_ema.samples_per_second
        return progress

    def _well_formed_records(self, metadata: Any) -> dict[Any, tuple[LocalTrainingProgress, float]]:
        """Records that parse, by DHT subkey, with samples_accumulated capped at target_batch_size."""
        records = {}
        for key, entry in metadata.items() if isinstance(metadata, dict) else ():
            try:  # records passed the DHT's schema validator; a bad one must still never stop this thread
                record = LocalTrainingProgress.parse_obj(entry.value)
                PeerID(record.peer_id).to_base58()
            except Exception as e:
                logger.debug(f"Ignoring a malformed progress record: {e!r}")
                continue
            record.samples_accumulated = min(record.samples_accumulated, self.target_batch_size)
            records[key] = (record, entry.expiration_time)
        return records

    def _without_the_gone(
        self, records: dict[Any, tuple[LocalTrainingProgress, float]]
    ) -> dict[Any, tuple[LocalTrainingProgress, float]]:
        """Leave out the records of peers that do not answer DHT pings: those two or more steps behind this one, and
        those within a step whose record is older than PING_SILENT_S. A peer that died (SIGKILL, its engine process
        lost: trahiv.engine.liveness) leaves a record that outlives it (hivemind's `metadata_expiration`, 60 s), and a
        survivor left alone with it searched for a group at every step until `averaging_timeout`: 50 s of the last
        peer's 81 in `test_faults.py`'s late-join test, then (a dead peer within one step counted until it was two
        behind) 90 s in a 2-peer swarm with the default timeout. Behind or silent alone does not tell a dead peer
        from a live one (a late joiner stuck in a failed round beside a busy core; a peer whose local steps take
        longer than PING_SILENT_S): the peer is asked. One that answers, is in client mode (it serves no pings), or
        whose record is recent (or this peer has no samples in its step yet) and within a step counts, as before."""
        floor, own, now = self.local_progress.epoch - 1, self.dht.peer_id.to_bytes(), get_dht_time()
        # (silence counts while this peer trains its step: idle peers renew their records only every 30 s, and asking
        # each of them every PING_AGAIN_S would make an idle peer's traffic grow with the swarm)
        silent_after = PING_SILENT_S if self.local_progress.samples_accumulated > 0 else math.inf
        for peer in self._pings.keys() - {record.peer_id for record, _ in records.values()}:
            del self._pings[peer]  # its record expired
        return {
            key: (record, expiration)
            for key, (record, expiration) in records.items()
            if record.peer_id == own
            or record.client_mode
            or (record.epoch >= floor and now - record.time < silent_after)
            or not self._gone(record)
        }

    def _gone(self, record: LocalTrainingProgress) -> bool:
        """Whether the peer of this record left PINGS_UNANSWERED pings in a row unanswered, all sent since the record
        was published. Pings are sent in the background (the DHT process answers the future), one at a time per
        record: again at once after one unanswered, PING_AGAIN_S after an answer; until then the peer counts."""
        now, ping = time.monotonic(), self._pings.get(record.peer_id)
        if ping is not None and ping[0] == record.time and ping[2].done():
            missed = ping[3] + 1 if self._unanswered(ping[2]) else 0
            if missed >= PINGS_UNANSWERED:
                return True
            if missed or now - ping[1] > PING_AGAIN_S:
                ping = self._ping(record, now, missed)
        elif ping is None or ping[0] != record.time:
            self._ping(record, now, 0)
        return False

    def gone(self, record: LocalTrainingProgress) -> bool:
        """Whether the peer of this record no longer answers pings, whatever this peer is doing (`_gone`: pings go out
        in the background, so a peer counts until its second one goes unanswered). A client-mode peer serves no pings:
        it is never gone by this."""
        if record.client_mode:
            return False
        with self._own_lock:  # (the fetch thread pings too: `_without_the_gone`)
            return self._gone(record)

    def _ping(self, record: LocalTrainingProgress, now: float, missed: int) -> tuple[float, float, Any, int]:
        peer = PeerID(record.peer_id).to_base58()
        self._pings[record.peer_id] = ping = (record.time, now, unreachable_peers_future(self.dht, [peer]), missed)
        return ping

    @staticmethod
    def _unanswered(future: Any) -> bool:
        try:
            return bool(future.result())
        except Exception:  # the DHT process could not ask: no verdict
            return False

    def _trusted_records(
        self, records: dict[Any, tuple[LocalTrainingProgress, float]]
    ) -> dict[Any, tuple[LocalTrainingProgress, float]]:
        """Drop records more than one step ahead of this peer unless a quorum of peers reports that far (one forged
        record must not move the swarm); remember the highest dropped epoch in `unconfirmed_epoch`."""
        allowed = self.peer_filter() if self.peer_filter is not None else None
        if allowed is not None:  # a revert's grace period: peers far ahead that did not apply it train in the old state
            self.ignored_records, self.unconfirmed_epoch, limit = {}, 0, self.local_progress.epoch + 1
            kept = [k for k, (r, _) in records.items() if r.epoch <= limit or PeerID(r.peer_id).to_base58() in allowed]
            return {k: records[k] for k in kept}
        limit = trusted_epoch([record.epoch for record, _ in records.values()], self.local_progress.epoch)
        trusted, dropped = {}, {}
        for key, (record, expiration) in records.items():
            if record.epoch <= limit:
                trusted[key] = (record, expiration)
            else:
                dropped[PeerID(record.peer_id).to_base58()] = record.epoch
        for peer, epoch in dropped.items():
            if (peer, epoch) not in self._reported:
                self._reported.add((peer, epoch))
                logger.warning(
                    f"Ignoring the progress record of peer {peer}: step {epoch} is ahead of this peer's step "
                    f"{self.local_progress.epoch} and not confirmed by other peers"
                )
        self.ignored_records = dropped
        self.unconfirmed_epoch = max(dropped.values(), default=0)
        return trusted


def serve_while_late(
    late: Callable[[], Sequence[Any]],
    seconds: float,
    announce: Callable[[Sequence[Any]], str],
    stopped: str,
    poll: float = LATE_PEERS_POLL,
) -> None:
    """A peer whose training ended waits (serving its state meanwhile) while `late()` names peers still behind it, for
    at most `seconds`; `announce(peers)` and `stopped` are logged when it waited. If `late()` raises (the DHT shut
    down under it), there is nothing to serve any more."""
    deadline, waited = time.monotonic() + seconds, False
    while time.monotonic() < deadline:
        try:
            peers = late()
        except Exception as e:
            logger.debug(f"Stopped serving late peers: {e!r}")
            return
        if not peers:
            break
        if not waited:
            logger.info(announce(peers))
            waited = True
        time.sleep(poll)
    if waited:
        logger.info(stopped)


class SwarmOptimizer(hivemind.Optimizer):
    """hivemind.Optimizer with trahiv's fixes: the DHT's client mode is always honoured (1.1.12 drops it), each step
    can report its true number of samples, and the samples this peer contributed are counted."""

    tracker: SwarmProgressTracker
    scheduled_grads: Any  # hivemind's StepControl of the next gradient round (set in hivemind's __init__)
    state_averager_cls: type[RobustTrainingStateAverager] = ReportingStateAverager  # tests swap in a faulty one

    def __init__(self, *, dht: hivemind.DHT, state_averager_cls: type | None = None, **kwargs: Any):
        if state_averager_cls is not None:  # e.g. with the auth gate (trahiv.auth.gate)
            self.state_averager_cls = state_averager_cls
        kwargs["client_mode"] = dht.client_mode  # 1.1.12 reads `client_mode` inverted: pass the DHT's explicitly
        self.pending_batch_size: int | None = None
        self.samples_contributed = 0
        self.revert: Any = None  # trahiv.revert.RevertFollower in a moderated swarm
        self._next_unconfirmed_check = 0.0  # the first far-ahead record is checked at once (no quorum with 2 peers)
        self._next_progress_check = 0.0
        self._hold_released: int | None = None  # the step in which waiting for the others' reports gave up
        self._last_batch = 0  # samples in this peer's last accumulated batch
        self._last_transition_s = 0.0  # seconds this peer's last step transition (its averaging rounds) took
        self._step_began = 0.0  # DHT time at which this peer's current step began (its last transition, or training)
        self._stepped_alone = self._left_behind = False  # see _resync, _average_gradients_and_load_into_optimizer
        self._resync_epoch: int | None = None  # the step whose state differs from the swarm's, until re-synced
        self._next_resync = 0.0
        self._tiebreak = peer_tiebreak(dht.peer_id.to_bytes())
        self._declared = 0.0  # the state-sharing priority this peer declared last (`_declare_state`)
        self._deferred_declaration: tuple[int, bool, set] | None = None  # (step, complete, updates it waits for)
        super().__init__(dht=dht, **kwargs)
        if isinstance(getattr(self, "grad_averager", None), OverlappedAccumulation):
            # background mode only: with synchronous rounds, a 2-peer test of fast steps (tests/test_swarm.py, target
            # 16) took 20 samples in 2 of 4 runs beside two CPU burners (0 of 4 without the overlap, four burners)
            self.grad_averager.overlap_accumulation = bool(self.delay_grad_averaging)

    def _make_state_averager(self, **kwargs: Any) -> TrainingStateAverager:
        """hivemind's state averager, but parameters with non-finite values are excluded from averaging rounds and a
        downloaded state is checked before it is loaded."""
        if issubclass(self.state_averager_cls, ReportingMixin):  # partial rounds reported, payload-based deadlines
            kwargs.setdefault("deadlines", Deadlines())
        return self.state_averager_cls(
            dht=self.dht,
            prefix=f"{self.run_id}_state_averager",
            min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout,
            shutdown_timeout=self.shutdown_timeout,
            offload_optimizer=self.offload_optimizer,
            custom_gradients=self.offload_optimizer,
            status_loglevel=self.status_loglevel,
            next_chunk_timeout=self.next_chunk_timeout,
            client_mode=self.client_mode,
            auxiliary=self.auxiliary,
            start=True,
            **kwargs,
        )

    def ring_rounds(self) -> int:
        """Of the averaging rounds counted by `averaging_rounds`, those run as a ring all-reduce."""
        self.averaging_rounds()  # (collects the reports)
        averagers = (self.state_averager, getattr(self, "grad_averager", None))
        return sum(a.ring_rounds for a in averagers if isinstance(a, ReportingMixin))

    def averaging_rounds(self) -> dict[str, int]:
        """Averaging rounds (gradients and state) that were complete, partial or failed, as this peer saw them."""
        counts = {"complete": 0, "partial": 0, "failed": 0}
        for averager in (self.state_averager, getattr(self, "grad_averager", None)):
            if isinstance(averager, ReportingMixin):
                averager.round_reports()
                for status, count in averager.round_counts.items():
                    counts[status] += count
        return counts

    def _should_load_state_from_peers(self) -> bool:
        """hivemind's rule, plus: a lone record far ahead (ignored by the tracker) is checked by downloading the
        swarm's state, at most once per UNCONFIRMED_CHECK_PERIOD; what the peers serve decides the step.
        Never during the grace period after a revert: trahiv.revert downloads only from peers that applied it."""
        if self.revert is not None and self.revert.in_grace():
            return False
        if super()._should_load_state_from_peers():
            return True
        if self.tracker.unconfirmed_epoch <= self.local_epoch + 1 or time.monotonic() < self._next_unconfirmed_check:
            return False
        self._next_unconfirmed_check = time.monotonic() + UNCONFIRMED_CHECK_PERIOD
        logger.info(f"A peer reports step {self.tracker.unconfirmed_epoch}: checking with the swarm's state")
        return True

    def _make_progress_tracker(self, target_batch_size: int, **kwargs: Any) -> ProgressTracker:
        return SwarmProgressTracker(
            dht=self.dht,
            prefix=progress_prefix(self.run_id),
            target_batch_size=target_batch_size,
            client_mode=self.client_mode,
            status_loglevel=self.status_loglevel,
            start=True,
            **kwargs,
        )

    # While no other peer is in the swarm, hivemind 1.1.12 still keeps a matchmaking round open for every step that
    # ends within matchmaking_time: the averager and the DHT then burn ~30% of a core each, polling for a group.
    # A peer that arrives later is seen at the next progress fetch, and scheduling resumes.
    def _maybe_schedule_gradient_averaging(self) -> None:
        if self.tracker.has_other_peers:
            super()._maybe_schedule_gradient_averaging()
            # (hivemind calls this right after accumulating a batch, before it looks whether the step is due)
            self._hold_at_share()

    def _maybe_schedule_state_averaging(self) -> None:
        if self.tracker.has_other_peers:
            super()._maybe_schedule_state_averaging()

    # --- samples per step: each peer computes its share of target_batch_size, then waits for the others' reports ---

    def _fresh_records(self) -> list[Any]:
        """The trainers' progress records, less those of peers silent for longer than this peer's last step transition
        (its averaging rounds) plus STALE_STEPS collaborative steps at the swarm's throughput plus STALE_MARGIN: a
        frozen or killed peer, whose record outlives it, is not waited for (this peer's own record always counts).
        Silence is counted from the start of this peer's step at the earliest (`silent_too_long`)."""
        records = list(self.tracker.active_peers.values())
        swarm_rate = sum(record.samples_per_second for record in records)
        pace = STALE_STEPS * self.tracker.target_batch_size / max(swarm_rate, 1e-9)
        stale = self._last_transition_s + min(pace, HOLD_MAX) + STALE_MARGIN
        now, own = get_dht_time(), self.dht.peer_id.to_bytes()
        return [
            record
            for record in records
            if record.peer_id == own or not silent_too_long(record.time, self._step_began, now, stale)
        ]

    def _contributions(self) -> list[Contribution]:
        """What the trainers contributed to this peer's step (`_fresh_records`): a peer finishing the previous step
        has contributed nothing yet; one already past this step, or two steps behind (downloading the swarm's state),
        is not counted."""
        epoch = self.local_epoch
        return [
            Contribution(
                record.peer_id,
                record.samples_accumulated if record.epoch == epoch else 0,
                record.samples_per_second,
                record.time,
            )
            for record in self._fresh_records()
            if epoch - 1 <= record.epoch <= epoch
        ]

    def _hold_at_share(self) -> None:
        """A peer that computed its share of the step waits (up to a bound) for the others' progress reports instead of
        computing past the target. hivemind's target_batch_size is a minimum: peers compute until they *see* the swarm
        reach it, and progress reports take 0.1-1 s to travel through the DHT; with local steps shorter than that, the
        swarm computed 3-4x the target per step (benchmarks/convergence.py: 4 peers x 2 samples, target 32: ~110
        samples a step), and the learning-rate schedule, tuned for one batch size, trained with another.
        Shares follow the throughputs the peers report (`trahiv.protocol.share_of_target`), rounded to whole batches
        (a peer within a quarter batch of its rounding point stops: `own_share_done`); if the reports settle below the
        target, the peers furthest below their shares compute one more batch each
        (`fills_shortfall`). The wait ends as soon as the reports reach the target (or the swarm moved on); if they do
        not within twice the time the others should need (at least HOLD_MIN), this peer computes on for the rest of the
        step, as hivemind does."""
        tracker, batch = self.tracker, self._last_batch
        if self.auxiliary or self._hold_released == self.local_epoch or tracker.ready_to_update_epoch or batch <= 0:
            return
        own_id = self.dht.peer_id.to_bytes()
        contributions = self._contributions()
        # every peer's rate as its record reports it, this peer's too (its own measure is fresher than what the others
        # read of it): peers that each mixed their own measure with the others' records computed shares that did not
        # add up to the target (2 peers, target 16: 12 + 8 samples once in a clean-clone run)
        reported_rate = next((c.rate for c in contributions if c.peer == own_id), None)
        own = Contribution(
            own_id,
            tracker.local_progress.samples_accumulated,
            reported_rate if reported_rate is not None else tracker.performance_ema.samples_per_second,
        )
        others = [c for c in contributions if c.peer != own_id]
        share, alone = share_of_target(tracker.target_batch_size, own, [own, *others]), not others
        if not own_share_done(own.samples, batch, share, alone=alone):
            if self._may_promise(own, batch) and own_share_done(own.samples + batch, batch, share, alone=alone):
                tracker.promise(batch)  # the next batch completes this peer's share: the others learn it now
                logger.debug(f"Step {self.local_epoch}: promised {batch} ({own.samples} samples, share {share:.1f})")
                self._join_round_now()
            return
        logger.debug(f"Step {self.local_epoch}: share {share:.1f} computed ({own.samples} samples; {len(others)} more)")
        # a round is declared for matchmaking_time from when it is joined: joined as soon as this peer's share was
        # done, its declaration could run out while the slowest peer computed, and the group then assembled without
        # that peer (hivemind's "time is up"; test_ring.py's slowest peer missed step 0 so in every run). It joins once
        # the rest should take at most half of matchmaking_time
        joined = self._join_round_if_near(contributions, batch)
        others_rate = max(sum(c.rate for c in others), 1e-9)
        missing = max(0, tracker.target_batch_size - tracker.global_progress.samples_accumulated)
        held = time.monotonic()
        deadline = held + min(HOLD_MAX, HOLD_MIN + 2 * missing / others_rate)
        settled, last_seen, target = 0, None, tracker.target_batch_size
        with tracker.performance_ema.pause():  # waiting is not this peer's throughput
            while not tracker.ready_to_update_epoch and time.monotonic() < deadline:
                if self._until_told(PROGRESS_RECHECK_PERIOD):
                    # a groupmate of this step's round began it: it read the step complete. This peer begins too,
                    # without reading the progress again: that read, through links the groupmate's round now fills,
                    # took 10-60 ms (benchmarks/averaging_round.py), and the ring waits for its last peer. The weight
                    # caps of the round use the records as last read (reported_sample_caps extrapolates them)
                    logger.debug(f"Step {self.local_epoch}: a groupmate began this step's round: beginning it too")
                    tracker.told_complete(self.local_epoch)
                    break
                if not tracker.refresh_now(given_up=self._told):
                    continue  # (told during the read: the loop's next `_until_told` sees it at once)
                seen = self._contributions()
                joined = joined or self._join_round_if_near(seen, batch)
                reported = {c.peer: c.samples for c in seen}
                # settled: every peer stopped at its share (`stopped_at_share`: the same rule for all, from their
                # records), the total is still short. A peer still computing its share (one that began later, or
                # slower) is waited for: with only "every peer reported some samples", a peer that began 1.2 s after
                # the other filled the "shortfall" while the other was computing its second batch (20 samples for a
                # target of 16)
                now = get_dht_time()
                done = all(stopped_at_share(c, batch, share_of_target(target, c, seen), now) for c in seen)
                in_place = reported.get(own_id) == own.samples and done
                settled = settled + 1 if in_place and seen == last_seen else 0
                last_seen = seen
                if settled >= SETTLED_FETCHES and fills_shortfall(own_id, seen, tracker.target_batch_size, batch):
                    # compute one more batch: the swarm's reports settled below the target. It is this peer's last of
                    # the step, so it is announced as it begins, as a share's last batch is: unannounced, the others
                    # waited for its final report (0.13 s past the batch's end in a run of tests/test_swarm.py's
                    # promise test, where the stalled peer filled the step instead of promising its share)
                    if self._may_promise(own, batch):
                        tracker.promise(batch)
                        logger.debug(f"Step {self.local_epoch}: promised {batch} to fill the step ({own.samples} done)")
                    return
        logger.debug(f"Step {self.local_epoch}: held {time.monotonic() - held:.3f} s")
        if not tracker.ready_to_update_epoch:
            self._hold_released = self.local_epoch
            logger.debug(f"Step {self.local_epoch}: the swarm's reports did not reach the target; computing on")

    def _until_told(self, seconds: float) -> bool:
        """Wait `seconds`, or less if a groupmate told this step's averager that it began the round of the group found
        for it (trahiv.engine.tell); whether one did."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            if self._told():
                return True
            time.sleep(min(TOLD_POLL, left))
        return False

    def _told(self) -> bool:
        control = self.scheduled_grads
        return control is not None and told(control)

    def _join_round_if_near(self, contributions: list[Contribution], batch: int) -> bool:
        """Join this step's round (`_join_round_now`) if the swarm should reach the target within half of
        matchmaking_time (`seconds_to_target`); whether it did."""
        left = seconds_to_target(contributions, self.tracker.target_batch_size, batch, get_dht_time())
        if left > self.matchmaking_time / 2:
            return False
        self._join_round_now()
        return True

    def _may_promise(self, own: Contribution, batch: int) -> bool:
        """Whether this peer may announce its next batch as it begins (SwarmProgressTracker.promise): once a step, in
        background mode (where the others go on computing meanwhile), and for a batch of at most PROMISE_MAX_S at its
        rate. The others start their round as they see the step complete, and their reducers wait for this peer's
        part only so long: in synchronous mode a peer on a busy machine that took 2.7 s for its promised batch left
        the other's round partial (tests/test_swarm.py, fast steps with a core kept busy, once in a clean-clone run),
        and with slow batches the report's trip it saves is a small part of a step anyway."""
        if self.tracker.promised or not self.delay_grad_averaging:
            return False
        return batch <= PROMISE_MAX_S * max(own.rate, MIN_RATE)

    def _join_round_now(self) -> None:
        """The step is about to be complete, whatever hivemind's ETA says: look for this step's group now."""
        if not self._live_round(self.scheduled_grads):
            self.scheduled_grads = self.grad_averager.schedule_step(timeout=self.averaging_timeout)

    def begin_training(self) -> None:
        """Training begins now (`Swarm.catch_up`): this peer's throughput is measured from here
        (`SwarmProgressTracker.start_measuring`), and its first step begins here, so the others' silence is counted
        from here at the earliest (`_fresh_records`). Counted from their records alone, the peers that had announced
        themselves long before (joining, waiting for `min_peers`, an idle start) were taken for gone at the first step:
        each peer's share was the whole target, and 16 peers computed 3.6 times the target in 5 steps, the excess
        nearly all in the first (benchmarks/swarm_cost.py)."""
        self.tracker.start_measuring()
        self._step_began = get_dht_time()

    def _key_rounds_by_step(self) -> None:
        """Matchmaking of this step's rounds is keyed by the step (see EpochKeyedMatchmaking): the gradient round that
        ends step k, and the parameter round that hivemind runs as the step becomes k + 1."""
        self.state_averager.round_epoch = self.local_epoch + 1
        self.state_averager.expect_peers(self._peers_for_round(self.local_epoch + 1))
        if self.grad_averager is not None:
            self.grad_averager.round_epoch = self.local_epoch
            self.grad_averager.expect_peers(self._peers_for_round(self.local_epoch))

    def _peers_for_round(self, epoch: int) -> list[bytes]:
        """The peers expected in the round of step `epoch` (`expected_in_round`): a group that holds them all
        assembles at once instead of waiting for matchmaking_time (EpochKeyedMatchmaking.expect_peers)."""
        records = [(record.peer_id, record.epoch) for record in self.tracker.active_peers.values()]
        return expected_in_round(self.dht.peer_id.to_bytes(), records, epoch)

    def _update_global_epoch(self, grad_scaler: Any) -> None:
        began = time.monotonic()
        # the averaging decision must not rest on a view up to max_refresh_period old; one just read (the waits at the
        # end of a step read every PROGRESS_RECHECK_PERIOD, and so does each local step once the step is due) is read
        # again only after that period: the second read, 0.03-0.12 s through links busy with the previous round
        # (benchmarks/compute_utilization.py --debug), came right after the first in every step of every peer
        self.tracker.refresh_if_older(PROGRESS_RECHECK_PERIOD)
        read_s = time.monotonic() - began
        if isinstance(self.state_averager, ReportingMixin):  # (counted in averaging_rounds; see ReportingMixin)
            self.state_averager.round_reports()  # the parameter rounds' reports, read at every step as the gradients'
        if self._missed_the_round():
            logger.info(
                f"The swarm finished step {self.local_epoch} without this peer: downloading its state instead of "
                "stepping alone"
            )
            self.load_state_from_peers()
            return
        self._key_rounds_by_step()
        if isinstance(self.grad_averager, RobustGradientAverager | RobustPowerSGDGradientAverager):  # weight caps
            self.grad_averager.use_reported_progress(self.tracker.records_for_round(), self.local_epoch)
        self._stepped_alone = self._left_behind = False
        rounds_began = time.monotonic()
        try:
            with self.state_averager.priority_held():  # this peer declares the new step itself (_declare_once_applied)
                super()._update_global_epoch(grad_scaler)
        finally:
            self._last_transition_s = time.monotonic() - rounds_began  # (its averaging rounds: see _contributions)
            self._step_began = get_dht_time()
            logger.debug(f"Step {self.local_epoch}: began after {time.monotonic() - began:.3f} s (read {read_s:.3f} s)")
        if self._left_behind:  # the swarm finished the step while this peer looked for a group: take its state
            logger.info(
                f"The swarm moved on to step {self.tracker.global_epoch} without this peer: downloading its state"
            )
            self.load_state_from_peers()
            self._resync_epoch = None
            return
        partial = any(report.peers and not report.complete for report in self._new_gradient_reports())
        differs = self._stepped_alone or (partial and self.tracker.has_other_peers)
        self._resync_epoch = self.local_epoch if differs else None
        self._declare_once_applied(complete=not differs)

    @staticmethod
    def _live_round(control: Any) -> bool:
        """A scheduled round (StepControl) that was not used yet."""
        return control is not None and not control.triggered and not control.done()

    def _begin_averaging_gradients(self, grad_scaler: Any) -> bool:
        """hivemind's, but a round that was already used (the previous step's, when no round was scheduled for this
        one: the progress fetch that made the step due came after this step's scheduling check) is dropped and a new
        one begun. hivemind logged "Not using pre-scheduled group" and skipped averaging: the peer stepped alone with
        its own gradients, and the others then downloaded its state (seen with 4 peers and 0.1 s local steps)."""
        if self.scheduled_grads is not None and not self._live_round(self.scheduled_grads):
            self.scheduled_grads = None
        return super()._begin_averaging_gradients(grad_scaler)

    def _new_gradient_reports(self) -> list:
        """Reports of the gradient rounds finished since the last look (also counted in `averaging_rounds`)."""
        averager = getattr(self, "grad_averager", None)
        return averager.round_reports() if isinstance(averager, ReportingMixin) else []

    def _average_gradients_and_load_into_optimizer(self, maybe_step_control: Any) -> None:
        """hivemind's, but while this peer still looks for a group, it watches the swarm: if the others finish the
        step without it (a peer that came late to a round, or whose group request was lost), it stops waiting (hivemind
        waited the whole averaging_timeout, then stepped alone) and downloads their state after the step
        (`_left_behind`). If every other peer is gone meanwhile (they do not answer pings: `_without_the_gone`), it
        stops waiting too, and steps with its own gradients."""
        control, alone = maybe_step_control, 0
        deadline = time.monotonic() + self.averaging_timeout
        while control is not None and not control.done() and control.stage == AveragingStage.LOOKING_FOR_GROUP:
            if time.monotonic() >= deadline or not self.dht.is_alive():  # (the peer shut down meanwhile)
                break
            time.sleep(LEFT_BEHIND_POLL)
            swarm, others = self.tracker.peek()  # (the tracker is paused here: its lock is held)
            if swarm > self.local_epoch and newest_served_step(self.dht, self.run_id) >= swarm:
                if control.stage == AveragingStage.LOOKING_FOR_GROUP and control.cancel():
                    self._left_behind = True
                break
            alone = 0 if others else alone + 1  # (two reads in a row: one read may miss a record, as a replica can)
            if alone >= 2 and control.stage == AveragingStage.LOOKING_FOR_GROUP and control.cancel():
                # every other peer left (died: its record outlives it) while this one looked for a group with them:
                # step with this peer's own gradients now rather than after averaging_timeout (a 2-peer swarm's
                # survivor lost 30 s at the step its groupmate died)
                logger.info(f"Step {self.local_epoch}: no other peer is left to average with: not waiting for a group")
                break
        super()._average_gradients_and_load_into_optimizer(maybe_step_control)

    # --- after a round that failed while other peers were there: back to the swarm's state ----------------------

    def _load_local_gradients_into_optimizer(self) -> None:
        """hivemind's fallback after a failed gradient round (this peer's own gradients, see RobustGradientAverager);
        with other peers in the swarm, this peer's parameters now differ from theirs: it re-syncs before its next
        step (`_resync`)."""
        self._stepped_alone = self.tracker.has_other_peers
        super()._load_local_gradients_into_optimizer()

    def _declare_state(self, *, complete: bool, epoch: int | None = None) -> None:
        """The priority this peer serves its state with: its step, + 0.5 if its last round was complete, + a fraction
        from its peer ID. Joiners download from the highest; a peer that stepped alone re-syncs from a higher one
        (`state_priority`)."""
        self._deferred_declaration = None
        if not self.client_mode:
            self._declared = state_priority(self.local_epoch if epoch is None else epoch, complete, self._tiebreak)
            self.state_averager.state_sharing_priority = self._declared

    def _declare_once_applied(self, *, complete: bool) -> None:
        """[background mode] The new step's state is declared once the update that makes it is applied. hivemind
        declares it as the step's round begins; the peers' test "a peer serves a state of the swarm's step, so its
        round is over" (`_missed_the_round`) then held while that round still ran, and the last peer to a step's
        group gave its round up as the group assembled and downloaded a state that did not hold the step's update yet
        (test_swarm.py's background test, a clean-clone run: both peers ended an update short). Until then the state
        this peer holds stays declared (hivemind's declaration at the transition is held back: `priority_held`)."""
        self._declare_if_applied()
        in_flight = {update for update in list(self.state_averager.pending_updates) if not update.done()}
        if not (self.delay_optimizer_step and in_flight):
            return self._declare_state(complete=complete)
        self._deferred_declaration = (self.local_epoch, complete, in_flight)

    def _declare_if_applied(self) -> None:
        deferred = self._deferred_declaration
        if deferred is not None and all(update.done() for update in deferred[2]):
            self._declare_state(complete=deferred[1], epoch=deferred[0])

    def _resync_due(self) -> bool:
        """Try to re-sync before each local step of the step that differs (at most every RESYNC_PERIOD seconds: the
        peer to copy may not have declared its new state yet); give up once the swarm moved on to the next step."""
        if self._resync_epoch != self.local_epoch:
            self._resync_epoch = None
            return False
        if time.monotonic() < self._next_resync:
            return False
        self._next_resync = time.monotonic() + RESYNC_PERIOD
        return True

    def _resync(self) -> bool:
        """Download the state of a peer that served a higher priority than this one's (same step and a complete round,
        or a later step), if any is reachable; otherwise keep training from this peer's own state."""
        own = state_priority(self.local_epoch, False, self._tiebreak)
        local = self.local_epoch

        def accept(peer: str, priority: Any) -> bool:
            return isinstance(priority, int | float) and priority > own

        def check(metadata: dict, tensors: list, num_parameters: int) -> str | None:
            return None if metadata.get("epoch", -1) >= local else f"it is of step {metadata.get('epoch')}"

        try:
            loaded = download_state(self, accept, check, what="re-syncing after a round without the swarm")
        except Exception as e:  # a failed download must never stop training
            logger.warning(f"Re-syncing with the swarm failed ({e!r}); training on from this peer's state")
            return False
        if loaded is None:
            return False
        metadata, tensors = loaded
        load_state(self, metadata, tensors, step=int(metadata["epoch"]))
        self._declare_state(complete=True)
        self._resync_epoch = None
        logger.info(f"Back in step with the swarm: loaded its state at step {self.local_epoch}")
        return True

    def load_state_from_peers(self, **kwargs: Any) -> None:
        with fixes.changing_state():
            self._load_state_from_peers(**kwargs)
        # hivemind moves a peer one step behind to the swarm's step ("Catching up with collaboration step") without
        # its LR schedule: the next step then ran with the previous step's LR, and the logged LR lagged a step
        self.state_averager._update_scheduler()
        self._declare_state(complete=True)
        self._step_began = get_dht_time()

    def _load_state_from_peers(self, **kwargs: Any) -> None:
        """hivemind 1.1.12's `Optimizer.load_state_from_peers` (copied from hivemind/optim/optimizer.py), with its
        retries bounded: hivemind retried a download whose load raised at once and without end. A plain hivemind peer's
        optimizer state, before trahiv's layout check, raised there at every try: 2,836 tracebacks in 28 s, the peer
        stuck (hivemind's guard catches the StopIteration of too few leaves, but Python turns it into a RuntimeError
        inside the generator that packs them). After LOAD_ATTEMPTS in a row the peer keeps its own state, as when no
        peer serves one."""
        opt: Any = self  # (hivemind's attributes are untyped)
        if opt.scheduled_grads is not None and not opt.scheduled_grads.done():
            opt._tag_along_with_zero_weight(opt.scheduled_grads)
            opt.scheduled_grads = None
        opt.state_averager.step(wait_for_delayed_updates=True)

        with opt.tracker.pause_updates():
            for attempt in range(1, LOAD_ATTEMPTS + 1):
                try:
                    opt.state_averager.load_state_from_peers(timeout=opt.load_state_timeout, **kwargs)
                    if opt.grad_averager is not None:
                        opt.grad_averager.load_state_from_peers(timeout=opt.load_state_timeout, **kwargs)
                    break
                except Exception as e:
                    last = attempt == LOAD_ATTEMPTS
                    logger.warning(
                        f"Loading the swarm's state failed ({e!r}, attempt {attempt} of {LOAD_ATTEMPTS})"
                        + ("; keeping this peer's own state" if last else ""),
                        exc_info=last,
                    )

            if opt.tracker.global_epoch - 1 <= opt.local_epoch < opt.tracker.global_epoch:
                logger.log(opt.status_loglevel, f"Catching up with collaboration step {opt.tracker.global_epoch}")
                opt.state_averager.local_epoch = opt.tracker.global_epoch

            opt.tracker.report_local_progress(local_epoch=opt.local_epoch, samples_accumulated=0)

            if not opt.client_mode:
                opt.state_averager.state_sharing_priority = opt.local_epoch

            if opt.use_gradient_averaging:
                opt.grad_averager.reset_accumulated_grads_()
                if not opt.client_mode:
                    opt.grad_averager.state_sharing_priority = opt.local_epoch

    def _missed_the_round(self) -> bool:
        """Other peers already moved past this peer's step and this peer is in no group of that step's round: their
        round is over (`trahiv.protocol.missed_round`). hivemind would run a round of its own (with nobody: local
        gradients) and step, leaving this peer with other parameters than the swarm's; a late joiner's first steps did
        exactly that. A round it still looks for a group for is cancelled."""
        if self.auxiliary or not self.use_gradient_averaging or self.tracker.global_epoch <= self.local_epoch:
            return False
        control: Any = getattr(self, "scheduled_grads", None)
        grouped, swarm = in_group(control), self.tracker.global_epoch
        served = -1 if grouped else newest_served_step(self.dht, self.run_id)
        if not missed_round(self.local_epoch, swarm, in_group=grouped, newest_served=served):
            return False
        if control is not None and not control.done():
            control.cancel()
        self.scheduled_grads = None
        return True

    def step(self, closure=None, batch_size: int | None = None, grad_scaler=None):
        fixes.raise_if_interrupted()  # (a lost engine process: stop between steps, see trahiv.engine.liveness)
        batch_size = batch_size if batch_size is not None else self.pending_batch_size
        self.pending_batch_size = None
        self._key_rounds_by_step()
        self._declare_if_applied()
        try:
            if self.revert is not None and self.revert.maybe_apply(self):
                return None  # a moderator reverted the swarm: gradients of the replaced parameters are dropped
            if self._resync_epoch is not None and self._resync_due():
                if self._resync():
                    return None  # this batch's gradients were computed with the replaced parameters
            self._refresh_progress_if_due()
            return super().step(closure=closure, batch_size=batch_size, grad_scaler=grad_scaler)
        finally:
            fixes.raise_if_interrupted()  # a Ctrl+C / SIGTERM that hivemind swallowed while averaging

    def finish_background_update(self) -> None:
        """[background mode] Wait for the update of the step just reached (its optimizer step runs in the averager's
        executor, at most averaging_timeout) and apply it to the model. hivemind applies it at the next local step, or
        when it shuts down: a checkpoint saved meanwhile held the weights of the step before under this step's name,
        and the model `Trainer.train()` returned lacked the last update whenever leaving took longer than the swarm's
        shutdown waits for (-7 for -8 in a run of tests/test_swarm.py's background test)."""
        if self.delay_optimizer_step:
            self.state_averager.step(wait_for_delayed_updates=True)

    def whole_step(self, timeout: float = WHOLE_STATE_WAIT) -> int | None:
        """The step whose parameters, optimizer statistics and schedule this peer holds, all of them (what a checkpoint
        must hold), or None: an interrupt came while they changed (`fixes.changing_state`), or an update still runs or
        waits to be applied after `timeout` seconds (background mode)."""
        if fixes.interrupted_mid_change():
            return None
        averager = self.state_averager
        if isinstance(averager, RobustTrainingStateAverager) and not averager.settled(timeout):
            return None
        return self.local_epoch

    def zero_grad(self, set_to_none: bool = True) -> None:
        """hivemind's, once the last local step's gradients are in the accumulators (`OverlappedAccumulation` may
        still be reading them: zeroing them in place must wait)."""
        finish = getattr(self.grad_averager, "finish_accumulation", None)
        if finish is not None:
            finish()
        super().zero_grad(set_to_none=set_to_none)

    def serve_late_peers(self) -> None:
        """Training ended: keep serving this peer's state while another trainer is still a step behind (its progress
        record at this peer's step - 1, and it answers pings: a frozen peer counts, a dead one does not), for at most a
        round's timeout plus matchmaking_time. The round of the last step went on without that peer, and it downloads
        the result once it sees the swarm past its step (`_missed_the_round`). Leaving at once, the last peers of a
        run stopped serving as the peer left out of their last round came to download it: with nobody to download
        from, it took the step with its own gradients and ended apart from them (tests/test_ring.py's toy ring beside
        a busy core, run DP). As DiLoCoOptimizer.serve_late_peers does for DiLoCo (`serve_while_late`)."""
        if self.auxiliary or not self.tracker.has_other_peers:
            return
        own, step = self.dht.peer_id.to_bytes(), self.local_epoch

        def late() -> list[bytes]:
            self.tracker.refresh_now()
            # (asked with pings here: `active_peers` keeps a silent record while this peer has no samples in its step,
            # so a dead peer's record, which outlives it by up to a minute, was served that whole wait: 32 s of the
            # peer resumed in tests/test_faults.py's kill_dht case)
            records = self.tracker.active_peers.values()
            return [r.peer_id for r in records if r.peer_id != own and r.epoch == step - 1 and not self.tracker.gone(r)]

        serve_while_late(
            late,
            self.averaging_timeout + self.matchmaking_time,
            lambda peers: (
                f"Training ended at step {step}: serving its state to {len(peers)} peer(s) still at the step before"
            ),
            f"Stopped serving the state of step {step}",
        )

    def shutdown(self) -> None:
        """hivemind's, once this peer's last round, still running in the background (`delay_grad_averaging`), has
        ended (at most averaging_timeout): hivemind says goodbye first, withdrawing this peer's progress record, and
        the peers still computing their last batch of that step (promised, see SwarmProgressTracker.promise) lost its
        samples, computed the step again alone and averaged without it (benchmarks/compute_utilization.py's last
        step: 144 samples for the two peers left, a partial round for all four)."""
        for update in list(self.state_averager.pending_updates):
            try:
                update.result(timeout=self.averaging_timeout)
            except Exception as e:  # leaving goes on: the round's own report says how it ended
                logger.debug(f"The last background update ended with {e!r}")
        for name in ("scheduled_grads", "scheduled_state"):
            control = getattr(self, name, None)
            if control is not None and control.done():
                # over (used, failed or cancelled): nothing to say goodbye to. hivemind's shutdown cancels a round
                # whose stage still reads LOOKING_FOR_GROUP, and one this peer cancelled itself (it left a search the
                # swarm had moved past) reads so until its averager process ends the search: the second cancel raised
                # InvalidStateError and the averagers were not shut down (seen leaving, stop 50's run CZ)
                setattr(self, name, None)
        super().shutdown()

    def _refresh_progress_if_due(self) -> None:
        """hivemind fetches the swarm's progress only every 0.5-10 s (tracker refresh periods); until then a peer
        whose own samples do not reach target_batch_size keeps accumulating, well past the target when local steps are
        short (4 peers x 1 step of target: ~4x the target per collaborative step, benchmarks/convergence.py). Once the
        swarm should have reached the target by hivemind's estimate (its ETA, on which trahiv does not step), fetch
        the progress before each local step, at most every PROGRESS_RECHECK_PERIOD seconds."""
        tracker, now = self.tracker, time.monotonic()
        if self.auxiliary or now < self._next_progress_check or tracker.ready_to_update_epoch:
            return
        if get_dht_time() < tracker.global_progress.eta_next_epoch:
            return
        self._next_progress_check = now + PROGRESS_RECHECK_PERIOD
        tracker.refresh_now()

    def _check_and_accumulate_gradients(self, batch_size: int, grad_scaler: Any) -> bool:
        accumulated = super()._check_and_accumulate_gradients(batch_size, grad_scaler)
        if accumulated:
            self.samples_contributed += batch_size
            self._last_batch = batch_size
        return accumulated


# --- how every peer of a swarm builds its averagers (trainers, and the auxiliary peer that helps average) -------------


def request_timeout(opt: OptimizerConfig) -> float:
    """Matchmaking requests must time out before the matchmaking window closes (the engine warns otherwise)."""
    return min(3.0, opt.matchmaking_time / 2)


def tracker_opts(opt: OptimizerConfig) -> dict[str, Any]:
    """Progress refresh periods: peers must notice that the swarm moved on while the averaging group still forms."""
    refresh = min(10.0, opt.matchmaking_time / 2)
    return {"max_refresh_period": refresh, "default_refresh_period": min(3.0, refresh),
            "min_refresh_period": min(0.5, refresh), **opt.tracker_opts}  # fmt: skip


def grad_averager_factory(
    opt: OptimizerConfig, gate: AuthGate | None, cls: type[RobustGradientAverager] = ReportingGradientAverager
) -> Callable[..., RobustGradientAverager]:
    """The swarm's gradient averager (hivemind.Optimizer's `grad_averager_factory`): robust aggregation, weights
    clamped to the samples each peer reported, partial rounds reported under payload-based deadlines, PowerSGD when
    asked, and (moderated swarms) only token holders served. It does not offer its "state" for download
    (`allow_state_sharing=False`): nobody downloads it (RobustGradientAverager.load_state_from_peers), and hivemind's
    averager re-announced it in the DHT at every change of its priority: 5 stores a step with 16 peers, each sent to
    every other node (benchmarks/swarm_cost.py)."""
    records = progress_key(opt.run_id)  # weights are clamped to the samples each peer reported there
    target = opt.target_batch_size  # ... at most this (x WEIGHT_SLACK) for peers already past the round's step
    if opt.power_sgd_rank is not None:  # low-rank factors with error feedback, robust mean (config checks)
        return partial(
            gated(RobustPowerSGDGradientAverager, gate),
            averager_rank=opt.power_sgd_rank,
            request_timeout=request_timeout(opt),
            progress_key=records,
            target_batch_size=target,
            deadlines=Deadlines(),
            allow_state_sharing=False,
        )
    factory = partial(
        gated(cls, gate),
        request_timeout=request_timeout(opt),
        allow_state_sharing=False,
        aggregation=Aggregation(**opt.aggregation.model_dump()),
        progress_key=records,
        target_batch_size=target,
    )
    if issubclass(cls, ReportingMixin):  # partial rounds reported, payload-based deadlines
        factory = partial(factory, deadlines=Deadlines())
    if opt.gradient_allreduce != "butterfly" and issubclass(cls, ReportingGradientAverager):  # (others: the butterfly)
        factory = partial(factory, allreduce=opt.gradient_allreduce)
    return factory


def aux_state_averager_factory(opt: OptimizerConfig, gate: AuthGate | None) -> Callable[..., AuxiliaryStateAverager]:
    """An auxiliary peer's side of the trainers' parameter rounds (trahiv.auxiliary.helper): their aggregation, round
    reports under payload-based deadlines, and (moderated swarms) only token holders served."""
    return partial(
        gated(AuxiliaryStateAverager, gate),
        request_timeout=request_timeout(opt),
        aggregation=Aggregation(**opt.aggregation.model_dump()),
        deadlines=Deadlines(),
    )


def stop_tracker_quietly(tracker: Any, timeout: float) -> None:
    """ProgressTracker.shutdown() without its last DHT store (it withdraws this peer's progress record, which a peer
    that reports no samples never published; hivemind drops that store's future, and the DHT process then logs an
    error reading it while this process exits)."""
    tracker.shutdown_triggered.set()
    tracker.should_report_progress.set()
    tracker.global_state_updated.set()
    tracker.shutdown_complete.wait(timeout)


# --- `trahiv aux` flags -------------------------------------------------------------------------------------------
