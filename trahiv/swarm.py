"""Where a peer joins: start the DHT, print the join addresses, check the model against the swarm's, build the
collaborative optimizer, report swarm metrics, and leave cleanly."""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import hivemind
import torch
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from trahiv import connectivity, protocol
from trahiv.auth import AuthGate, PeerAuth
from trahiv.compression import make_compression
from trahiv.config import DHTConfig, HivemindConfig
from trahiv.engine import fixes
from trahiv.engine.averagers import ReportingGradientAverager, RobustGradientAverager
from trahiv.engine.gate import gated
from trahiv.engine.optimizer import (
    SwarmOptimizer,
    grad_averager_factory,
    newest_served_step,
    request_timeout,
    tracker_opts,
)
from trahiv.engine.state import download_state, load_state
from trahiv.engine.traffic import total_traffic
from trahiv.engine.watch import attach_silence_watch, skip_state_rounds_that_cannot_form
from trahiv.errors import NOT_CONNECTED, debug_enabled, join_error_message
from trahiv.lifecycle import Lifecycle, join_swarm
from trahiv.metrics import MetricsPublisher, MetricsRecord
from trahiv.protocol import ready_peers, record_protocol, tensors_digest
from trahiv.revert import RevertFollower, RevertWatcher

logger = logging.getLogger("trahiv.swarm")

__all__ = ["Swarm", "SwarmJoinError", "model_fingerprint", "model_records", "start_dht"]

MODEL_RECORD_TTL = 600.0  # seconds a peer's model fingerprint stays in the DHT without refresh


def show_swarm_events() -> None:
    """Print trahiv's INFO events (peers joining and leaving, catching up) unless the application set up logging."""
    root = logging.getLogger("trahiv")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s [trahiv] %(message)s", "%b %d %H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False


JOIN_ATTEMPTS, JOIN_RETRY_PAUSE = 3, 2.0  # initial peers that do not answer: tries, and seconds between them
DHT_START_TIMEOUT = 120.0  # seconds for a DHT process to start and join (its p2p daemon's own start: up to 15 s)


class SwarmJoinError(RuntimeError):
    """This peer could not start or reach the swarm."""


class SwarmLostError(RuntimeError):
    """One of this peer's engine processes (DHT, p2pd, an averager) ended under it: it cannot reach the swarm."""


def start_dht(config: DHTConfig, **extra: Any) -> hivemind.DHT:
    """Start a DHT peer; raise SwarmJoinError with a clear reason if it cannot start or reach its initial peers."""
    kwargs = {**config.kwargs(), **extra}
    authenticated = bool(extra)
    dht = _start_dht(config, kwargs, authenticated)
    if config.client_mode in (None, "auto") and "client_mode" not in extra:  # client_mode 'auto': dial-back decides
        restart = lambda: _start_dht(config, kwargs, authenticated, True)  # noqa: E731
        dht = connectivity.settle_client_mode(dht, config.initial_peers, restart)
    return dht


def _start_dht(
    config: DHTConfig, kwargs: dict[str, Any], authenticated: bool, client_mode: bool | None = None
) -> hivemind.DHT:
    if client_mode is not None:
        kwargs = {**kwargs, "client_mode": client_mode}
    attempts = JOIN_ATTEMPTS if config.initial_peers else 1
    for attempt in range(1, attempts + 1):
        try:
            dht = hivemind.DHT(start=True, await_ready=False, **kwargs)
            _wait_until_started(dht)
            if not dht.client_mode:  # trahiv peers dial others back on request (trahiv doctor, client_mode 'auto')
                dht.run_coroutine(connectivity.serve_dialback_in_dht)
            return dht
        except SwarmJoinError:
            raise
        except Exception as e:  # one message, not hivemind's chained traceback (that with TRAHIV_DEBUG=1)
            if NOT_CONNECTED in str(e) and attempt < attempts:  # a busy or restarting peer: try again, then give up
                logger.debug(f"Nothing answered at {config.initial_peers} (attempt {attempt} of {attempts}): {e}")
                time.sleep(JOIN_RETRY_PAUSE)
                continue
            message = join_error_message(config.initial_peers, config.host_maddrs, e, authenticated=authenticated,
                                         attempts=attempt)  # fmt: skip
            raise SwarmJoinError(message) from (e if debug_enabled() else None)
    raise AssertionError("unreachable")


