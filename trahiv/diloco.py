"""DiLoCo mode: peers train alone for `inner_steps` (H) and average only their pseudo-gradients, once per H steps.

DiLoCo (Douillard et al. 2023, arXiv 2311.08105): every peer runs the Trainer's own optimizer and LR schedule for H
steps; then the peers all-reduce their pseudo-gradients (outer parameters minus local parameters), sample-weighted, and
apply one outer SGD step with Nesterov momentum (lr 0.7, momentum 0.9) to the outer parameters, which every peer then
copies into its model. Communication drops H-fold against averaging gradients at every step.

How trahiv does it (`hivemind_config["diloco"]`, see trahiv.config.DiLoCoConfig):

- the outer parameters, their momentum and the pseudo-gradient buffers live in fp32 on the CPU; with PEFT only the
  trainable (adapter) tensors are there, so only they travel;
- the all-reduce is trahiv's (`DiLoCoAverager`): NaN exclusion, weights capped at the samples each peer reported,
  CenteredClip if configured, payload-based deadlines and a report for every round (partial rounds are logged and
  counted, never silent; a part left unaveraged is a zero pseudo-gradient, the same on every peer that missed it),
  the auth gate in moderated swarms, and every byte counted (`averaging_bytes_*`);
- each peer publishes its progress (outer step, inner steps done, steps/s) to the DHT every PUBLISH_PERIOD seconds. A
  peer that reaches H waits for the others at its outer step (and for those still in the sync of the one before,
  see `_coming`) until the time their progress says they need
  (x ETA_SLACK, + a floor, bounded by `max_sync_wait`), then averages with those present: a slow or dead peer costs
  the others at most that wait; a peer killed during the all-reduce costs them the round's chunk deadline (seconds);
- the outer step is in each peer's group key: peers at different outer steps never average together;
- each record carries a digest of the peer's outer parameters (`outer_digest`, also in the group key): peers at one
  outer step must hold the same bits. One whose digest differs from the one most peers at its step report (a tie: the
  earliest-started holder's, whom joiners start from) downloads theirs at its sync point, as a peer that missed a sync
  does (`diloco_syncs_diverged` counts it): a failed download at start or a part of a round left unaveraged cannot
  split the swarm for good;
- a peer that finds the swarm at a later outer step (it missed a sync: too slow, or its round failed while the others
  moved on) drops its pseudo-gradient (its H steps of work are lost: it was computed against outer parameters the
  swarm no longer has), downloads the outer parameters, momentum and step from a peer, and carries on from the
  swarm's inner step (while it downloads, its record says it is syncing: the others wait for it at their next sync
  point, as for a sync in the background); a joiner does the same before its first step and contributes from the
  next sync, with a weight of the samples it trained (fewer than the others' in its first round);
- [streaming] with `fragments` P, the trainable tensors form P runs of consecutive tensors; a sync point comes every
  H / P inner steps and averages one fragment in turn (its own averager, pseudo-gradient, outer step and momenta), so
  each fragment syncs every H steps while one sync carries a P-th of the bytes; `outer_step` counts these syncs;
- when nobody else is at this outer step, the peer applies its own pseudo-gradient (DiLoCo with one worker);
- in a moderated swarm, a moderator's revert order (`trahiv revert`, trahiv.revert.DiLoCoRevertFollower) puts every
  peer back at the checkpoint's outer step, outer parameters and momenta, with fresh inner optimizer statistics;
- the Trainer's checkpoints (`save_strategy`) hold, in `optimizer.pt`, the inner optimizer's state and the outer
  state (outer parameters, momenta, outer step, inner steps and samples of the current round): a peer restarted with
  `resume_from_checkpoint` continues at the same inner and outer step (its model file holds the half-way inner
  parameters); if the swarm reached a later outer step meanwhile, it adopts the swarm's outer state instead.

`state.global_step` counts inner steps in the swarm's timeline: outer_step x H + inner steps done this round.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from transformers.trainer_callback import DefaultFlowCallback

from trahiv.auth import AuthGate
from trahiv.averaging import Aggregation
from trahiv.compression import make_compression
from trahiv.config import HivemindConfig
from trahiv.engine import fixes
from trahiv.engine.diloco import DiLoCoAverager
from trahiv.engine.gate import gated
from trahiv.engine.liveness import dht_answer
from trahiv.engine.optimizer import WHOLE_STATE_WAIT, newest_served, serve_while_late
from trahiv.engine.traffic import total_traffic
from trahiv.protocol import progress_key
from trahiv.protocol import tensors_digest as outer_digest  # peers at one outer step hold the same outer parameters

logger = logging.getLogger("trahiv.diloco")

__all__ = [
    "DiLoCoAverager",
    "DiLoCoFlowCallback",
    "DiLoCoOptimizer",
    "PeerProgress",
    "outer_digest",
    "outer_sgd_step_",
    "since_first_seen",
    "swarm_state_holder",
    "sync_deadline",
]

PUBLISH_PERIOD = 2.0  # seconds between two progress records of a peer
RECORD_TTL = 5 * PUBLISH_PERIOD  # a peer that stops publishing (dead) is forgotten after this many seconds
ETA_SLACK = 2.0  # a sync waits for a slower peer up to 2x the time its reported speed needs to reach H
MIN_WAIT = 5.0  # seconds added to every wait (busy CPUs: a step can take a few times the average)
UNKNOWN_RATE_WAIT = 60.0  # seconds a sync waits for a peer that has not measured its speed yet
POLL_PERIOD = 0.2  # seconds between two reads of the peers' progress while waiting
ADOPT_TRIES = 3  # downloads of the outer state, at most, while the swarm keeps reaching its sync point meanwhile


# --- the outer step ------------------------------------------------------------------------------------------------


@torch.no_grad()
def outer_sgd_step_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    momenta: Sequence[torch.Tensor],
    lr: float,
    momentum: float,
    nesterov: bool,
) -> None:
    """In place: m <- mu m + g; p <- p - lr (g + mu m) with Nesterov, p <- p - lr m without (torch.optim.SGD's rule
    with dampening 0; the momentum starts at 0, so the first step's m is g, as in torch)."""
    for param, grad, buffer in zip(params, grads, momenta, strict=True):
        buffer.mul_(momentum).add_(grad)
        param.sub_(grad.add(buffer, alpha=momentum) if nesterov else buffer, alpha=lr)


def split_fragments(sizes: Sequence[int], count: int) -> list[list[int]]:
    """[streaming] Indices of `count` runs of consecutive tensors (a model's layers in order) of about equal size."""
    if count > len(sizes):
        raise ValueError(
            f"diloco.fragments={count}, but the model has only {len(sizes)} trainable tensors: use at most that many "
            "fragments (each fragment holds whole tensors)"
        )
    total, taken, current = sum(sizes), 0, 0
    fragments: list[list[int]] = [[] for _ in range(count)]
    for index, size in enumerate(sizes):
        # the next fragment once this one holds its share, or once the tensors left are one per fragment still empty
        share_done = taken >= total * (current + 1) / count
        if fragments[current] and current < count - 1 and (share_done or len(sizes) - index <= count - 1 - current):
            current += 1
        fragments[current].append(index)
        taken += size
    return fragments


# --- the peers' progress ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PeerProgress:
    """One peer's DiLoCo progress record (DHT key `progress_key(run_id, diloco=True)`, subkey: the peer's ID). The
    field names `peer_id`, `samples_accumulated`, `samples_per_second`, `time` are those trahiv's weight caps read."""

    peer: str
    outer_step: int
    inner_done: int
    inner_steps: int
    samples_accumulated: int
    steps_per_second: float
    time: float
    started: float
    revert_id: int = 0  # the newest revert order this peer applied (trahiv.revert)
    syncing: bool = False  # [overlap] its sync of `outer_step` runs in the background while it trains on
    digest: str = ""  # `outer_digest` of its outer parameters at `outer_step` ('': not said)
    sync_failed: bool = False  # its averaging of `outer_step` failed: it waits for the others' result, if any

    @classmethod
    def parse(cls, value: Any) -> PeerProgress | None:
        if not isinstance(value, dict) or not isinstance(value.get("peer_id"), bytes):
            return None
        try:
            peer = PeerID(value["peer_id"]).to_base58()
            ints = [value[k] for k in ("outer_step", "inner_done", "inner_steps", "samples_accumulated")]
            floats = [value[k] for k in ("steps_per_second", "time", "started")]
        except Exception:
            return None
        if not all(type(x) is int and 0 <= x < 2**62 for x in ints):
            return None
        if not all(isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) for x in floats):
            return None
        revert_id, syncing = value.get("revert_id", 0), value.get("syncing", False)
        sync_failed = value.get("sync_failed", False)
        if ints[2] < 1 or floats[0] < 0 or type(revert_id) is not int:
            return None
        if type(syncing) is not bool or type(sync_failed) is not bool:
            return None
        digest = value.get("outer_digest", "")
        if type(digest) is not str or len(digest) > 32 or digest.strip("0123456789abcdef"):
            return None
        outer_step, inner_done, inner_steps, samples = ints
        steps_per_second, at, started = (float(x) for x in floats)
        rates = (steps_per_second, at, started)
        return cls(peer, outer_step, inner_done, inner_steps, samples, *rates, revert_id, syncing, digest, sync_failed)

    @property
    def at_sync_point(self) -> bool:
        """At its sync point of `outer_step`, or ([overlap]) syncing it in the background."""
        return self.inner_done >= self.inner_steps or self.syncing

    def eta(self, outer_step: int | None = None) -> float:
        """DHT time by which this peer should reach the sync point of `outer_step` (default: of its own outer step),
        from its reported speed (x ETA_SLACK)."""
        rounds = 0 if outer_step is None else max(outer_step - self.outer_step, 0)
        remaining = max((rounds + 1) * self.inner_steps - self.inner_done, 0)
        if remaining == 0:
            return self.time
        if self.steps_per_second <= 0:
            return self.time + UNKNOWN_RATE_WAIT
        return self.time + ETA_SLACK * remaining / self.steps_per_second


