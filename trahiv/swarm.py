"""Where a peer joins: start the DHT, print the join addresses, check the model against the swarm's, build the
collaborative optimizer, report swarm metrics, and leave cleanly."""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

import hivemind
import torch
from hivemind.optim.progress_tracker import LocalTrainingProgress, ProgressTracker
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.p2p import PeerID
from hivemind.utils import ValueWithExpiration, get_dht_time

from trahiv import engine
from trahiv.auth import AuthGate, PeerAuth, gated
from trahiv.averaging import Aggregation, RobustGradientAverager, RobustTrainingStateAverager
from trahiv.averaging.partial import Deadlines, ReportingGradientAverager, ReportingMixin, ReportingStateAverager
from trahiv.averaging.power_sgd import RobustPowerSGDGradientAverager
from trahiv.averaging.traffic import total_traffic
from trahiv.compression import make_compression
from trahiv.config import DHTConfig, HivemindConfig, OptimizerConfig
from trahiv.metrics import MetricsPublisher, MetricsRecord
from trahiv.revert import RevertFollower, RevertWatcher

engine.apply()
logger = logging.getLogger("trahiv.swarm")

__all__ = ["Swarm", "SwarmJoinError", "SwarmOptimizer", "model_fingerprint", "newest_served_step", "start_dht"]

MODEL_RECORD_TTL = 600.0  # seconds a peer's model fingerprint stays in the DHT without refresh
UNCONFIRMED_CHECK_PERIOD = 120.0  # seconds between state downloads that check a lone far-ahead progress record
PROGRESS_RECHECK_PERIOD = 0.1  # seconds between progress fetches once the swarm should have reached its target


def show_swarm_events() -> None:
    """Print trahiv's INFO events (peers joining and leaving, catching up) unless the application set up logging."""
    root = logging.getLogger("trahiv")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s [trahiv] %(message)s", "%b %d %H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False


def newest_served_step(dht: hivemind.DHT, run_id: str) -> int:
    """The highest collaborative step another peer offers its state at: trainers and auxiliary peers declare the
    step of the state they serve as their state-sharing priority under `{run_id}_state_averager.all_averagers`."""
    found = dht.get(f"{run_id}_state_averager.all_averagers", latest=True)
    entries = found.value if found is not None and isinstance(found.value, dict) else {}
    own = dht.peer_id.to_bytes()
    steps = [getattr(entry, "value", None) for peer, entry in entries.items() if peer != own]
    valid = [int(s) for s in steps if isinstance(s, int | float) and not isinstance(s, bool) and 0 <= s < 2**62]
    return max(valid, default=0)


class SwarmJoinError(RuntimeError):
    """This peer could not start or reach the swarm."""


def start_dht(config: DHTConfig, **extra: Any) -> hivemind.DHT:
    """Start a DHT peer; raise SwarmJoinError with a clear reason if it cannot start or reach its initial peers."""
    kwargs = {**config.kwargs(), **extra}
    try:
        return hivemind.DHT(start=True, **kwargs)
    except Exception as e:
        if config.initial_peers:
            raise SwarmJoinError(
                f"could not join the swarm through initial_peers={config.initial_peers}: {e}. Check that a peer is "
                "running there, that the address and /p2p/ ID were copied whole, and that the port is reachable."
            ) from e
        raise SwarmJoinError(f"could not start the DHT (host_maddrs={config.host_maddrs}): {e}") from e


def _start_auth(config: HivemindConfig) -> PeerAuth | None:
    """With `auth` configured: this peer's first access token (AuthError with the server's reason if refused)."""
    if config.auth is None:
        return None
    return PeerAuth.start(
        config.auth.server,
        config.auth.token.get_secret_value(),
        config.opt.run_id,
        identity_path=config.dht.identity_path,
        timeout=config.auth.timeout,
        experiment_public_key=config.auth.experiment_public_key,
    )


def join_addresses(dht: hivemind.DHT) -> list[str]:
    return [str(maddr) for maddr in dht.get_visible_maddrs()]