def _wait_until_started(dht: hivemind.DHT) -> None:
    """hivemind waits for a DHT process without a time limit: one that never reported ready (it was blocked on a lock
    that a killed engine process left held, see `fixes.free_locks_of_killed`) kept its peer waiting for good."""
    try:
        dht.wait_until_ready(DHT_START_TIMEOUT)
    except concurrent.futures.TimeoutError:
        fixes.kill_engine_processes([dht])
        raise SwarmJoinError(
            f"The DHT process did not start within {DHT_START_TIMEOUT:g} s (stopped); nothing else was started. "
            "Run again with TRAHIV_DEBUG=1 to see the engine's log."
        ) from None


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
    named_parameters: Iterable[tuple[str, torch.Tensor]],
    swarm_tensors: Sequence[torch.Tensor] | None = None,
    optimizer: str | None = None,
) -> dict[str, Any]:
    """Names, shapes and dtypes of the trainable tensors: peers must agree on these to average. With `swarm_tensors`
    (the trainable tensors in the order the swarm's optimizer gets them), also their `schema` ([dtype, shape] each):
    an auxiliary peer that helps average builds its averager from it, without the model; and a digest of their values
    (`weights`): peers that start together and hold the same weights download nothing. With `optimizer` (the class
    of the optimizer whose state peers exchange: synchronous mode), peers must agree on it too."""
    digest, count, numel = hashlib.sha256(), 0, 0
    for name, param in named_parameters:
        if param.requires_grad:
            digest.update(f"{name}:{tuple(param.shape)}:{param.dtype};".encode())
            count, numel = count + 1, numel + param.numel()
    fingerprint: dict[str, Any] = {
        "digest": digest.hexdigest()[:32],
        "tensors": count,
        "parameters": numel,
        "protocol": protocol.WIRE_PROTOCOL,  # (records without it come from a trahiv before the version was announced)
    }
    if optimizer is not None:
        fingerprint["optimizer"] = optimizer
    if swarm_tensors is not None:
        fingerprint["schema"] = [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in swarm_tensors]
        fingerprint["weights"] = tensors_digest(swarm_tensors)  # the values this peer starts from (Swarm.catch_up)
    return fingerprint


SCHEMA_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64"})  # what trainable tensors can be
FINGERPRINT_KEYS = frozenset(
    {"digest", "tensors", "parameters", "schema", "ready", "ready_at", "weights", "protocol", "optimizer"}
)