def swarm_state_holder(me: PeerProgress, others: Iterable[PeerProgress]) -> PeerProgress | None:
    """A peer that holds the swarm's outer parameters at `me`'s outer step if `me` holds others (else None).

    The swarm's are those whose digest most peers at that step report; a tie goes to the earliest-started holder, the
    peer that joiners start from (see `DiLoCoOptimizer.join`). Peers that average together apply the same averaged
    pseudo-gradient to the same outer parameters, so their digests stay equal; a peer whose start-up download failed,
    or whose part of a round was left unaveraged, would otherwise train apart from the swarm for good."""
    records = {r.peer: r for r in others if r.outer_step == me.outer_step and r.digest and r.peer != me.peer}
    holders: dict[str, list[tuple[float, str]]] = {me.digest: [(me.started, me.peer)]}
    for record in records.values():
        holders.setdefault(record.digest, []).append((record.started, record.peer))
    swarms = min(holders, key=lambda digest: (-len(holders[digest]), min(holders[digest])))
    return None if swarms == me.digest else records[min(holders[swarms])[1]]


def since_first_seen(record: PeerProgress, first_seen: dict[tuple[str, int, int], float]) -> PeerProgress:
    """The record, dated from when its progress was first seen: a peer that keeps publishing the same inner step (alive
    but stuck) must not push the deadline further with every record."""
    key = (record.peer, record.outer_step, record.inner_done)
    return dataclasses.replace(record, time=first_seen.setdefault(key, record.time))


def sync_deadline(
    pending: Sequence[PeerProgress], started: float, floor: float, max_wait: float, outer_step: int | None = None
) -> float:
    """Until when (DHT time) a peer that reached its sync point (of `outer_step`) at `started` waits for the `pending`
    peers (those that have not reached it): the latest of their ETAs + floor, at least `floor` after `started`, at
    most `max_wait` after it."""
    latest = max((record.eta(outer_step) + floor for record in pending), default=started)
    return min(started + max_wait, max(started + floor, latest))


# --- the averager ---------------------------------------------------------------------------------------------------


# --- the optimizer the Trainer uses ---------------------------------------------------------------------------------


@dataclass
class PendingSync:
    """[overlap] A sync running in the background: its outer step, the weight (samples) of this peer's pseudo-gradient,
    the local parameters at the sync point; `outcome` ('averaged', 'alone', 'failed', 'behind') once `done`."""

    outer_step: int
    weight: int
    at_sync: list[torch.Tensor]
    thread: threading.Thread | None = None
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    outcome: str | None = None
    joined: bool = False  # a joiner's: the swarm's sync it arrived during (its result is downloaded, not averaged)