def model_fingerprint(
    named_parameters: Iterable[tuple[str, torch.Tensor]], swarm_tensors: Sequence[torch.Tensor] | None = None
) -> dict[str, Any]:
    """Names, shapes and dtypes of the trainable tensors: peers must agree on these to average. With `swarm_tensors`
    (the trainable tensors in the order the swarm's optimizer gets them), also their `schema` ([dtype, shape] each):
    an auxiliary peer that helps average builds its averager from it, without the model."""
    digest, count, numel = hashlib.sha256(), 0, 0
    for name, param in named_parameters:
        if param.requires_grad:
            digest.update(f"{name}:{tuple(param.shape)}:{param.dtype};".encode())
            count, numel = count + 1, numel + param.numel()
    fingerprint: dict[str, Any] = {"digest": digest.hexdigest()[:32], "tensors": count, "parameters": numel}
    if swarm_tensors is not None:
        fingerprint["schema"] = [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in swarm_tensors]
    return fingerprint


SCHEMA_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64"})  # what trainable tensors can be


def _is_fingerprint(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and {"digest", "tensors", "parameters"} <= set(value) <= {"digest", "tensors", "parameters", "schema"}
        and isinstance(value["digest"], str)
        and len(value["digest"]) == 32
        and all(type(value[k]) is int and value[k] >= 0 for k in ("tensors", "parameters"))
        and ("schema" not in value or _is_schema(value["schema"], value["tensors"], value["parameters"]))
    )


def _is_schema(schema: Any, tensors: int, parameters: int) -> bool:
    """[[dtype, shape], ...]: `tensors` entries of known dtypes whose shapes hold `parameters` values in all."""
    if not isinstance(schema, list) or len(schema) != tensors:
        return False
    total = 0
    for entry in schema:
        if not (isinstance(entry, list | tuple) and len(entry) == 2 and isinstance(entry[0], str)):
            return False
        if entry[0] not in SCHEMA_DTYPES:
            return False
        shape = entry[1]
        if not (isinstance(shape, list | tuple) and len(shape) <= 8 and all(type(d) is int and d > 0 for d in shape)):
            return False
        total += math.prod(shape)
    return total == parameters


def model_records(dht: hivemind.DHT, run_id: str) -> dict[str, dict[str, Any]]:
    """Well-formed model fingerprints announced for run `run_id`, by peer (malformed records are ignored)."""
    found = dht.get(f"{run_id}_model", latest=True)
    entries = found.value if found is not None and isinstance(found.value, dict) else {}
    values = {str(peer): getattr(entry, "value", None) for peer, entry in entries.items()}
    return {peer: value for peer, value in values.items() if value is not None and _is_fingerprint(value)}


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
        super().__init__(*args, **kwargs)

    @property
    def ready_to_update_epoch(self) -> bool:
        return (
            self.global_epoch > self.local_progress.epoch
            or self.global_progress.samples_accumulated >= self.target_batch_size
        )

    @property
    def estimated_next_update_time(self) -> float:
        return get_dht_time() if self.ready_to_update_epoch else self.global_progress.eta_next_epoch

    @property
    def has_other_peers(self) -> bool:
        own = self.dht.peer_id.to_base58()
        return any(peer != own for peer in self.active_peers)

    def refresh_now(self) -> None:
        """Fetch the swarm's progress right away (before a collaborative step: who is there to average with?)."""
        with self.lock_global_progress:
            found = self.dht.get(self.training_progress_key, latest=True)
            self.global_progress = self._parse_swarm_progress_data(found.value if found is not None else None)

    def _parse_swarm_progress_data(self, metadata: Any):
        records = self._trusted_records(self._well_formed_records(metadata))
        sanitized = {key: ValueWithExpiration(record.dict(), expires) for key, (record, expires) in records.items()}
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