def _is_fingerprint(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and {"digest", "tensors", "parameters"} <= set(value) <= FINGERPRINT_KEYS
        and type(value.get("ready", False)) is bool
        and (type(value.get("weights", "")) is str and len(value.get("weights", "")) <= 32)
        and (type(value.get("optimizer", "")) is str and len(value.get("optimizer", "")) <= 200)
        and (type(value.get("ready_at", 0.0)) in (int, float) and math.isfinite(value.get("ready_at", 0.0)))
        and isinstance(value["digest"], str)
        and len(value["digest"]) == 32
        and all(type(value[k]) is int and value[k] >= 0 for k in ("tensors", "parameters"))
        and type(value.get("protocol", 0)) is int
        and value.get("protocol", 0) >= 0
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


def protocol_mismatch(run_id: str, peer: str, theirs: int, ours: int) -> str:
    """The message for a peer that speaks wire protocol `ours` and found `peer` of swarm `run_id` speaking `theirs`."""
    older = "an older" if theirs < ours else "a newer"
    speaks = f"trahiv's wire protocol {theirs}" if theirs else "a wire protocol from before trahiv numbered them"
    return (
        f"swarm {run_id!r} runs {older} trahiv than this peer: peer {peer} speaks {speaks}, this peer protocol {ours}, "
        "and their averaging rounds cannot be mixed (this peer would never share a group with it). Install the trahiv "
        "version the swarm runs on every peer, or use another run_id."
    )


def hivemind_progress_peers(dht: hivemind.DHT, run_id: str) -> set[str]:
    """Peers with a progress record under plain hivemind's key for `run_id` (`{run_id}_progress`; trahiv's peers keep
    theirs under `trahiv.protocol.progress_prefix`): hivemind.Optimizers training under this run_id."""
    found = dht.get(f"{run_id}_progress", latest=True)
    entries = found.value if found is not None and isinstance(found.value, dict) else {}
    peers = set()
    for entry in entries.values():
        value: Any = getattr(entry, "value", None)
        try:
            peers.add(PeerID(value["peer_id"]).to_base58())
        except Exception:  # (not a record: nothing to say about it)
            continue
    return peers


def hivemind_peers_warning(run_id: str, peers: set[str]) -> str:
    count = f"{len(peers)} peer trains" if len(peers) == 1 else f"{len(peers)} peers train"
    return (
        f"{count} under run_id {run_id!r} with plain hivemind (progress records under {run_id}_progress, e.g. "
        f"{min(peers)}): they share no averaging round with trahiv's peers, and their samples count in none of this "
        "swarm's steps; this peer trains with the trahiv peers of this run only. Use another run_id to keep the two "
        "runs apart."
    )


def model_records(dht: hivemind.DHT, run_id: str) -> dict[str, dict[str, Any]]:
    """Well-formed model fingerprints announced for run `run_id`, by peer (malformed records are ignored)."""
    found = dht.get(f"{run_id}_model", latest=True)
    entries = found.value if found is not None and isinstance(found.value, dict) else {}
    values = {str(peer): getattr(entry, "value", None) for peer, entry in entries.items()}
    return {peer: value for peer, value in values.items() if value is not None and _is_fingerprint(value)}


class Swarm:
    """One peer's membership in a swarm: its DHT, its collaborative optimizer, its metrics."""

    grad_averager_cls: type[RobustGradientAverager] = ReportingGradientAverager  # tests swap in a faulty one

    def __init__(self, config: HivemindConfig, *, announce: Callable[[str], None] = print):
        show_swarm_events()
        self.config = config
        # auth (before the DHT: a refused peer stops here, with the server's reason) -> DHT -> token -> moderators'
        # revert orders; `shutdown` stops them in reverse order (trahiv.lifecycle)
        self.lifecycle = Lifecycle()
        self.optimizer: SwarmOptimizer | None = None
        self.diloco: Any = None  # [DiLoCo] trahiv.diloco.DiLoCoOptimizer, instead of `optimizer`, in DiLoCo mode
        # the engine's processes watched (the watch stops first at shutdown: a process ended on purpose is no loss)
        member = join_swarm(self.lifecycle, config.dht, auth=lambda: _start_auth(config), run_id=config.opt.run_id,
                            contribution=self._contribution, on_engine_lost=self._engine_lost,
                            engine_processes=self.engine_processes)  # fmt: skip
        self.auth: PeerAuth | None = member.auth
        self.dht = member.dht
        self.revert_watcher: RevertWatcher | None = member.revert_watcher
        self.started_at = time.monotonic()
        self._model: dict[str, Any] | None = None
        self._model_published_at = -float("inf")
        self.metrics_publisher: MetricsPublisher | None = None
        if config.metrics.publish:  # validators first: this peer's DHT node then also rejects bad records
            name = config.metrics.name or (self.auth.username[:32] if self.auth is not None else None)  # leaderboard
            self.metrics_publisher = MetricsPublisher(self.dht, self.run_id, peer_id=self.peer_id, name=name)
        self._samples_at_last_record = 0
        for line in connectivity.join_lines(
            join_addresses(self.dht), config.dht.initial_peers, client_mode=self.dht.client_mode
        ):
            announce(line)

    def _engine_lost(self, reason: str) -> None:
        """An engine process ended under this peer (`EngineWatch`): say so once, and stop training where it is."""
        message = (
            f"This peer lost its link to swarm {self.run_id!r}: {reason}. Without it the peer can neither follow the "
            "swarm's progress nor average, so training stops here. Start the peer again to rejoin (it downloads the "
            "swarm's current state), or resume from its last checkpoint"
        )
        logger.error(message)
        fixes.interrupt_main(SwarmLostError(message))  # (in Trainer.train; elsewhere the message alone)

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
        """Refuse to train if peers of this run already train a model with other trainable tensors, or speak another
        version of trahiv's wire protocol (their rounds and this peer's could not average together)."""
        records = {peer: theirs for peer, theirs in self._model_records().items() if peer != self.peer_id}
        ours = record_protocol(fingerprint)
        for peer, theirs in records.items():
            if record_protocol(theirs) != ours:
                raise ValueError(protocol_mismatch(self.run_id, peer, record_protocol(theirs), ours))
        # a warning, not a refusal: anyone can write such a record, and the trahiv peers train on unaffected
        if plain := hivemind_progress_peers(self.dht, self.run_id) - {self.peer_id}:
            logger.warning(hivemind_peers_warning(self.run_id, plain))
        for peer, theirs in records.items():
            if {"optimizer"} <= set(theirs) & set(fingerprint) and theirs["optimizer"] != fingerprint["optimizer"]:
                raise ValueError(
                    f"this peer's optimizer ({fingerprint['optimizer']}) is not the one swarm {self.run_id!r} trains "
                    f"with: peer {peer} uses {theirs['optimizer']}. Peers exchange their optimizer's state (a joiner "
                    "downloads it, parameter rounds average it), and another optimizer's cannot be loaded. Use the "
                    "same TrainingArguments(optim=...) (or optimizer_cls_and_kwargs) on every peer, or another run_id."
                )
            if theirs["digest"] != fingerprint["digest"]:
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

    def model_peers(self, *, ready: bool = False) -> set[str]:
        """Peers (this one included) that announced a model for this run; with `ready`, only those that are ready to
        train (their collaborative optimizer runs: `mark_ready`)."""
        return {peer for peer, record in self._model_records().items() if record.get("ready") or not ready}

    def mark_ready(self) -> None:
        """Tell the swarm that this peer trains now (its optimizer runs): `min_peers` counts such peers. A Trainer is
        announced when it is built, which may be long before it trains (data loading, a slow first step); counting
        those released the first peer of run_clm.py's 2-peer swarm to take 4-5 of 8 steps alone."""
        if self.optimizer is not None:
            self.optimizer.tracker.announce()
        if self._model is not None and not self._model.get("ready"):  # (and when: the first ready peer's weights are
            self._model = {**self._model, "ready": True, "ready_at": get_dht_time()}  # where a new swarm starts)
            self.publish_model(force=True)

    def wait_for_peers(self) -> int:
        """Block until `opt.min_peers` peers are ready to train (or `min_peers_timeout`); return how many are."""
        wanted, deadline = self.config.opt.min_peers, time.monotonic() + self.config.opt.min_peers_timeout
        announced = time.monotonic()
        while (count := self._ready_peers()) < wanted and time.monotonic() < deadline:
            time.sleep(0.2)
            tracker = self.optimizer.tracker if self.optimizer is not None else None
            if tracker is not None and time.monotonic() - announced > tracker.metadata_expiration / 3:
                # hivemind renews a progress record only once its peer has samples: a peer waiting here longer than
                # the record's lifetime (60 s) vanished from the others' view, which then never counted it as ready
                # (16 peers on one machine took 2.5 minutes to join: benchmarks/swarm_cost.py)
                tracker.announce()
                announced = time.monotonic()
            self.publish_model()  # (renewed every MODEL_RECORD_TTL / 4)
        if count < wanted:
            logger.warning(f"Only {count} of min_peers={wanted} peers were ready in time; training anyway")
        return count

    def _ready_peers(self) -> int:
        """Peers that announced they are ready and whose training progress this peer sees (its first collaborative
        step must count them, or it would reach target_batch_size alone and step without them)."""
        ready = self.model_peers(ready=True)
        if self.optimizer is None or len(ready) < self.config.opt.min_peers:
            return len(ready)
        self.optimizer.tracker.refresh_now()
        return len(ready_peers(ready, self.optimizer.tracker.active_peers, self.peer_id))

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
        with fixes.children_ignore_sigint():
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
        self.silence_watch = attach_silence_watch(self.optimizer)  # warns when it never averages
        skip_state_rounds_that_cannot_form(self.optimizer)  # all trainers in client mode (around aux)
        return self.optimizer

    def catch_up(self) -> bool:
        """Download the swarm's state if other peers are training; return True if state was loaded. A swarm still at
        its first step starts from the weights of the peer that was ready first (`_start_together`). Training begins
        after it (`SwarmOptimizer.begin_training`)."""
        if self.optimizer is None:
            raise RuntimeError("catch_up() needs the optimizer: call make_optimizer() first")
        try:
            return self._catch_up()
        finally:
            self.optimizer.begin_training()

    def _catch_up(self) -> bool:
        assert self.optimizer is not None
        tracker = self.optimizer.tracker
        tracker.refresh_now()  # the tracker's first fetch may not have happened yet
        others = [peer for peer in {**tracker.active_peers, **tracker.ignored_records} if peer != self.peer_id]
        served = newest_served_step(self.dht, self.run_id)  # e.g. an auxiliary peer restarted from a checkpoint
        swarm_step = max(tracker.global_epoch, served)
        if not others and swarm_step <= self.optimizer.local_epoch:
            return False
        if swarm_step == 0 == self.optimizer.local_epoch:
            started = self._start_together()
            if started is not None:
                return started
        offered = f" (a peer offers the state of step {served})" if served > tracker.global_epoch else ""
        logger.info(
            f"Swarm {self.run_id!r} is at step {tracker.global_epoch}{offered} with {len(others)} other training "
            "peer(s); downloading its state before training"
        )  # (an offered step is only a peer's word: a forged one read "the swarm is at step 1000000000")
        self.optimizer.load_state_from_peers()
        return True

    def _start_together(self) -> bool | None:
        """Peers of a swarm at its first step start from the weights of the peer that was ready first: it keeps its
        own, a peer holding the same weights (a digest of them is in the model records) downloads nothing, the others
        download that peer's state. Each used to download the state of whichever peer served the highest priority, all
        0 at the first step: 4 peers starting together each downloaded another's state at once (33 MB each over 100
        Mbit/s links: seconds, during which the first to finish started its first round without the others), and
        LoRA adapters, initialized at random, could differ between peers that downloaded from different ones. Returns
        whether state was loaded, or None when that peer does not serve its state (the usual download then)."""
        assert self.optimizer is not None
        records = {peer: record for peer, record in self._model_records().items() if record.get("ready")}
        if self.peer_id not in records or len(records) < 2:
            return None
        first = min(records, key=lambda peer: (records[peer].get("ready_at", math.inf), peer))
        own, theirs = (records[peer].get("weights") for peer in (self.peer_id, first))
        if first == self.peer_id or (own is not None and own == theirs):
            whose = "this peer's weights" if first == self.peer_id else f"the weights of peer {first} (ready first)"
            same = "" if first == self.peer_id else ", the same as this peer's"
            logger.info(f"Swarm {self.run_id!r} starts from {whose}{same}: nothing to download")
            return False
        logger.info(f"Swarm {self.run_id!r} is at its first step: starting from the weights of peer {first}")
        try:
            loaded = download_state(
                self.optimizer,
                lambda peer, _: peer == first,
                lambda *_: None,
                what="starting from the first peer's weights",
            )
        except Exception as e:
            logger.warning(f"Downloading the state of peer {first} failed ({e!r})")
            loaded = None
        if loaded is None:
            return None
        metadata, tensors = loaded
        load_state(self.optimizer, metadata, tensors, step=int(metadata["epoch"]))
        return True

    def publish_metrics(self, loss: float | None) -> MetricsRecord | None:
        """Publish this peer's record for the collaborative step it just reached (in the background); `loss` is the
        mean over its local steps since the previous record. [DiLoCo] A record per outer step: its step is the outer
        step reached, its samples those of the inner steps since the previous record."""
        if self.metrics_publisher is None:
            return None
        if self.diloco is not None:
            diloco = self.diloco
            step, samples = diloco.outer_step, diloco.samples_total
            rate = diloco.steps_per_second * diloco.batch_size_per_step
        elif self.optimizer is not None:
            step, samples = self.optimizer.local_epoch, self.optimizer.samples_contributed
            rate = self.optimizer.tracker.performance_ema.samples_per_second
        else:
            return None
        step_samples, self._samples_at_last_record = samples - self._samples_at_last_record, samples
        return self.metrics_publisher.publish(
            step=step,
            loss=loss,
            step_samples=step_samples,
            samples=samples,
            samples_per_second=rate,
            seconds=time.monotonic() - self.started_at,
        )

    def count_record_samples_from(self, samples: int) -> None:
        """The next metrics record counts the samples contributed after `samples` (a resumed DiLoCo peer restores its
        total from the checkpoint: its first record would have counted them all as one outer step's)."""
        self._samples_at_last_record = samples

    def metrics(self) -> dict[str, float]:
        if self.diloco is not None:  # [DiLoCo] outer step, rounds, bytes
            return self.diloco.metrics()
        if self.optimizer is None:
            return {}
        tracker, opt_ring = self.optimizer.tracker, self.config.opt.gradient_allreduce == "ring"
        averagers = (self.optimizer.state_averager, getattr(self.optimizer, "grad_averager", None))
        return {
            "collaborative_step": self.optimizer.local_epoch,
            "swarm_peers": max(tracker.global_progress.num_peers, 1),
            "swarm_samples_per_second": round(tracker.swarm_samples_per_second, 3),
            "samples_contributed": self.optimizer.samples_contributed,
            **{f"averaging_rounds_{status}": count for status, count in self.optimizer.averaging_rounds().items()},
            **total_traffic(averagers),
            **({"averaging_rounds_ring": self.optimizer.ring_rounds()} if opt_ring else {}),
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
        procs = [getattr(self, "dht", None)]  # (the engine watch asks as soon as the DHT runs, before it is set here)
        if self.diloco is not None:  # [DiLoCo]
            procs += self.diloco.averagers  # (one per fragment)
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
            except Exception as e:  # leaving must not raise: the processes are killed below anyway
                logger.warning(f"Error while leaving the swarm: {e!r}")
            self.lifecycle.close()  # the DHT (the watcher and the token stopped before the averagers)

        self.lifecycle.close(after="dht")  # the revert watcher, then the token: no renewal while the DHT stops
        closer = threading.Thread(target=close, name="trahiv-shutdown", daemon=True)
        closer.start()
        closer.join(timeout)
        fixes.kill_engine_processes(processes)  # whatever did not stop in time, with its children (p2pd)
