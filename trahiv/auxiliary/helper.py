"""The auxiliary peer helps the trainers average gradients: `trahiv aux --average`.

hivemind's auxiliary mode: the peer joins the trainers' gradient all-reduce with weight 0. It sends nothing of its
own, but reduces a share of every tensor (by bandwidth, like any group member) and sends the result back, so each
trainer moves less data. It computes no gradients and needs no GPU, nor the model: the averager is built from the
tensor schema (dtype and shape of each trainable tensor, in the optimizer's order) that trainers publish with their
model fingerprint (`trahiv.swarm.model_fingerprint`); the schema most trainers agree on is used.

The helper's averager is the trainers' (`trahiv.swarm.grad_averager_factory`, the same config): the part it reduces
is aggregated with the swarm's `aggregation` (CenteredClip...), garbage is excluded, each sender's weight is clamped
to the samples it reported, its rounds are reported (complete / partial / failed) under the same deadlines, and in a
moderated swarm it serves only token holders. It follows the swarm's progress with a tracker that publishes nothing
(an aux peer is not counted among the trainers): it looks for a group when the next collaborative step is due within
`matchmaking_time` (declaring a later time than the trainers, so that it joins their group rather than leading one),
and joins the all-reduce once the trainers reported `target_batch_size` samples. If it falls behind (the swarm moved
on), it skips to the swarm's step without averaging; it helps from the first step it sees coming.

Parameter rounds: trainers that are all in client mode cannot lead one among themselves (behind NAT, around this
peer). The helper then leads them too: every `average_state_every` steps, right after the gradient round, it runs the
trainers' parameter round in auxiliary mode (trahiv.engine.averagers.AuxiliaryStateAverager: the same tensors'
shapes, in float32; every trainer weighs 1) and announces itself as a parameter helper in the DHT
(trahiv.connectivity), so that the trainers schedule those rounds instead of skipping them. Not when the trainers
also average optimizer statistics (`average_opt_statistics`: their shapes are not in the schema): said once.

Not offered with PowerSGD (`power_sgd_rank`: hivemind's PowerSGD averager has no auxiliary mode) nor for swarms that
average parameters only (`use_local_updates`): `attach` refuses those with the reason.

Not hivemind.Optimizer(auxiliary=True): in hivemind 1.1.12 that optimizer also brings a state averager under the
name the state keeper serves state with (see trahiv.auxiliary.keeper), and needs the model.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from trahiv.config import HivemindConfig

if TYPE_CHECKING:
    from trahiv.auxiliary.peer import AuxPeer

logger = logging.getLogger("trahiv.auxiliary.helper")

__all__ = ["AveragingHelper", "add_arguments", "agreed_schema", "attach", "check_config"]

TICK = 0.05  # seconds between looks at the swarm's progress while a step is due
SCHEMA_POLL = 1.0  # seconds between looks for the trainers' tensor schema before the first trainer arrives
WAITING_LOG_PERIOD = 60.0  # seconds between "waiting for a trainer" lines
STOP_TIMEOUT = 3.0  # seconds to wait for the helper's thread, then for its progress tracker, when stopping


def check_config(config: HivemindConfig) -> None:
    """Refuse swarm settings the helper cannot serve, with the reason."""
    opt = config.opt
    if opt.use_local_updates:
        raise ValueError(
            "--average helps average gradients, and this swarm averages parameters only (use_local_updates=True)"
        )
    if opt.power_sgd_rank is not None:
        raise ValueError(
            "--average cannot help a PowerSGD swarm (power_sgd_rank): hivemind's PowerSGD averager has no "
            "auxiliary mode. Drop --average, or power_sgd_rank"
        )


def agreed_schema(records: dict[str, dict[str, Any]]) -> tuple[list[list[Any]], list[str]] | None:
    """The tensor schema most trainers published with their model fingerprint, and the peers that published it
    (None before any trainer published one). A schema is [[dtype, shape], ...] in the optimizer's order. Only
    trainers that speak this trahiv's wire protocol count: this peer can share a group with no other."""
    from trahiv.protocol import WIRE_PROTOCOL, record_protocol

    votes: Counter[str] = Counter()
    by_key: dict[str, tuple[list[list[Any]], list[str]]] = {}
    for peer, fingerprint in sorted(records.items()):
        schema = fingerprint.get("schema")
        if schema is None or record_protocol(fingerprint) != WIRE_PROTOCOL:
            continue
        key = repr((fingerprint["digest"], schema))
        votes[key] += 1
        by_key.setdefault(key, (schema, []))[1].append(peer)
    if not votes:
        return None
    return by_key[votes.most_common(1)[0][0]]