def trusted_epoch(epochs: list[int], local_epoch: int) -> int:
    """The highest step a progress record may report: one ahead of this peer's, or more where at least
    max(2, majority of the records) report at least that much."""
    quorum = max(2, len(epochs) // 2 + 1)
    ahead = sorted((epoch for epoch in epochs if epoch > local_epoch + 1), reverse=True)
    return ahead[quorum - 1] if len(ahead) >= quorum else local_epoch + 1


class SwarmOptimizer(hivemind.Optimizer):
    """hivemind.Optimizer with trahiv's fixes: the DHT's client mode is always honoured (1.1.12 drops it), each step
    can report its true number of samples, and the samples this peer contributed are counted."""

    tracker: SwarmProgressTracker
    state_averager_cls: type[RobustTrainingStateAverager] = ReportingStateAverager  # tests swap in a faulty one

    def __init__(self, *, dht: hivemind.DHT, state_averager_cls: type | None = None, **kwargs: Any):
        if state_averager_cls is not None:  # e.g. with the auth gate (trahiv.auth.gate)
            self.state_averager_cls = state_averager_cls
        kwargs["client_mode"] = dht.client_mode  # 1.1.12 reads `client_mode` inverted: pass the DHT's explicitly
        self.pending_batch_size: int | None = None
        self.samples_contributed = 0
        self.revert: Any = None  # trahiv.revert.RevertFollower in a moderated swarm
        self._next_unconfirmed_check = time.monotonic() + UNCONFIRMED_CHECK_PERIOD
        self._next_progress_check = 0.0
        super().__init__(dht=dht, **kwargs)

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
            prefix=self.run_id,
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

    def _maybe_schedule_state_averaging(self) -> None:
        if self.tracker.has_other_peers:
            super()._maybe_schedule_state_averaging()

    def _update_global_epoch(self, grad_scaler: Any) -> None:
        self.tracker.refresh_now()  # the averaging decision must not rest on a view up to max_refresh_period old
        super()._update_global_epoch(grad_scaler)

    def step(self, closure=None, batch_size: int | None = None, grad_scaler=None):
        batch_size = batch_size if batch_size is not None else self.pending_batch_size
        self.pending_batch_size = None
        try:
            if self.revert is not None and self.revert.maybe_apply(self):
                return None  # a moderator reverted the swarm: gradients of the replaced parameters are dropped
            self._refresh_progress_if_due()
            return super().step(closure=closure, batch_size=batch_size, grad_scaler=grad_scaler)
        finally:
            engine.raise_if_interrupted()  # a Ctrl+C / SIGTERM that hivemind swallowed while averaging

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
        return accumulated


class Swarm:
    """One peer's membership in a swarm: its DHT, its collaborative optimizer, its metrics."""

    grad_averager_cls: type[RobustGradientAverager] = ReportingGradientAverager  # tests swap in a faulty one

    def __init__(self, config: HivemindConfig, *, announce: Callable[[str], None] = print):
        show_swarm_events()
        self.config = config
        self.auth = _start_auth(config)  # before the DHT: a refused peer stops here, with the server's reason
        try:
            self.dht = start_dht(config.dht, **(self.auth.dht_kwargs() if self.auth is not None else {}))
        except BaseException:
            if self.auth is not None:
                self.auth.close()
            raise
        if self.auth is not None:
            self.auth.attach(self.dht, self._contribution)
        self.revert_watcher: RevertWatcher | None = None
        if self.auth is not None:  # moderators' revert orders, signed by the experiment key
            client = self.auth.client
            self.revert_watcher = RevertWatcher(self.dht, self.run_id, self.auth.experiment_public_key, client).start()
        self.optimizer: SwarmOptimizer | None = None
        self.diloco: Any = None  # [DiLoCo] trahiv.diloco.DiLoCoOptimizer, instead of `optimizer`, in DiLoCo mode
        self.started_at = time.monotonic()
        self._model: dict[str, Any] | None = None
        self._model_published_at = -float("inf")
        self.metrics_publisher: MetricsPublisher | None = None
        if config.metrics.publish:  # validators first: this peer's DHT node then also rejects bad records
            name = config.metrics.name or (self.auth.username[:32] if self.auth is not None else None)  # leaderboard
            self.metrics_publisher = MetricsPublisher(self.dht, self.run_id, peer_id=self.peer_id, name=name)
        self._samples_at_last_record = 0
        announce(f"To join the training, use initial_peers = {join_addresses(self.dht)}")

    @property
    def run_id(self) -> str:
        return self.config.opt.run_id

    @property
    def peer_id(self) -> str:
        return self.dht.peer_id.to_base58()

    def peer_seed(self, base_seed: int = 0) -> int:
        """A seed that differs between peers (from the peer's identity) and is stable for one peer."""
        digest = hashlib.sha256(self.dht.peer_id.to_bytes() + str(base_seed).encode()).digest()
        return int.from_bytes(digest[:8], "little") & (2**63 - 1)

    # --- the model every peer must share ----------------------------------------------------------------------

    def check_model(self, fingerprint: dict[str, Any]) -> None:
        """Refuse to train if peers of this run already train a model with other trainable tensors."""
        for peer, theirs in self._model_records().items():
            if peer != self.peer_id and theirs["digest"] != fingerprint["digest"]:
                raise ValueError(
                    f"this peer's model does not match the one swarm {self.run_id!r} trains: here "
                    f"{fingerprint['tensors']} trainable tensors / {fingerprint['parameters']:,} parameters "
                    f"(digest {fingerprint['digest'][:12]}), peer {peer} has {theirs['tensors']} tensors / "
                    f"{theirs['parameters']:,} parameters (digest {theirs['digest'][:12]}). Use the same model "
                    "config, the same PEFT settings and the same trainable parameters, or another run_id."
                )
        self._model = fingerprint
        self.publish_model(force=True)

    def _model_records(self) -> dict[str, dict[str, Any]]:
        return model_records(self.dht, self.run_id)

    def model_peers(self) -> set[str]:
        """Peers (this one included) that announced a model for this run."""
        return set(self._model_records())

    def wait_for_peers(self) -> int:
        """Block until `opt.min_peers` peers announced themselves (or `min_peers_timeout`); return how many did."""
        wanted, deadline = self.config.opt.min_peers, time.monotonic() + self.config.opt.min_peers_timeout
        peers = self.model_peers()
        while len(peers) < wanted and time.monotonic() < deadline:
            time.sleep(0.5)
            peers = self.model_peers()
        if len(peers) < wanted:
            logger.warning(f"Only {len(peers)} of min_peers={wanted} peers arrived in time; training anyway")
        return len(peers)

    def publish_model(self, force: bool = False) -> None:
        if self._model is None or (not force and time.monotonic() - self._model_published_at < MODEL_RECORD_TTL / 4):
            return
        self.dht.store(
            f"{self.run_id}_model",
            subkey=self.peer_id,
            value=self._model,
            expiration_time=get_dht_time() + MODEL_RECORD_TTL,
            return_future=not force,
        )
        self._model_published_at = time.monotonic()

    # --- the collaborative optimizer --------------------------------------------------------------------------

    def make_optimizer(
        self,
        param_groups: list[dict[str, Any]],
        optimizer_factory: Callable,
        scheduler_factory: Callable | None,
        batch_size_per_step: int,
    ) -> SwarmOptimizer:
        opt = self.config.opt
        compressions = {"grad_compression", "state_averaging_compression", "load_state_compression"}
        kwargs = opt.model_dump(exclude=compressions | {"batch_size_per_step"} | opt.TRAHIV_ONLY)
        kwargs["averager_opts"] = {"request_timeout": request_timeout(opt), **opt.averager_opts}
        gate = AuthGate(self.run_id, self.auth.experiment_public_key) if self.auth is not None else None
        if gate is not None:  # matchmaking, all-reduce and state download serve only peers with valid tokens
            kwargs["state_averager_cls"] = gated(SwarmOptimizer.state_averager_cls, gate)
        if not opt.use_local_updates:
            kwargs["grad_averager_factory"] = grad_averager_factory(opt, gate, self.grad_averager_cls)
        kwargs["tracker_opts"] = tracker_opts(opt)
        with engine.children_ignore_sigint():
            self.optimizer = SwarmOptimizer(
                dht=self.dht,
                params=param_groups,
                optimizer=optimizer_factory,
                scheduler=scheduler_factory,
                batch_size_per_step=opt.batch_size_per_step or batch_size_per_step,
                grad_compression=make_compression(opt.grad_compression),
                state_averaging_compression=make_compression(opt.state_averaging_compression),
                load_state_compression=make_compression(opt.load_state_compression),
                **kwargs,
            )
        if self.revert_watcher is not None:
            RevertFollower(self.revert_watcher).attach(self.optimizer)
        return self.optimizer

    def catch_up(self) -> bool:
        """Download the swarm's state if other peers are training; return True if state was loaded."""
        if self.optimizer is None:
            raise RuntimeError("catch_up() needs the optimizer: call make_optimizer() first")
        tracker = self.optimizer.tracker
        others = [peer for peer in {**tracker.active_peers, **tracker.ignored_records} if peer != self.peer_id]
        served = newest_served_step(self.dht, self.run_id)  # e.g. an auxiliary peer restarted from a checkpoint
        if not others and max(tracker.global_epoch, served) <= self.optimizer.local_epoch:
            return False
        logger.info(
            f"Swarm {self.run_id!r} is at step {max(tracker.global_epoch, served)} with {len(others)} other "
            "training peer(s); downloading its state before training"
        )
        self.optimizer.load_state_from_peers()
        return True

    def publish_metrics(self, loss: float | None) -> MetricsRecord | None:
        """Publish this peer's record for the collaborative step it just reached (in the background); `loss` is the
        mean over its local steps since the previous record."""
        if self.metrics_publisher is None or self.optimizer is None:
            return None
        opt, samples = self.optimizer, self.optimizer.samples_contributed
        step_samples, self._samples_at_last_record = samples - self._samples_at_last_record, samples
        return self.metrics_publisher.publish(
            step=opt.local_epoch,
            loss=loss,
            step_samples=step_samples,
            samples=samples,
            samples_per_second=opt.tracker.performance_ema.samples_per_second,
            seconds=time.monotonic() - self.started_at,
        )

    def metrics(self) -> dict[str, float]:
        if self.diloco is not None:  # [DiLoCo] outer step, rounds, bytes
            return self.diloco.metrics()
        if self.optimizer is None:
            return {}
        tracker = self.optimizer.tracker
        averagers = (self.optimizer.state_averager, getattr(self.optimizer, "grad_averager", None))
        return {
            "collaborative_step": self.optimizer.local_epoch,
            "swarm_peers": max(tracker.global_progress.num_peers, 1),
            "swarm_samples_per_second": round(tracker.swarm_samples_per_second, 3),
            "samples_contributed": self.optimizer.samples_contributed,
            **{f"averaging_rounds_{status}": count for status, count in self.optimizer.averaging_rounds().items()},
            **total_traffic(averagers),
        }

    # --- leaving --------------------------------------------------------------------------------------------

    def _contribution(self) -> tuple[int, int]:
        """(samples contributed, collaborative step) reported to the auth server when the access token is renewed."""
        if self.diloco is not None:  # [DiLoCo]
            return self.diloco.samples_total, self.diloco.outer_step
        if self.optimizer is None:
            return 0, 0
        return self.optimizer.samples_contributed, self.optimizer.local_epoch

    def engine_processes(self) -> list[Any]:
        """The engine's child processes of this peer (DHT, averagers); p2pd runs under the DHT process."""
        procs = [self.dht]
        if self.diloco is not None:  # [DiLoCo]
            procs.append(self.diloco.averager)
        if self.optimizer is not None:
            procs += [self.optimizer.state_averager, getattr(self.optimizer, "grad_averager", None)]
        return [p for p in procs if p is not None and p.pid is not None]

    def shutdown(self, timeout: float = 5.0) -> None:
        """Leave the swarm: say goodbye, stop the averagers, the DHT and p2pd; never wait more than `timeout`."""
        processes = self.engine_processes()
        if self.metrics_publisher is not None:  # the last step's record must reach the swarm before the DHT stops
            self.metrics_publisher.flush(timeout=min(2.0, timeout / 2))

        def close() -> None:
            try:
                if self.optimizer is not None and self.optimizer.is_alive():
                    self.optimizer.shutdown()
                if self.diloco is not None:  # [DiLoCo]
                    self.diloco.shutdown()
                if self.dht.is_alive():
                    self.dht.shutdown()
            except Exception as e:  # leaving must not raise: the processes are killed below anyway
                logger.warning(f"Error while leaving the swarm: {e!r}")

        if self.revert_watcher is not None:
            self.revert_watcher.close()
        if self.auth is not None:  # no renewal while the DHT stops
            self.auth.close()
        closer = threading.Thread(target=close, name="trahiv-shutdown", daemon=True)
        closer.start()
        closer.join(timeout)
        for process in processes:  # whatever did not stop in time is killed, with its children (p2pd)
            if process.is_alive():
                engine.kill_descendants(process.pid)
                process.kill()
                process.join(1.0)


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
    asked, and (moderated swarms) only token holders served."""
    progress_key = f"{opt.run_id}_progress"  # weights are clamped to the samples each peer reported there
    if opt.power_sgd_rank is not None:  # low-rank factors with error feedback, robust mean (config checks)
        return partial(
            gated(RobustPowerSGDGradientAverager, gate),
            averager_rank=opt.power_sgd_rank,
            request_timeout=request_timeout(opt),
            progress_key=progress_key,
            deadlines=Deadlines(),
        )
    factory = partial(
        gated(cls, gate),
        request_timeout=request_timeout(opt),
        aggregation=Aggregation(**opt.aggregation.model_dump()),
        progress_key=progress_key,
    )
    if issubclass(cls, ReportingMixin):  # partial rounds reported, payload-based deadlines
        factory = partial(factory, deadlines=Deadlines())
    return factory