class DiLoCoOptimizer(torch.optim.Optimizer):
    """The Trainer's optimizer (`inner`), run locally; every `inner_steps` calls of `step()` it syncs with the swarm.
    Its `param_groups` and `state` are the inner optimizer's (the Trainer's LR scheduler drives the inner LR)."""

    averager_cls: type[DiLoCoAverager] = DiLoCoAverager  # tests swap in a faulty one

    def __init__(
        self,
        swarm: Any,
        param_groups: list[dict[str, Any]],
        optimizer_factory: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
        batch_size_per_step: int,
    ):
        config: HivemindConfig = swarm.config
        assert config.diloco is not None
        self.swarm, self.config, self.cfg = swarm, config, config.diloco
        self.inner = optimizer_factory(param_groups)
        super().__init__([p for g in self.inner.param_groups for p in g["params"]], {})
        self.param_groups, self.state = self.inner.param_groups, self.inner.state  # the same objects
        self.params = [p for group in self.inner.param_groups for p in group["params"]]
        self.batch_size_per_step = batch_size_per_step
        with torch.no_grad():
            self.outer_params = [p.detach().to("cpu", torch.float32, copy=True) for p in self.params]
            self.momenta = [torch.zeros_like(p) for p in self.outer_params]
            grads = [torch.zeros_like(p) for p in self.outer_params]
        # [streaming] the tensors of each fragment; a sync point comes every `interval` inner steps and averages
        # the fragments in turn (fragment k at outer steps k, k + P, ...): each one every H steps
        self.fragments = split_fragments([p.numel() for p in self.params], self.cfg.fragments)
        self.interval = self.cfg.inner_steps // self.cfg.fragments
        self.fragment_samples = [0] * self.cfg.fragments  # samples trained since each fragment's last sync
        self.outer_digest = outer_digest(self.outer_params)  # kept with outer_step (both under self._lock)
        self.outer_step = self.inner_done = self.samples_total = 0
        self.resumed = False  # set by load_state_dict: this peer continues a checkpoint of its own (see join)
        # missed: the swarm moved on without this peer; diverged: its outer parameters were not the swarm's
        self.syncs = {"averaged": 0, "alone": 0, "failed": 0, "missed": 0, "diverged": 0}
        self._adopt_from: PeerProgress | None = None  # the peer whose outer state a diverged peer downloads
        self._catching_up = False  # downloading the swarm's outer state after a missed sync (see _adopt_after_...)
        self._sync_failed = False  # its averaging failed: waiting for a round that went on without it
        self.sync_wait_s = 0.0  # seconds the inner loop stood still for syncs (waiting for peers, averaging)
        self.overlapped_steps = 0  # [overlap] inner steps computed while a sync ran in the background
        self._pending: PendingSync | None = None  # [overlap] the sync running in the background
        self.steps_per_second = 0.0
        self.started = get_dht_time()
        self.peers: dict[str, PeerProgress] = {}  # other peers' latest records
        self.reverting: set[str] = set()  # [revert] peers whose records predate the order this peer applied
        self._lock = threading.Lock()  # outer state: the averager's state server reads it from another thread
        self._last_step_at: float | None = None
        self.progress_key = progress_key(self.run_id, diloco=True)
        self.averagers = [
            self._make_averager([grads[i] for i in indices], fragment)
            for fragment, indices in enumerate(self.fragments)
        ]
        self.averager = self.averagers[0]  # (also serves the whole outer state for download)
        self.averager.state_source = self
        self.revert: Any = None  # [revert] trahiv.revert.DiLoCoRevertFollower in a moderated swarm
        if getattr(swarm, "revert_watcher", None) is not None:
            from trahiv.revert import DiLoCoRevertFollower

            DiLoCoRevertFollower(swarm.revert_watcher).attach(self)
        self._publish()  # at once: peers about to sync must know this one is here
        self._stop = threading.Event()
        self._publisher = threading.Thread(target=self._publish_periodically, name="trahiv-diloco", daemon=True)
        self._publisher.start()
        swarm.diloco = self

    @property
    def run_id(self) -> str:
        return self.config.opt.run_id

    @property
    def global_step(self) -> int:
        """Inner steps in the swarm's timeline (what `state.global_step` and `max_steps` count)."""
        return self.outer_step * self.interval + self.inner_done

    @property
    def fragment(self) -> int:
        """[streaming] The fragment this outer step's sync averages (0 without fragments)."""
        return self.outer_step % len(self.fragments)

    @property
    def samples(self) -> int:
        """The weight of the next sync's pseudo-gradient: the samples trained since its fragment's last sync."""
        return self.fragment_samples[self.fragment]

    def _make_averager(self, grads: list[torch.Tensor], fragment: int = 0) -> DiLoCoAverager:
        from trahiv.swarm import request_timeout  # the swarm's own rule for matchmaking requests

        opt, swarm = self.config.opt, self.swarm
        gate = AuthGate(self.run_id, swarm.auth.experiment_public_key) if swarm.auth is not None else None
        cls = gated(self.averager_cls, gate)
        return cls(
            averaged_tensors=grads,
            dht=swarm.dht,
            prefix=f"{self.run_id}_diloco" + (f"_f{fragment}" if fragment else ""),
            allow_state_sharing=fragment == 0,
            progress_key=self.progress_key,
            aggregation=Aggregation(**opt.aggregation.model_dump()),
            compression=make_compression(self.cfg.compression),
            state_compression=make_compression(opt.load_state_compression),
            min_matchmaking_time=opt.matchmaking_time,
            request_timeout=request_timeout(opt),
            allreduce_timeout=opt.allreduce_timeout,
            next_chunk_timeout=opt.next_chunk_timeout,
            shutdown_timeout=opt.shutdown_timeout,
            client_mode=swarm.dht.client_mode,
            initial_group_bits=group_bits(0, self.outer_digest),
            start=True,
        )

    # --- the inner loop ----------------------------------------------------------------------------------------

    def step(self, closure: Callable | None = None) -> Any:  # type: ignore[override]
        fixes.raise_if_interrupted()  # (a lost engine process: stop between steps, see trahiv.engine.liveness)
        try:
            with fixes.changing_state():  # the inner step, and a sync (its outer step, or a download)
                return self._step(closure)
        finally:
            fixes.raise_if_interrupted()  # a Ctrl+C or a lost engine process that a sync's handler swallowed

    def _step(self, closure: Callable | None) -> Any:
        loss = self.inner.step(closure)
        if self.revert is not None and self.revert.maybe_apply(self):  # a moderator's order: this step is dropped
            self._last_step_at = time.monotonic()
            return loss
        now = time.monotonic()
        if self._last_step_at is not None:  # steps/s of inner steps only (a sync's wait does not count)
            rate = 1.0 / max(now - self._last_step_at, 1e-6)
            self.steps_per_second = rate if self.steps_per_second == 0 else 0.8 * self.steps_per_second + 0.2 * rate
        self.inner_done += 1
        self.fragment_samples = [n + self.batch_size_per_step for n in self.fragment_samples]
        self.samples_total += self.batch_size_per_step
        synced = False
        if self._pending is not None:
            self.overlapped_steps += 1
            # the average arrived: apply it now; still running at the next sync point (H steps later): wait for it
            if self._pending.done.is_set() or self.inner_done >= 2 * self.interval:
                self.finish_pending_sync()
                synced = True
        if self._pending is None and self.inner_done >= self.interval:
            self.start_sync() if self.cfg.overlap else self.sync()
            synced = True
        if synced:
            now = time.monotonic()
        self._last_step_at = now
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    # --- the sync --------------------------------------------------------------------------------------------------

    def sync(self) -> None:
        """Average pseudo-gradients with the peers at this outer step, take the outer step, copy it to the model."""
        began = time.monotonic()
        # until the outer step (or a download) the training state is that of the sync point, whole: a peer stopped
        # meanwhile (its engine lost) saves it, and syncs at its next step once resumed
        with fixes.state_whole():
            self._publish(wait=True)  # this peer is at its sync point: the others stop waiting for it
            behind = self._wait_for_peers()
            if not behind:
                self._fill_pseudo_gradients()
                outcome = self._average(weight=self.samples)
                behind = outcome == "failed" and self._swarm_is_ahead()
        if not (behind and self._adopt_after_a_missed_sync()):
            if behind:
                self._fill_pseudo_gradients()
            self._apply_outer_step()
        self._publish()
        self.sync_wait_s += time.monotonic() - began

    def sync_if_due(self) -> None:
        """Before the first inner step: the sync of a checkpoint saved at its sync point (its peer stopped while the
        sync waited for the others, `sync`), taken now, so that the next inner step is the first of the next outer
        step, as it would have been."""
        if self._pending is None and self.inner_done >= self.interval:
            logger.info(f"Resumed at the sync point of outer step {self.outer_step}: syncing before training on")
            self.start_sync() if self.cfg.overlap else self.sync()

    def _adopt_after_a_missed_sync(self) -> bool:
        """The swarm took this outer step without this peer, or holds other outer parameters at it (`_adopt_from`):
        drop its pseudo-gradient and download the swarm's outer state (True), or, if no peer serves it, say so (False:
        the peer takes the outer step with its own)."""
        source, self._adopt_from = self._adopt_from, None
        if source is not None:
            logger.warning(
                f"Outer step {self.outer_step}: this peer's outer parameters (digest {self.outer_digest}) are not the "
                f"swarm's ({source.digest}, held by {source.peer} and the most peers at this step): dropping its "
                f"pseudo-gradient ({self.inner_done} inner steps) and downloading the swarm's outer parameters"
            )
            self.syncs["diverged"] += 1
        else:
            logger.warning(
                f"The swarm moved past outer step {self.outer_step} without this peer: dropping its pseudo-gradient "
                f"({self.inner_done} inner steps) and downloading the swarm's outer parameters"
            )
            self.syncs["missed"] += 1
        # its record says it is syncing this outer step while it downloads: the peers at the next one wait for it at
        # their sync point, as for a peer whose sync runs in the background (`_coming`). Without that, a download
        # slower than the others' H inner steps (H = 3, a busy CPU) made it miss every sync after: each time it came
        # back, they had synced without it (seen in CI: a peer that diverged at the first sync missed the next two)
        self._catching_up = True
        try:
            self._publish(wait=True)
            adopted = self._adopt_swarm_state(prefer=source.peer if source is not None else None)
        finally:
            self._catching_up = False
        if adopted:
            return True
        logger.warning("Could not download the swarm's outer state: taking an outer step with this peer's own")
        return False

    # --- [overlap] the sync in the background -----------------------------------------------------------------------
    # At the sync point the pseudo-gradient (outer - local, computed now) goes to the averager, and the next inner
    # steps run on the local parameters while a thread waits for the peers and averages. When the average arrives the
    # outer step is taken and the model moves onto it keeping the inner progress made meanwhile:
    # local <- new outer + (local - local at the sync point). The next pseudo-gradient (new outer - local at the next
    # sync point) then covers exactly H inner steps, as without overlap (with constant gradients the outer steps are
    # the same). Each peer's record stays at the outer step being synced (its inner steps counting on past H) until
    # the outer step is applied, so that peers still training wait for it and nobody takes it for a peer ahead.

    def start_sync(self) -> None:
        """At the sync point: fill the pseudo-gradients, start averaging them in the background, return at once."""
        began = time.monotonic()
        self._fill_pseudo_gradients()
        at_sync = [self.params[i].detach().to("cpu", torch.float32, copy=True) for i in self.fragments[self.fragment]]
        pending = PendingSync(outer_step=self.outer_step, weight=self.samples, at_sync=at_sync)
        self.fragment_samples[self.fragment] = 0  # the fragment's next pseudo-gradient counts from here
        pending.thread = threading.Thread(target=self._sync_in_background, args=(pending,), name="trahiv-diloco-sync",
                                          daemon=True)  # fmt: skip
        self._pending = pending
        filled = time.monotonic()
        self._publish(wait=True)  # at its sync point, syncing: the others stop waiting for it, or wait if they are on
        pending.thread.start()
        logger.debug(f"Outer step {pending.outer_step}: sync started in {time.monotonic() - began:.3f} s "
                     f"(published in {time.monotonic() - filled:.3f} s)")  # fmt: skip

    def _sync_in_background(self, pending: PendingSync) -> None:
        try:
            if self._wait_for_peers():
                pending.outcome = "behind"
            else:
                pending.outcome = self._average(weight=pending.weight)
                if pending.outcome == "failed" and self._swarm_is_ahead():
                    pending.outcome = "behind"
        except Exception as e:  # (the DHT or the averager shut down under it)
            logger.warning(f"Outer step {pending.outer_step}: the sync failed ({e!r})")
            pending.outcome = "failed"
        finally:
            pending.done.set()

    def finish_pending_sync(self) -> None:
        """[overlap] Wait for the background sync (bounded by its own deadlines) and apply its outer step."""
        pending = self._pending
        if pending is None:
            return
        began = time.monotonic()
        opt = self.config.opt
        bound = self.cfg.max_sync_wait + opt.averaging_timeout + (opt.allreduce_timeout or opt.averaging_timeout) + 60
        if not pending.done.wait(bound):
            raise RuntimeError(f"DiLoCo: the sync of outer step {pending.outer_step} did not end within {bound:.0f} s")
        self._pending = None
        if pending.joined:  # a joiner that arrived during the swarm's sync: its result, downloaded
            logger.info(f"The swarm's sync of outer step {pending.outer_step}, which began before this peer joined, "
                        "ended: downloading its result")  # fmt: skip
            if not self._adopt_swarm_state(wait=False):
                logger.warning("Could not download the swarm's outer state: taking an outer step with this peer's own")
                self._fill_pseudo_gradients(at=pending.at_sync)
                self._apply_outer_step(at_sync=pending.at_sync)
        elif pending.outcome == "behind" and self._adopt_after_a_missed_sync():
            # the inner steps made since the sync point are dropped with the pseudo-gradient (their outer state is
            # not the swarm's); the peer carries on from the swarm's inner step
            pass
        else:
            if pending.outcome == "behind":  # no peer served the outer state: this peer's own pseudo-gradient
                self._fill_pseudo_gradients(at=pending.at_sync)
            self._apply_outer_step(at_sync=pending.at_sync)
        applied = time.monotonic()
        self._publish()
        self.sync_wait_s += time.monotonic() - began
        logger.debug(f"Outer step {pending.outer_step}: {pending.outcome}, applied in {time.monotonic() - began:.3f} s "
                     f"(published in {time.monotonic() - applied:.3f} s)")  # fmt: skip

    def drop_pending_sync(self) -> None:
        """[overlap] Forget the background sync (a revert replaces the outer state): wait for its thread, ignore it."""
        pending, self._pending = self._pending, None
        if pending is not None and pending.thread is not None:
            pending.thread.join(timeout=self.cfg.max_sync_wait + self.config.opt.averaging_timeout + 60)

    def _fill_pseudo_gradients(self, at: Sequence[torch.Tensor] | None = None) -> None:
        """pseudo-gradient = outer parameters - local parameters (fp32, CPU; or those of `at`), into the averaged
        buffers."""
        indices = self.fragments[self.fragment]
        local = at if at is not None else [self.params[i].detach().to("cpu", torch.float32) for i in indices]
        with torch.no_grad(), self.averagers[self.fragment].get_tensors() as grads:
            for grad, i, param in zip(grads, indices, local, strict=True):
                grad.copy_(self.outer_params[i]).sub_(param)

    def _others(self) -> dict[str, PeerProgress]:
        """The other peers' fresh progress records (also kept in `self.peers`)."""
        dht = self.swarm.dht  # (a DHT process that has ended: DHTProcessEnded, the sync in the background ends)
        found = dht_answer(dht, dht.get(self.progress_key, latest=True, return_future=True))
        entries = found.value if found is not None and isinstance(found.value, dict) else {}
        records = [PeerProgress.parse(getattr(entry, "value", None)) for entry in entries.values()]
        own = self.swarm.peer_id
        # after a revert, for its grace period: only the peers that applied it too, as their own records say (the
        # watcher's `{run_id}_reverted` announcements can arrive after the next sync: each peer then synced alone)
        allowed = self.revert.allowed_peers() if self.revert is not None else None
        applied = self.revert.applied_id if self.revert is not None else 0
        self.peers = {
            r.peer: r
            for r in records
            if r is not None and r.peer != own and (allowed is None or r.peer in allowed or r.revert_id == applied)
        }
        # ... and the peers that have not applied it yet (an older order in their records): they are about to revert
        # and come back to this outer step, so a sync point waits for them rather than averaging without them
        self.reverting = {
            r.peer
            for r in records
            if allowed is not None and r is not None and r.peer != own and r.peer not in self.peers
            and r.revert_id < applied
        }  # fmt: skip
        return self.peers

    def _swarm_is_ahead(self, others: dict[str, PeerProgress] | None = None, outer_step: int | None = None) -> bool:
        """Whether the swarm took this outer step (or `outer_step`, one this peer is loading) without this peer: some
        peers are past it, and no fewer than are still at it (this one included). A peer past it alone while more are
        still at it took the step by itself (its sync failed while the others were still in theirs): it is not the
        swarm, and they wait for its digest to tell it at their next sync point (`_coming`, `swarm_state_holder`).
        Counting any peer past it as the swarm, a peer still waiting for another at the sync point downloaded the lone
        peer's outer state (a CI run of
        `test_diloco.py::test_a_peer_whose_sync_failed_waits_for_the_others_still_in_it`), and so would the rest."""
        others = self._others() if others is None else others
        step = self.outer_step if outer_step is None else outer_step
        ahead = sum(record.outer_step > step for record in others.values())
        here = 1 + sum(record.outer_step == step for record in others.values())
        return ahead > 0 and ahead >= here

    def _wait_for_peers(self) -> bool:
        """Wait for the peers at this outer step until `sync_deadline`. True if this peer must adopt the swarm's outer
        state instead of averaging: the swarm is already past this outer step, or holds other outer parameters at it
        (`_adopt_from`)."""
        # the floor also covers the age of a record when first seen (it is published every PUBLISH_PERIOD)
        started, floor = get_dht_time(), max(MIN_WAIT, self.config.opt.matchmaking_time) + PUBLISH_PERIOD
        first_seen: dict[tuple[str, int, int], float] = {}
        while True:
            others = self._others()
            if self._swarm_is_ahead(others):
                return True
            self._adopt_from = self._swarm_state_if_not_ours(others.values())
            if self._adopt_from is not None:
                return True
            pending = [since_first_seen(r, first_seen) for r in others.values() if self._coming(r)]
            if not pending and not self.reverting:
                return False
            deadline = sync_deadline(pending, started, floor, self.cfg.max_sync_wait, self.outer_step)
            if self.reverting:  # [revert] at most until the grace period ends (or max_sync_wait)
                assert self.revert is not None
                grace_left = max(self.revert.grace_until - time.monotonic(), 0.0)
                deadline = max(deadline, min(started + self.cfg.max_sync_wait, get_dht_time() + grace_left))
            if get_dht_time() >= deadline:
                late = [f"{r.peer} ({r.inner_done}/{r.inner_steps})" for r in pending]
                late += [f"{peer} (not reverted yet)" for peer in sorted(self.reverting)]
                logger.warning(f"Outer step {self.outer_step}: going on without the peers still training: "
                               f"{', '.join(late)}")  # fmt: skip
                return False
            time.sleep(POLL_PERIOD)

    def _swarm_state_if_not_ours(self, others: Iterable[PeerProgress]) -> PeerProgress | None:
        with self._lock:
            me = PeerProgress(
                self.swarm.peer_id, self.outer_step, 0, 1, 0, 0.0, 0.0, self.started, digest=self.outer_digest
            )
        return swarm_state_holder(me, others)

    def _same_state(self, record: PeerProgress) -> bool:
        """Whether a peer can average with this one: not at this outer step with other outer parameters."""
        return record.outer_step != self.outer_step or not record.digest or record.digest == self.outer_digest

    def _coming(self, record: PeerProgress) -> bool:
        """Whether a peer is on its way to this outer step's sync point: at this outer step and still training, or
        [overlap] at the one before, training on while its sync of it runs (`syncing`): its record stays there until
        the average arrives, and its outer step follows at its next inner step. (This peer may get here first: a sync
        still running at its own next sync point is finished there and the next one starts at once.) A peer at the
        one before that says `syncing` in a blocking sync missed that one and is downloading its result
        (`_adopt_after_a_missed_sync`): it comes too. So does one at the one before at its sync point: it is still in
        that sync, which it either ends with an outer step (then it trains up to this sync point; if its group's outer
        parameters are not this peer's, the one with fewer holders downloads the others' there) or leaves to find the
        swarm ahead and download. Not waiting for it, a peer whose own search of that sync had failed (its group
        assembled as it gave up: the others' round went on without its part) found nobody ready at each later sync
        point, synced alone every H steps while the others were still in their round, and the others, finding it
        ahead, dropped their work to download its outer state (seen in `benchmarks/diloco.py`: 15 lone syncs in a
        run, peers apart at the end)."""
        if record.outer_step == self.outer_step:
            return record.inner_done < record.inner_steps
        return record.outer_step == self.outer_step - 1 and (record.syncing or record.inner_done >= record.inner_steps)

    def _average(self, weight: int) -> str:
        """All-reduce the pseudo-gradients with the peers at this outer step: 'averaged', 'alone' or 'failed'."""
        # (a peer with other outer parameters at this step is about to adopt the swarm's: it does not average)
        peers = [r for r in self.peers.values() if self._same_state(r)]
        ready = [r for r in peers if r.outer_step == self.outer_step and r.inner_done >= r.inner_steps]
        if not ready:
            self.syncs["alone"] += 1
            return "alone"
        averager = self.averagers[self.fragment]
        averager.set_group_bits(group_bits(self.outer_step, self.outer_digest))
        # a group that holds every peer at this outer step or one behind (about to catch up: a joiner) assembles at
        # once, not when the declared matchmaking time runs out; one of them missing costs that time, as before
        near = [r.peer for r in peers if self.outer_step - 1 <= r.outer_step <= self.outer_step]
        averager.expect_peers(PeerID.from_base58(peer).to_bytes() for peer in (self.swarm.peer_id, *near))
        opt = self.config.opt
        # the peers that are ready look for a group within a poll period of each other: a few matchmaking windows
        # bound the search (a peer killed at its sync point costs that); the all-reduce has its own deadlines
        search = min(opt.averaging_timeout, 3 * opt.matchmaking_time)
        try:
            averager.step(weight=float(max(weight, 1)), timeout=search)
        except Exception as e:  # the round's report (if it started) says more; values kept local where not averaged
            logger.warning(f"Outer step {self.outer_step}: averaging pseudo-gradients failed ({e!r})")
            self.syncs["failed"] += 1
            self._await_a_round_without_this_peer()
            return "failed"
        finally:
            averager.round_reports()
        self.syncs["averaged"] += 1
        return "averaged"

    def _await_a_round_without_this_peer(self) -> None:
        """After this peer's averaging failed: the peers at this sync point with its outer parameters may be in a round
        that counted it in and goes on without its part (a group that assembled as its search ended, or its
        all-reduce failed before it sent anything). Wait, at most a round's timeout, until one of them moves past this
        outer step: the caller then downloads their result (`_swarm_is_ahead`) rather than take the outer step with
        this peer's own pseudo-gradient. (Not waiting, it took its own while the other, in a 2-peer swarm, applied the
        round's: half of its values zero where this peer's part was missing; they were apart until the next sync,
        where one dropped its pseudo-gradient to download the other's outer state: seen in a CI run of
        `test_diloco.py::test_a_killed_peer_costs_the_others_seconds`.) Peers whose averaging failed too say so in
        their records (`sync_failed`) and are not waited for: no round went on without them."""
        opt = self.config.opt
        deadline = time.monotonic() + opt.averaging_timeout + opt.matchmaking_time
        self._sync_failed = True
        try:
            self._publish(wait=True)
            while time.monotonic() < deadline:
                others = self._others().values()
                if any(r.outer_step > self.outer_step for r in others):
                    return
                in_round = [
                    r for r in others
                    if r.outer_step == self.outer_step and self._same_state(r) and not r.sync_failed and r.at_sync_point
                ]  # fmt: skip
                if not in_round:
                    return
                time.sleep(POLL_PERIOD)
        except Exception as e:  # (the DHT shut down under it): the caller takes the outer step as before
            logger.debug(f"Outer step {self.outer_step}: stopped waiting for the others' round ({e!r})")
        finally:
            self._sync_failed = False

    def _apply_outer_step(self, at_sync: Sequence[torch.Tensor] | None = None) -> None:
        """Take the outer step with the averaged pseudo-gradients; copy it into the model, or (overlap: `at_sync`, the
        local parameters at the sync point) move the model onto it keeping the inner steps made since. [streaming]
        Only the fragment of this sync: its outer parameters and momenta, and its tensors in the model."""
        cfg, fragment = self.cfg, self.fragment
        indices = self.fragments[fragment]
        outer, momenta = [self.outer_params[i] for i in indices], [self.momenta[i] for i in indices]
        with torch.no_grad(), self._lock, self.averagers[fragment].get_tensors() as grads:
            outer_sgd_step_(outer, grads, momenta, cfg.outer_lr, cfg.outer_momentum, cfg.nesterov)
            self.outer_step += 1
            self.outer_digest = outer_digest(self.outer_params)
            if at_sync is None:
                self.inner_done = self.fragment_samples[fragment] = 0
                self._copy_outer_to_model(indices)
            else:
                self.inner_done -= self.interval
                for i, before in zip(indices, at_sync, strict=True):
                    moved = self.params[i].detach().to("cpu", torch.float32) - before
                    self.params[i].copy_(self.outer_params[i] + moved)
        self.averager.state_sharing_priority = float(self.outer_step)

    def _copy_outer_to_model(self, indices: Sequence[int] | None = None) -> None:
        with torch.no_grad():
            for i in range(len(self.params)) if indices is None else indices:
                self.params[i].copy_(self.outer_params[i])

    def outer_state(self) -> tuple[dict[str, Any], list[torch.Tensor], None]:
        with self._lock:
            tensors = [t.clone() for t in (*self.outer_params, *self.momenta)]
            return {"epoch": self.outer_step, "inner_steps": self.interval}, tensors, None

    # --- joining -------------------------------------------------------------------------------------------------

    def join(self) -> bool:
        """Before training: adopt the swarm's outer state unless this peer is the one others should start from (the
        earliest-started peer at the highest outer step). Return True if a state was downloaded.

        A peer that serves an outer step later than every training peer's (an auxiliary peer restarted from its
        checkpoint of a stopped swarm: `trahiv aux --model ...`) comes first: every trainer starts from that state."""
        others = self._others()
        served = newest_served(self.swarm.dht, f"{self.run_id}_diloco")
        if served > max([self.outer_step, *(r.outer_step for r in others.values())]):
            logger.info(f"A peer serves DiLoCo swarm {self.run_id!r}'s outer state at outer step {served}, later than "
                        "any training peer's (a checkpoint): starting from it")  # fmt: skip
            if self._adopt_swarm_state(prefer=None, follow_inner=False, joining=True):
                return True
            logger.warning(f"Could not download the outer state of outer step {served}")
        if not others:
            return False
        me = PeerProgress(self.swarm.peer_id, self.outer_step, 0, self.interval, 0, 0.0, 0.0, self.started)
        leader = min([me, *others.values()], key=lambda r: (-r.outer_step, r.started, r.peer))
        if leader.peer == me.peer:
            return False
        if self.resumed and leader.outer_step <= self.outer_step:
            # a peer resumed from its own checkpoint at the swarm's outer step keeps its inner progress (downloading
            # would replace its half-way inner parameters by the outer ones); a stale checkpoint (the swarm is at a
            # later outer step) is dropped for the swarm's state below, as a peer that missed a sync does
            logger.info(f"Resumed at outer step {self.outer_step}, inner step {self.inner_done}: keeping this state")
            return False
        if leader.outer_step == 0 == self.outer_step and leader.digest and leader.digest == self.outer_digest:
            # peers that start together from the same weights (a pretrained model, a seed): the joiners downloaded
            # the same outer parameters and zero momenta, 64 MB each for 8M parameters, all from the leader over its
            # one link (17 s at 100 Mbit/s for 3 peers); it trained meanwhile and stayed H inner steps ahead of them
            # for the whole run, waiting at each of its sync points (benchmarks/compute_utilization.py --diloco)
            logger.info(f"DiLoCo swarm {self.run_id!r} starts from the outer parameters of peer {leader.peer}, the "
                        "same as this peer's: nothing to download")  # fmt: skip
            return False
        logger.info(f"Joining DiLoCo swarm {self.run_id!r} at outer step {leader.outer_step} (state of {leader.peer})")
        # peers that start a run together (min_peers) each make the first outer step's H inner steps: a peer that
        # started a moment earlier waits for the others at its sync point instead of shortening their first round
        if self._adopt_swarm_state(prefer=leader.peer, follow_inner=leader.outer_step > 0, joining=True):
            return True
        logger.warning(
            "Could not download the swarm's outer state: starting from this peer's own parameters (if they are not "
            "the swarm's, its digest tells at the first sync point, and the peer downloads them there)"
        )
        return False

    def wait_for_records(self, peers: int, timeout: float) -> int:
        """Wait until `peers` other peers published DiLoCo progress (those that announced their model are about to):
        a peer that syncs before they did would take its first outer step alone. Return how many did."""
        deadline = time.monotonic() + timeout
        while len(self._others()) < peers and time.monotonic() < deadline:
            time.sleep(POLL_PERIOD)
        return len(self.peers)

    def _adopt_swarm_state(
        self, prefer: str | None = None, follow_inner: bool = True, joining: bool = False, wait: bool = True
    ) -> bool:
        """Download outer parameters, momentum and step; start from the swarm's inner step at that outer step.

        If the peers at that outer step are already at their sync point (averaging now), wait for the outer step they
        are about to take and download again: starting one inner step before a sync whose group has already formed,
        this peer would fail that sync, fall behind while it searched, download again at the next sync point, and so
        on (seen under load: a joiner missed 3 of 5 syncs that way).

        [overlap] A joiner that finds the swarm syncing the outer step it loaded in the background does not wait: with
        short inner steps the swarm is syncing almost all the time, and a joiner that waited and downloaded again found
        it at its next sync every time (it missed 4 syncs in a row). It trains on as if it were syncing that step too
        (its record says so: the others wait for it at their next sync point), and downloads the result once the swarm
        publishes it (`PendingSync.joined`); then it takes the swarm's inner step without waiting again (`wait` False):
        the others wait for it at their sync point, as its record said it was syncing the step before."""
        loaded = self._download(prefer)
        in_flight = False
        for _ in range(ADOPT_TRIES):  # (a few times: the swarm may be at its next sync point when a download ends)
            if loaded is not None and self._swarm_is_ahead(outer_step=int(loaded[0]["epoch"])):
                # served before its peer took its next outer step (a peer syncing alone meanwhile): loaded, it made
                # this peer train H inner steps on an outer step the swarm had left, and miss the next sync too
                logger.info(f"Downloaded outer step {loaded[0]['epoch']}, which the swarm is past: downloading again")
                loaded = self._download(None) or loaded
                continue
            if loaded is None or not follow_inner or not wait:
                break
            if joining and self.cfg.overlap and self._swarm_at_sync_point(int(loaded[0]["epoch"])):
                in_flight = True
                break
            if self._catching_up and int(loaded[0]["epoch"]) == self.outer_step + 1:
                break  # the peers at that outer step wait for this one at their sync point (its record said it comes)
            if not self._wait_until_swarm_passes(int(loaded[0]["epoch"])):
                break
            loaded = self._download(None) or loaded  # the highest outer step served
        if loaded is None:
            return False
        metadata, tensors = loaded
        count = len(self.outer_params)
        with torch.no_grad(), self._lock:
            for target, source in zip((*self.outer_params, *self.momenta), tensors, strict=True):
                target.copy_(source)
            self.outer_step = int(metadata["epoch"])
            self.outer_digest = outer_digest(self.outer_params)
            same = [r.inner_done for r in self._others().values() if r.outer_step == self.outer_step]
            if in_flight:  # at the others' inner step, past the sync point, as a peer syncing in the background
                self.inner_done = min(max(same, default=self.interval), 2 * self.interval - 1)
            else:
                self.inner_done = min(max(same, default=0), self.interval - 1) if follow_inner else 0
            self.fragment_samples = [0] * len(self.fragments)
            self._copy_outer_to_model()
        self.averager.state_sharing_priority = float(self.outer_step)
        logger.info(f"Loaded the outer state at outer step {self.outer_step} ({count} tensors)")
        self._catching_up = False  # (its record now says where it is)
        if in_flight:
            self._follow_sync_in_flight()
        # at once, and stored before it trains on: the peers at that outer step expect this one in their next group
        # only once they see it there (its record said the outer step it left: a joiner's first group once assembled
        # without it, and it failed its sync). (A download that lands as the others reach their sync point, after
        # the check above, still makes this peer one sync late: their group forms without it, its search fails, and
        # it downloads their result: `syncs` counts it as failed and missed. Seen once, a CI run of stop 45.)
        self._publish(wait=True)
        return True

    def _download(self, prefer: str | None) -> tuple[dict[str, Any], list[torch.Tensor]] | None:
        timeout = self.config.opt.load_state_timeout
        loaded = self.averager.load_state_from(prefer, timeout) if prefer is not None else None
        return loaded if loaded is not None else self.averager.load_state_from_peers(timeout=timeout)

    def _swarm_at_sync_point(self, outer_step: int) -> bool:
        at_step = [r for r in self._others().values() if r.outer_step == outer_step]
        return any(r.at_sync_point for r in at_step)

    def _follow_sync_in_flight(self) -> None:
        """[overlap] A joiner: follow the swarm's sync of this outer step, which began before it arrived (see
        `_adopt_swarm_state`): a pending sync that contributes nothing and ends when the swarm moves past it."""
        at_sync = [self.params[i].detach().to("cpu", torch.float32, copy=True) for i in self.fragments[self.fragment]]
        pending = PendingSync(outer_step=self.outer_step, weight=0, at_sync=at_sync, joined=True)
        pending.thread = threading.Thread(target=self._await_swarm_past, args=(pending,), name="trahiv-diloco-sync",
                                          daemon=True)  # fmt: skip
        self._pending = pending
        pending.thread.start()

    def _await_swarm_past(self, pending: PendingSync) -> None:
        deadline = time.monotonic() + self.cfg.max_sync_wait + self.config.opt.averaging_timeout
        try:
            while time.monotonic() < deadline and not self._stop.is_set():
                if any(r.outer_step > pending.outer_step for r in self._others().values()):
                    break
                time.sleep(POLL_PERIOD)
        except Exception as e:  # (the DHT shut down under it)
            logger.debug(f"Outer step {pending.outer_step}: stopped following the swarm's sync ({e!r})")
        finally:
            pending.outcome = "behind"
            pending.done.set()

    def _wait_until_swarm_passes(self, outer_step: int) -> bool:
        """If peers at `outer_step` are at their sync point (or, with overlap, syncing it in the background), wait (at
        most a round's timeout) until one of them publishes a later outer step; True if it did (a newer outer state
        is then served)."""
        if not self._swarm_at_sync_point(outer_step):
            return False
        logger.info(f"The swarm is averaging outer step {outer_step}: waiting for its result before joining")
        deadline = time.monotonic() + self.config.opt.averaging_timeout + self.config.opt.matchmaking_time
        while time.monotonic() < deadline:
            if any(r.outer_step > outer_step for r in self._others().values()):
                return True
            time.sleep(POLL_PERIOD)
        return False

    def revert_to(self, metadata: dict[str, Any], tensors: Sequence[torch.Tensor]) -> None:
        """[revert] Restart from a checkpoint's outer state (see trahiv.revert.DiLoCoRevertFollower)."""
        self.drop_pending_sync()
        with torch.no_grad(), self._lock:
            for target, source in zip((*self.outer_params, *self.momenta), tensors, strict=True):
                target.copy_(source)
            self.outer_step, self.inner_done = int(metadata["epoch"]), 0
            self.fragment_samples = [0] * len(self.fragments)
            self.outer_digest = outer_digest(self.outer_params)
            self.inner.state.clear()  # (the same dict as self.state) fresh statistics, as at the run's start
            self._copy_outer_to_model()
        self.averager.state_sharing_priority = float(self.outer_step)
        self._publish()

    def resume_at(self, global_step: int) -> None:
        """A checkpoint of this trainer was loaded: continue the step count from it."""
        self.outer_step, self.inner_done = divmod(global_step, self.interval)

    # --- progress records -------------------------------------------------------------------------------------------

    def _record(self) -> dict[str, Any]:
        with self._lock:  # an outer step and the digest of its outer parameters
            outer_step, digest = self.outer_step, self.outer_digest
        return {
            "peer_id": self.swarm.dht.peer_id.to_bytes(),
            "outer_step": outer_step,
            "outer_digest": digest,
            "inner_done": self.inner_done,
            "inner_steps": self.interval,  # (between two sync points: H / fragments)
            # (the weight caps read it: with a sync in flight, the samples of its pseudo-gradient)
            "samples_accumulated": self._pending.weight if self._pending is not None else self.samples,
            "samples_per_second": self.steps_per_second * self.batch_size_per_step,
            "steps_per_second": self.steps_per_second,
            "time": get_dht_time(),
            "started": self.started,
            "revert_id": self.revert.applied_id if self.revert is not None else 0,
            "syncing": self._pending is not None or self._catching_up,
            "sync_failed": self._sync_failed,
            **total_traffic(self.averagers),  # for the auxiliary peer's dashboard (trahiv.auxiliary.diloco)
        }

    def _publish(self, wait: bool = False) -> None:
        record = self._record()
        dht = self.swarm.dht
        stored = dht.store(
            self.progress_key,
            subkey=record["peer_id"],
            value=record,
            expiration_time=record["time"] + RECORD_TTL,
            return_future=True,
        )
        if wait:
            dht_answer(dht, stored)

    def _publish_periodically(self) -> None:
        while not self._stop.wait(PUBLISH_PERIOD):
            try:
                self._publish()
            except Exception as e:  # the DHT is shutting down; the next sync publishes again
                logger.debug(f"Could not publish DiLoCo progress: {e!r}")

    # --- metrics, checkpoints, leaving -------------------------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        rounds: dict[str, int] = {}
        for averager in self.averagers:  # (one per fragment)
            averager.round_reports()
            for status, n in averager.round_counts.items():
                rounds[f"averaging_rounds_{status}"] = rounds.get(f"averaging_rounds_{status}", 0) + n
        return {
            "outer_step": self.outer_step,
            "swarm_peers": 1 + len(self.peers),
            "samples_contributed": self.samples_total,
            "diloco_syncs_missed": self.syncs["missed"],
            "diloco_syncs_diverged": self.syncs["diverged"],
            "diloco_sync_wait_s": round(self.sync_wait_s, 3),
            "diloco_overlapped_steps": self.overlapped_steps,
            **rounds,
            **total_traffic(self.averagers),
        }

    def whole_step(self, timeout: float = WHOLE_STATE_WAIT) -> int | None:
        """The inner step whose weights and inner and outer states this peer holds, all of them (what a checkpoint must
        hold), or None: an interrupt came inside an inner step or a sync (`fixes.changing_state`), or ([overlap]) the
        sync running in the background has not ended within `timeout` seconds (`state_dict` applies one that has)."""
        pending = self._pending
        if fixes.interrupted_mid_change() or (pending is not None and not pending.done.wait(timeout)):
            return None
        return self.global_step

    def state_dict(self) -> dict[str, Any]:
        self.finish_pending_sync()  # [overlap] (the flow callback finishes it before the model is saved)
        state = self.inner.state_dict()
        with self._lock:
            state["diloco"] = {
                "outer_step": self.outer_step,
                "inner_done": self.inner_done,
                "outer_params": [t.clone() for t in self.outer_params],
                "momenta": [t.clone() for t in self.momenta],
                "samples": self.samples,
                "fragment_samples": list(self.fragment_samples),
                "samples_total": self.samples_total,
            }
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        saved = state.pop("diloco", None)
        self.inner.load_state_dict(state)
        if saved is not None:
            with torch.no_grad(), self._lock:
                for target, source in zip(
                    (*self.outer_params, *self.momenta), (*saved["outer_params"], *saved["momenta"]), strict=True
                ):
                    target.copy_(source)
                self.outer_step, self.inner_done = int(saved["outer_step"]), int(saved["inner_done"])
                self.outer_digest = outer_digest(self.outer_params)
                # the pseudo-gradient's weight counts the samples of this round from before the restart too
                samples = int(saved.get("samples", self.inner_done * self.batch_size_per_step))
                fragment_samples = saved.get("fragment_samples", [samples])
                if len(fragment_samples) != len(self.fragments):  # saved with another number of fragments
                    fragment_samples = [samples] * len(self.fragments)
                self.fragment_samples = [int(n) for n in fragment_samples]
                self.samples_total = int(saved.get("samples_total", self.samples_total))
                # (accelerate's optimizer wrapper also round-trips the fresh state through load_state_dict when it
                # wraps the optimizer: only a state with progress is a checkpoint's)
                self.resumed = self.global_step > 0
            self.averager.state_sharing_priority = float(self.outer_step)
            self._publish()  # at once: a peer about to sync must not see this one at the outer step it started with

    def serve_late_peers(self) -> None:
        """Training ended: keep serving this peer's outer state while a peer still at the outer step before this one's
        is at its sync point (its averaging of that sync failed: it waits for the round that went on without it, then
        downloads the result, `_adopt_after_a_missed_sync`), for at most a round's timeout. Leaving at once, the last
        peers of a run stopped serving as the peer that missed their last sync came to download it: it took that
        outer step with its own pseudo-gradient and ended apart from them (a clean-clone run, 2026-11-28)."""
        opt, outer_step = self.config.opt, self.outer_step

        def late() -> list[str]:
            others = self._others().values()
            return [r.peer for r in others if r.outer_step == outer_step - 1 and r.at_sync_point]

        serve_while_late(
            late,
            opt.averaging_timeout + opt.matchmaking_time,
            lambda peers: (
                f"Training ended at outer step {outer_step}: serving its outer state to the peers still at "
                f"their last sync ({', '.join(peers)})"
            ),
            f"Stopped serving the outer state of outer step {outer_step}",
            poll=POLL_PERIOD,
        )

    def shutdown(self) -> None:
        self._stop.set()
        self._publisher.join(timeout=1.0)
        if self._pending is not None:  # [overlap] interrupted mid-sync: its outer step is not taken
            logger.info(f"Leaving with the sync of outer step {self._pending.outer_step} unfinished")
        try:  # a blocking store: the DHT has handled every earlier (background) store before it stops
            self._publish(wait=True)
        except Exception as e:
            logger.debug(f"Could not publish the last DiLoCo progress: {e!r}")
        for averager in self.averagers:
            if averager.is_alive():
                averager.shutdown()