class AveragingHelper:
    """An AuxPeer service (`start(peer)` / `stop()`), or `start_with(dht, config, gate)` without an AuxPeer."""

    def __init__(self) -> None:
        self.config: HivemindConfig | None = None
        self.averager: Any = None
        self.state_averager: Any = None  # parameter rounds of trainers in client mode (None: not offered)
        self.state_names_taken = False  # this peer also serves the trainers' state (see start)
        self.tracker: Any = None
        self.schema_peers: list[str] = []
        self.rounds: dict[str, int] = {}  # complete / partial / failed rounds it took part in (the averager's reports)
        self.state_rounds: dict[str, int] = {}  # the same for parameter rounds
        self.skipped = 0  # collaborative steps the swarm took without this peer (it fell behind or had no group)
        self._dht: Any = None
        self._gate: Any = None
        self._control: Any = None
        self._averaging: Any = None  # the round `_average` waits for
        self._next_refresh = 0.0
        self._next_announcement = 0.0
        self._next_waiting_log = time.monotonic() + 10.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, peer: AuxPeer) -> None:
        # a service of this peer that serves the trainers' state (the state keeper) holds the RPC names of their state
        # averager, which a parameter round's averager needs too: p2pd takes one handler per name ("handler for
        # protocol ..._state_averager::TrainingStateAverager.rpc_join_group already set", a traceback at every start)
        self.state_names_taken = any(getattr(service, "serves_state", False) for service in peer.services)
        self.start_with(peer.dht, peer.config, gate=peer.auth_gate())

    def start_with(self, dht: Any, config: HivemindConfig, gate: Any = None) -> None:
        check_config(config)
        self._dht, self.config, self._gate = dht, config, gate
        self._thread = threading.Thread(target=self._loop, name="trahiv-averaging-helper", daemon=True)
        self._thread.start()
        logger.info(f"Helping swarm {config.opt.run_id!r} average gradients (auxiliary mode)")

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """Stop within about 2 x `timeout` + the averager's shutdown: an aux peer must leave within seconds of SIGTERM
        (with 10 s here it once took 15 s, and was killed)."""
        self._stop.set()
        for control in (self._control, self._averaging):  # a round in progress would hold the thread for its timeout
            if control is not None and not control.done():
                control.cancel()
        if self._thread is not None:
            self._thread.join(timeout)
        control, self._control = self._control, None
        if control is not None and not control.done():
            control.cancel()
        try:
            if self.tracker is not None:
                from trahiv.engine.optimizer import stop_tracker_quietly

                stop_tracker_quietly(self.tracker, timeout)
            if self.averager is not None:
                self.averager.round_reports()  # the last reports, into round_counts
                self.rounds = dict(self.averager.round_counts)
                self.averager.shutdown()
            if self.state_averager is not None:
                self.state_averager.round_reports()
                self.state_rounds = dict(self.state_averager.round_counts)
                self.state_averager.shutdown()
        except Exception as e:
            logger.warning(f"Stopping the averaging helper failed: {e!r}")
        self.tracker = self.averager = self.state_averager = None
        logger.info(
            f"Averaging helper stopped: rounds {dict(self.rounds)}, parameter rounds {dict(self.state_rounds)}, steps "
            f"skipped {self.skipped}"
        )

    # --- the loop -------------------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                if self.averager is None:
                    if not self._build():
                        self._stop.wait(SCHEMA_POLL)
                        continue
                self._tick()
            except Exception as e:  # a failed round or a DHT hiccup must not stop the aux peer
                logger.warning(f"Averaging helper: {e!r}", exc_info=True)
                self._stop.wait(1.0)
            self._stop.wait(TICK)

    def _build(self) -> bool:
        """Start the averager and the tracker once a trainer published the swarm's tensor schema."""
        import torch

        from trahiv import engine
        from trahiv.compression import make_compression
        from trahiv.engine.optimizer import SwarmProgressTracker, grad_averager_factory, tracker_opts
        from trahiv.protocol import progress_prefix

        assert self.config is not None
        opt = self.config.opt
        records = self._model_records()
        found = agreed_schema(records)
        if found is None:
            if time.monotonic() >= self._next_waiting_log:
                self._next_waiting_log = time.monotonic() + WAITING_LOG_PERIOD
                logger.info(
                    "Averaging helper: waiting for a trainer of this run to publish its tensor schema (trainers do "
                    f"when they start; {len(records)} model record(s) without one so far)"
                )
            return False
        schema, self.schema_peers = found
        # parameters that hold no values (zero strides): the averager needs only their shapes and dtypes; their
        # gradient buffers are the averaged tensors (one copy of the trainable tensors in memory, in all)
        parameters = [
            torch.nn.Parameter(torch.zeros((), dtype=getattr(torch, dtype)).expand(*shape)) for dtype, shape in schema
        ]
        for param in parameters:
            param.grad = torch.zeros(param.shape, dtype=param.dtype)
        factory = grad_averager_factory(opt, self._gate)
        with engine.children_ignore_sigint():
            averager = factory(
                dht=self._dht,
                prefix=f"{opt.run_id}_grad_averager",
                parameters=parameters,
                min_matchmaking_time=opt.matchmaking_time,
                allreduce_timeout=opt.allreduce_timeout or opt.averaging_timeout,
                shutdown_timeout=opt.shutdown_timeout,
                next_chunk_timeout=opt.next_chunk_timeout or opt.matchmaking_time,
                reuse_grad_buffers=True,  # no gradient accumulators: an auxiliary peer accumulates nothing
                averaged_grads=tuple(param.grad for param in parameters),
                compression=make_compression(opt.grad_compression),
                client_mode=False,
                auxiliary=True,
                warn=False,  # ("results not used": an auxiliary peer has none)
                min_group_size=3,  # should it lead a group after all: itself and at least two trainers
                start=True,
            )
            try:
                tracker = SwarmProgressTracker(
                    dht=self._dht,
                    prefix=progress_prefix(opt.run_id),
                    target_batch_size=opt.target_batch_size,
                    client_mode=False,
                    start=True,
                    **tracker_opts(opt),
                )
            except BaseException:
                averager.shutdown()
                raise
        self.averager, self.tracker = averager, tracker  # both, or neither (the loop tries again)
        self.state_averager = self._build_state_averager([param.grad for param in parameters])
        values = sum(int(p.numel()) for p in parameters)
        logger.info(
            f"Averaging helper ready: {len(schema)} tensors, {values:,} values (schema of peers "
            f"{', '.join(self.schema_peers)}); parameter rounds: "
            f"{'led when every trainer is in client mode' if self.state_averager is not None else 'not offered'}"
        )
        return True

    def _build_state_averager(self, tensors: list[Any]) -> Any:
        """The auxiliary side of the trainers' parameter rounds (see the module's docstring), or None."""
        import torch
        from hivemind.compression import CompressionInfo, TensorRole

        from trahiv import engine
        from trahiv.compression import make_compression
        from trahiv.engine.optimizer import aux_state_averager_factory

        assert self.config is not None
        opt = self.config.opt
        if opt.average_opt_statistics:
            logger.info(
                "Averaging helper: parameter rounds not offered (the trainers also average optimizer statistics "
                f"{list(opt.average_opt_statistics)}, whose shapes the helper does not know)"
            )
            return None
        if self.state_names_taken:
            logger.info(
                "Averaging helper: parameter rounds not offered (this aux peer keeps and serves the trainers' state, "
                "under the names a parameter round uses; an aux peer started with --average and without --model "
                "leads them for trainers that are all in client mode)"
            )
            return None
        # the trainers' averaged parameters are float32 host copies (hivemind's TrainingStateAverager)
        state = [t if t.dtype == torch.float32 else torch.zeros(t.shape, dtype=torch.float32) for t in tensors]
        infos = [CompressionInfo.from_tensor(t, key=i, role=TensorRole.PARAMETER) for i, t in enumerate(state)]
        with engine.children_ignore_sigint():
            return aux_state_averager_factory(opt, self._gate)(
                averaged_tensors=state,
                dht=self._dht,
                prefix=f"{opt.run_id}_state_averager",
                min_matchmaking_time=opt.matchmaking_time,
                allreduce_timeout=opt.allreduce_timeout or opt.averaging_timeout,
                shutdown_timeout=opt.shutdown_timeout,
                next_chunk_timeout=opt.next_chunk_timeout or opt.matchmaking_time,
                compression=make_compression(opt.state_averaging_compression),
                tensor_infos=infos,
                client_mode=False,
                auxiliary=True,
                min_group_size=3,  # itself and at least two trainers
                start=True,
            )

    def _model_records(self) -> dict[str, dict[str, Any]]:
        from trahiv.swarm import model_records

        assert self.config is not None
        return model_records(self._dht, self.config.opt.run_id)

    def _tick(self) -> None:
        assert self.config is not None
        from hivemind.utils import get_dht_time

        from trahiv.engine.optimizer import in_group as group_formed

        opt, tracker, control = self.config.opt, self.tracker, self._control
        pending = control is not None and not control.triggered and not control.done()
        eta = tracker.global_progress.eta_next_epoch - get_dht_time()
        in_group = pending and group_formed(control)
        if (eta <= 0 or in_group or tracker.ready_to_update_epoch) and time.monotonic() >= self._next_refresh:
            # due, or the trainers' group (this peer included) waits for the samples, or they are averaging: look at
            # the progress now, not at the tracker's next fetch (trainers would wait for this peer's share)
            self._next_refresh = time.monotonic() + 2 * TICK
            tracker.refresh_now()
        local, swarm = tracker.local_progress.epoch, tracker.global_epoch
        trainers = len(tracker.active_peers)  # (this peer publishes no progress: only trainers are counted)
        can_lead = any(not record.client_mode for record in tracker.active_peers.values())
        self._announce()
        if swarm > local:  # the trainers moved on: this step's round is over, with or without this peer
            self._next_step(self._step_to_aim_at(swarm, can_lead), skipped=True)
        elif tracker.ready_to_update_epoch:  # the trainers reached the step's samples: they average now
            if not pending and trainers >= 2 and not can_lead:
                # only clients, which cannot form a group without this peer: they wait for a leader, lead now
                control, pending = self._schedule(opt.matchmaking_time), True
                logger.info(f"Averaging helper, step {local}: the trainers (all in client mode) wait for a leader")
            if pending:
                self._control = None
                took_part = self._average(self.averager, control, local)
                self._next_step(local + 1 if took_part else self._step_to_aim_at(local + 1, can_lead))
                if self._leads_parameter_round(local + 1, can_lead):
                    self._average_parameters(local + 1)
            # else: they average without this peer. No new group before they moved on (it would join theirs).
        elif trainers >= 2 and eta <= opt.matchmaking_time and not pending:
            # (this peer publishes no progress: only trainers are counted, and they average only with another one)
            # If a trainer can lead a group (not in client mode), declare a later time than any trainer's: in
            # hivemind's matchmaking a peer only joins leaders that declared an earlier time, so this peer joins the
            # trainers' group rather than leading one of its own (a group of itself and one trainer would average
            # nothing). If all trainers are in client mode, this peer leads, with the trainers' timing.
            self._schedule(
                min(2 * opt.matchmaking_time, opt.averaging_timeout / 2) if can_lead else opt.matchmaking_time
            )

    def _step_to_aim_at(self, step: int, can_lead: bool) -> int:
        """The step whose gradient round this peer looks for next, after it missed one and the trainers are at `step`
        (or past it). Trainers that can lead form their group as they enter a step (they expect each other, not this
        peer), so a search that begins after that finds the group gone: a helper that missed one round, then searched
        for each step as it saw the trainers in it, missed every later one (45 steps in a row, `test_aux_auth.py`,
        twice in clean-clone runs). It looks for the next step's group instead, before the trainers enter it. Trainers
        that are all in client mode wait for this peer to lead: their step's round is still to come."""
        self.tracker.refresh_now()
        step = max(step, self.tracker.global_epoch)
        return step + 1 if can_lead else step

    def _schedule(self, wait: float) -> Any:
        """Look for a group, declaring that the round begins in `wait` seconds."""
        from hivemind.utils import get_dht_time

        assert self.config is not None
        timeout = self.config.opt.averaging_timeout
        self.averager.round_epoch = self.tracker.local_progress.epoch  # the trainers' rounds are keyed by their step
        self.averager.expect_peers(self._expected_trainers())  # (when it leads)
        self._control = self.averager.schedule_step(scheduled_time=get_dht_time() + wait, timeout=timeout)
        return self._control

    def _expected_trainers(self) -> list[bytes]:
        """This peer and every trainer it sees: a group it leads assembles once they all joined. Not only those at the
        step or behind it, as a trainer's own rounds expect (trahiv.protocol.expected_in_round): this peer reads the
        trainers' progress less often than they do, and a record one or two steps old once left a trainer out of a
        group that assembled without it (it then stepped alone). A trainer that is gone costs the declared time."""
        return [self._dht.peer_id.to_bytes(), *(record.peer_id for record in self.tracker.active_peers.values())]

    def _announce(self) -> None:
        """Say in the DHT that this peer leads parameter rounds (trainers in client mode skip them otherwise)."""
        from trahiv.connectivity import PARAMETER_HELPER_TTL, announce_parameter_helper

        if self.state_averager is None or time.monotonic() < self._next_announcement:
            return
        assert self.config is not None
        self._next_announcement = time.monotonic() + PARAMETER_HELPER_TTL / 3
        announce_parameter_helper(self._dht, self.config.opt.run_id)

    def _leads_parameter_round(self, epoch: int, can_lead: bool) -> bool:
        """The trainers run a parameter round as they enter step `epoch`; this peer leads it if none of them can."""
        assert self.config is not None
        return (
            self.state_averager is not None
            and not can_lead
            and epoch % self.config.opt.average_state_every == 0
            and len(self.tracker.active_peers) >= 2
        )

    def _average_parameters(self, epoch: int) -> None:
        """Lead the trainers' parameter round of step `epoch` (right after the gradient round that ended the step
        before: the trainers run it as they enter this step)."""
        from hivemind.utils import get_dht_time

        assert self.config is not None
        opt = self.config.opt
        self.state_averager.round_epoch = epoch  # keyed like the trainers' (SwarmOptimizer._key_rounds_by_step)
        self.state_averager.expect_peers(self._expected_trainers())
        control = self.state_averager.schedule_step(
            scheduled_time=get_dht_time() + opt.matchmaking_time, timeout=opt.averaging_timeout
        )
        self._average(self.state_averager, control, epoch, what="parameters")

    def _next_step(self, epoch: int, skipped: bool = False) -> None:
        control, self._control = self._control, None
        if skipped:
            if control is not None and not control.done():
                control.cancel()
            self.skipped += 1
            if epoch > self.tracker.local_progress.epoch + 1:
                logger.info(f"Averaging helper: the swarm is at step {epoch}, following it")
        with self.tracker.pause_updates():
            self.tracker.update_epoch(epoch)

    def _wait_for_round(self, control: Any, step: int, timeout: float, give_up: bool) -> None:
        """Wait (at most `timeout`) for the round of `step`. A gradient round (`give_up`) whose group has not formed is
        given up once the trainers moved past `step`: they averaged without this peer, and searching on until the
        timeout kept it out of every later round (the trainers went on 50 steps while it searched for 60 s, in a
        clean-clone test run under load)."""
        from concurrent.futures import TimeoutError as FutureTimeout

        from trahiv.engine.optimizer import in_group

        deadline, next_refresh = time.monotonic() + timeout, 0.0
        while True:
            try:
                control.result(timeout=min(1.0, max(deadline - time.monotonic(), 0.0)))
                return
            except FutureTimeout:
                pass
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no round within {timeout:.0f} s")
            if give_up and not in_group(control):
                if time.monotonic() >= next_refresh:
                    next_refresh = time.monotonic() + 1.0
                    self.tracker.refresh_now()
                if self.tracker.global_epoch > step:
                    raise RuntimeError(f"the trainers moved on to step {self.tracker.global_epoch} without this peer")

    def _average(self, averager: Any, control: Any, step: int, what: str = "") -> bool:
        """Take part in the round of `control`; whether it ended with this peer in it (how it went is in the
        averager's reports)."""
        opt = self.config.opt if self.config is not None else None
        assert opt is not None
        label = f"step {step}" + (f" ({what})" if what else "")
        self._averaging = control
        took_part = False
        try:
            averager.step(control=control, wait=False, timeout=opt.averaging_timeout)
            self._wait_for_round(control, step, opt.averaging_timeout, give_up=averager is self.averager)
            took_part = True
        except BaseException as e:
            if not control.done():
                control.cancel()
            if isinstance(e, KeyboardInterrupt | SystemExit):
                raise
            if averager is self.averager:
                self.skipped += 1  # no group (a round that began and failed is also reported below)
            logger.info(f"Averaging helper, {label}: no round ({e!r})")
        finally:
            self._averaging = None
            for report in averager.round_reports():  # also counted in the averager's round_counts
                logger.info(f"Averaging helper, {label}: {report.describe()}")
        self.rounds = dict(self.averager.round_counts)
        if self.state_averager is not None:
            self.state_rounds = dict(self.state_averager.round_counts)
        return took_part


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("averaging")
    group.add_argument(
        "--average",
        action="store_true",
        help="help the trainers average gradients (hivemind's auxiliary mode: reduces a share, computes nothing)",
    )


def attach(peer: AuxPeer, args: argparse.Namespace) -> None:
    if not args.average:
        return
    check_config(peer.config)
    peer.add_service(AveragingHelper())