def group_bits(outer_step: int, digest: str) -> str:
    """The group key bits (16, as trahiv's step keys: trahiv.engine.fixes) for an outer step and the digest of the
    outer parameters: peers at different outer steps, or with other outer parameters, never form a group."""
    return format(outer_step % 2**8, "08b") + format(int(digest[:2] or "0", 16), "08b")


# --- the Trainer's flow over inner steps ----------------------------------------------------------------------------


class DiLoCoFlowCallback(DefaultFlowCallback):
    """transformers' flow (log, save, evaluate, stop by `state.global_step`) over the swarm's inner steps: a joiner
    starts at the swarm's step, a peer that adopted the swarm's state jumps to it."""

    def __init__(self, trainer: Any):
        self.trainer = trainer
        self._recorded_outer_step = 0  # the outer step of this peer's last metrics record

    @property
    def diloco(self) -> DiLoCoOptimizer:
        return self.trainer.swarm.diloco

    def on_train_begin(self, args, state, control, **kwargs):
        opt = self.diloco
        if state.global_step > opt.global_step:  # resumed from a checkpoint without DiLoCo state
            opt.resume_at(state.global_step)
        swarm = self.trainer.swarm
        swarm.mark_ready()  # min_peers counts peers that train
        peers = swarm.wait_for_peers()
        opt.wait_for_records(peers - 1, timeout=min(swarm.config.opt.min_peers_timeout, 30.0))
        with fixes.changing_state():  # (a download of the swarm's outer state; a sync due)
            opt.join()
            opt.sync_if_due()
        self._follow(state, schedule=True)
        self._recorded_outer_step = opt.outer_step  # (a joiner's or a resumed peer's first record: its next sync)
        swarm.count_record_samples_from(opt.samples_total)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        trainer = self.trainer
        trainer.local_steps_since_log += 1  # the Trainer's loss average counts local steps (see Trainer)
        trainer.local_steps_total += 1
        trainer.local_steps_since_record += 1
        self._follow(state)
        trainer.swarm.publish_model()
        control = super().on_step_end(args, state, control, **kwargs)
        if control.should_save or control.should_training_stop:  # [overlap] a checkpoint, or the model at the end,
            self.diloco.finish_pending_sync()  # holds the outer step of the sync in flight (model and state agree)
        if self.diloco.outer_step > self._recorded_outer_step:  # a sync ended: a metrics record (the aux peer's loss
            self._recorded_outer_step = self.diloco.outer_step  # curve, per outer step)
            trainer.publish_metrics()
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self.diloco.serve_late_peers()  # (not after an interruption: the Trainer calls this only at the end)
        return control

    def _follow(self, state: Any, schedule: bool = False) -> None:
        """The Trainer's step (and its LR schedule's) at the DiLoCo step. With `schedule`, the schedule's in any case:
        a checkpoint saved as its peer stopped inside an inner step's sync (`DiLoCoOptimizer.sync`) holds the
        schedule of the step before (the Trainer steps it after the optimizer), and the resumed peer trained one step
        behind its schedule."""
        step = self.diloco.global_step
        if step != state.global_step or schedule:
            state.global_step = step
            set_schedule_step(self.trainer.lr_scheduler, step)


def set_schedule_step(scheduler: Any, step: int) -> None:
    """Move a torch LR scheduler (transformers' schedules are LambdaLR) to `step` and set the LRs it gives there."""
    scheduler = getattr(scheduler, "scheduler", scheduler)  # accelerate's wrapper
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if scheduler is None or lambdas is None:
        return
    scheduler.last_epoch = step
    lrs = [base * fn(step) for fn, base in zip(lambdas, scheduler.base_lrs, strict=True)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    scheduler._last_lr = lrs
