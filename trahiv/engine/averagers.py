"""trahiv's averagers: hivemind 1.1.12's all-reduce, matchmaking and state download with trahiv's fixes.

Everything here subclasses hivemind internals (the reducer, the all-reduce runner, the averagers) and is the only place
that does; the policies stay engine-free: aggregation (CenteredClip, checks on parts) in `trahiv.averaging.robust`,
deadlines and round reports in `trahiv.averaging.partial`. Bodies adapted from hivemind say so, with the function
they came from (hivemind 1.1.12).

- the all-reduce itself (reducer, runner, stream ends) is in `trahiv.engine.allreduce`; byte counts in `traffic`.
- `PartialRoundRunner` / `ReportingMixin`: partial rounds detected and reported, payload-based deadlines, rounds without
  a group counted as failed.
- `RobustGradientAverager`: a failed round falls back to this peer's gradients (hivemind's fallback was zeros).
- `OverlappedAccumulation`: a local step's gradients are added to the accumulators while the next batch computes.
- `EpochKeyedMatchmaking`: rounds of different collaborative steps never meet.
- `CheckedStateDownload` / `RobustTrainingStateAverager`: downloaded states are checked before anyone loads them.
- `RobustPowerSGDGradientAverager`: hivemind's PowerSGD on the robust reducer.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import logging
import math
import multiprocessing as mp
import pickle
import queue
import random
import select
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from typing import Any, AsyncIterator  # noqa: UP035  (hivemind finds streaming RPCs by typing.AsyncIterator)

import torch
from hivemind.averaging.averager import DecentralizedAverager
from hivemind.averaging.partition import AllreduceException
from hivemind.compression import deserialize_torch_tensor
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.power_sgd_averager import PowerSGDGradientAverager
from hivemind.optim.state_averager import TrainingStateAverager, dump_optimizer_state
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.nested import nested_flatten
from hivemind.utils.streaming import combine_from_streaming
from hivemind.utils.timed_storage import ValueWithExpiration, get_dht_time

from trahiv import protocol
from trahiv.averaging.partial import Deadlines, RoundReport, compressed_sizes
from trahiv.averaging.robust import (
    MEAN,
    WEIGHT_SLACK,
    Aggregation,
    optimizer_state_mismatch,
    reported_sample_caps,
    state_rejection_reason,
)
from trahiv.engine import fixes, tell
from trahiv.engine.allreduce import run_robust_allreduce_
from trahiv.engine.fixes import EPOCH_KEY_BITS
from trahiv.engine.traffic import Traffic, TrafficCountingRunner
from trahiv.engine.trail import matchmaking_trail

fixes.apply()  # the engine's fixes hold wherever its averagers run
logger = logging.getLogger("trahiv.averaging")
_ROUND_REPORTED: contextvars.ContextVar[list[bool]] = contextvars.ContextVar("trahiv_round_reported")
_STEP_BEGAN: contextvars.ContextVar[float] = contextvars.ContextVar("trahiv_step_began")  # time.time(): engine.trail
# Averaging steps running in this (averager) process. hivemind 1.1.12 starts each as `asyncio.create_task` and keeps
# no reference to it (DecentralizedAverager._run_internal); asyncio holds tasks weakly, and a step waiting on a future
# that only its own frame references is a garbage cycle: the garbage collector destroyed one mid-round ("Task was
# destroyed but it is pending!", a clean-clone run of test_aux_auth.py): the round hung to averaging_timeout (30 s).
_RUNNING_STEPS: set[asyncio.Task] = set()
CAPS_FETCH_TIMEOUT_S = 2.0
MAX_STATE_SOURCES = 8  # peers asked for their state, one after the other, before keeping the local state
DOWNLOAD_ATTEMPTS = 2  # times a source whose download failed is asked for its state
SERVE_BEFORE_SHUTDOWN_S = 2.0  # a leaving averager lets the parts it reduces reach their senders for this long

__all__ = [
    "AuxiliaryStateAverager",
    "CheckedStateDownload",
    "EpochKeyedMatchmaking",
    "PartialRoundRunner",
    "ReportingAverager",
    "ReportingGradientAverager",
    "ReportingMixin",
    "ReportingStateAverager",
    "OverlappedAccumulation",
    "RobustAverager",
    "RobustAuxiliaryStateAverager",
    "RobustGradientAverager",
    "RobustPowerSGDGradientAverager",
    "RobustTrainingStateAverager",
    "VersionedSchema",
    "epoch_group_bits",
    "first_download",
    "versioned_schema_hash",
]


def epoch_group_bits(epoch: int) -> str:
    """hivemind's group bits that key matchmaking by collaborative step (see EpochKeyedMatchmaking)."""
    return format(epoch % 2**EPOCH_KEY_BITS, f"0{EPOCH_KEY_BITS}b")


def versioned_schema_hash(schema_hash: bytes, version: int) -> bytes:
    """hivemind's schema hash (the tensors' shapes and dtypes) with trahiv's wire protocol `version` folded in, of the
    same length."""
    salt = f"trahiv wire protocol {version}".encode()
    return hashlib.blake2b(schema_hash, digest_size=len(schema_hash), key=salt).digest()


class VersionedSchema(DecentralizedAverager):
    """Every trahiv averager's schema hash carries trahiv's wire protocol (`trahiv.protocol.WIRE_PROTOCOL`). hivemind's
    leader refuses a join request whose schema hash differs from its own (BAD_SCHEMA_HASH), and a follower asks the
    next leader: peers of different versions, and plain hivemind peers (whose rounds return a difference where
    trahiv's return the aggregate), never share a group, where before they averaged together and each side misread
    the other's results. hivemind computes the hash in the averager's `__init__`, before the averager process starts,
    so the version is the one in force where the averager is built."""

    _versioned_schema_hash: bytes

    @property  # type: ignore[override]
    def schema_hash(self) -> bytes:
        return self._versioned_schema_hash

    @schema_hash.setter
    def schema_hash(self, schema_hash: bytes) -> None:
        self._versioned_schema_hash = versioned_schema_hash(schema_hash, protocol.WIRE_PROTOCOL)

    async def _get_current_state_from_host_process(self) -> Any:
        """The state this averager serves (`rpc_download_state`), its metadata stamped with the wire protocol: a
        downloader refuses a state without its own (`trahiv.averaging.robust.state_rejection_reason`). hivemind's host
        thread serializes the metadata (`_background_thread_fetch_current_state`), so it is stamped here, once for every
        trahiv averager whatever its `get_current_state`."""
        metadata, tensors, infos = await super()._get_current_state_from_host_process()
        loaded = self.serializer.loads(metadata)
        if isinstance(loaded, dict):  # (and how many tensors follow: see rpc_download_state)
            metadata = self.serializer.dumps({**loaded, "protocol": protocol.WIRE_PROTOCOL, "tensors": len(tensors)})
        return metadata, tensors, infos

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        """hivemind's, then an empty message that ends the state, then a wait for the downloader to close its end.
        hivemind's handler returned after its last part, its P2P closed the stream, and p2pd could drop the parts
        still on their way: the downloader saw the stream end early, a state cut short (1 of 400 downloads of 116
        tensors beside a busy core cut inside a tensor; one cut between two tensors looked whole, and a late peer of
        tests/test_optim8bit.py rejected 84 tensors of 116 and trained from its own weights). trahiv's downloader
        (CheckedStateDownload) closes its end on the empty message, and counts the tensors against the metadata's."""
        served = False
        async for message in super().rpc_download_state(request, context):  # type: ignore[misc]
            served = True
            yield message
        if served:
            yield averaging_pb2.DownloadData()
            await fixes.until_the_receiver_closes()


class EpochKeyedMatchmaking(VersionedSchema):
    """Rounds for different collaborative steps never meet: hivemind 1.1.12 matches every peer that looks for a group
    under one key, so a peer still at step k could join a group of peers already at step k+1 and average its step-k
    gradients into theirs (seen with transformers' run_clm.py and 2 peers: weights differed by 6e-3 after 8 steps).
    The owner sets `round_epoch` (the step of the next round) whenever it changes; the group bits of the matchmaking
    key then carry it (sent down the averager's pipe, so they land before any later step). hivemind would rewrite the
    bits after each group (its bucket scheme for large swarms): `trahiv.engine.fixes` keeps them."""

    _round_epoch: int | None = None

    @property
    def round_epoch(self) -> int | None:
        return self._round_epoch

    @round_epoch.setter
    def round_epoch(self, epoch: int | None) -> None:
        if epoch is not None and epoch != self._round_epoch:
            self.set_group_bits(epoch_group_bits(epoch), wait=False)
        self._round_epoch = epoch

    # --- a round's search keeps the key of its own step ------------------------------------------------------------
    # The owner sets the next step's bits as it moves on (SwarmOptimizer: at every local step), and hivemind's search
    # reads the key anew at each declaration, lookup and join request. In background mode step k's round may still be
    # looking for its group when the owner, training step k + 1, sets k + 1's bits: that search then went on under
    # step k + 1's key, where the others' search of step k could not find it (both looked for 30 s and stepped
    # alone: a background-mode test beside a busy core, 2026-11-28) and a search of step k + 1 could (a group of two
    # steps' gradients). Bits set now are for the rounds the owner starts from now on: each step takes the bits in
    # force when it was started (pipe order: `set_group_bits` before `step`) and its searches look under them alone
    # (`trahiv.engine.fixes.SEARCH_BITS`, fix 10's look_for_group); bits set during a search wait for its end.

    _requested_bits: str | None = None  # in the averager's process: the bits last set by the owner

    async def _set_group_bits(self, group_bits: str, future: MPFuture) -> None:
        self._requested_bits = group_bits
        if self._matchmaking.is_looking_for_group:  # the search under way keeps its step's key
            searching = self._matchmaking.group_key_manager.group_bits
            logger.debug(f"Group bits {group_bits} set during a search under {searching}: kept for the next rounds")
            if not future.done():
                future.set_result(None)
            return
        await super()._set_group_bits(group_bits, future)  # type: ignore[misc]

    async def _step(self, *, step: Any, future_for_init: Any) -> None:
        key = self._matchmaking.group_key_manager
        token = fixes.SEARCH_BITS.set(self._requested_bits or key.group_bits)  # (its child tasks see it too)
        try:
            await super()._step(step=step, future_for_init=future_for_init)  # type: ignore[misc]
        finally:
            fixes.SEARCH_BITS.reset(token)
            if self._requested_bits is not None and not self._matchmaking.is_looking_for_group:
                key.group_bits = self._requested_bits  # (what `get_group_bits` reads between searches)

    # --- a group assembles as soon as every expected peer joined it ----------------------------------------------
    # hivemind 1.1.12's leader (with no target_group_size, which would cap the group) assembles its group only when
    # the time it declared runs out: at least `matchmaking_time` after the round was scheduled, although every peer
    # of a small swarm joins within a fraction of a second. Every synchronous step then cost matchmaking_time (15 s
    # by default) on top of its compute. The owner (SwarmOptimizer) tells the averager which peers it expects in the
    # round (the trainers the progress tracker sees at this step); a leader whose followers include them all
    # assembles at once. Other peers may still join before that (an auxiliary peer); a peer that does not come
    # (gone, or not seen yet) costs the declared time, as before.

    _expected_peers: frozenset[bytes] = frozenset()  # in the owner's process: what was last sent
    _expected_here: frozenset[PeerID] = frozenset()  # in the averager's process

    def expect_peers(self, peers: Iterable[bytes]) -> None:
        """The peer IDs (own included) expected in this averager's next group; fewer than two: none expected."""
        expected = frozenset(peers)
        expected = expected if len(expected) >= 2 else frozenset()
        if expected != self._expected_peers:
            self._expected_peers = expected
            self._outer_pipe.send(("_set_expected_peers", [], dict(peers=expected)))

    async def _set_expected_peers(self, peers: frozenset[bytes]) -> None:
        self._expected_here = frozenset(PeerID(peer) for peer in peers)
        matchmaking = getattr(self, "_matchmaking", None)
        if matchmaking is not None:
            async with matchmaking.lock_request_join_group:
                await self._assemble_if_all_expected(matchmaking)

    async def _assemble_if_all_expected(self, matchmaking: Any) -> None:
        """hivemind's "outcome 1" (Matchmaking.rpc_join_group assembles a full group), for a group that holds every
        expected peer. Called with the matchmaking's join lock held."""
        expected = self._expected_here
        if (
            expected
            and matchmaking.is_looking_for_group
            and not matchmaking.assembled_group.done()
            and matchmaking.current_leader is None
            and matchmaking.current_followers
            and expected <= {matchmaking.peer_id, *matchmaking.current_followers}
        ):
            logger.debug(f"All {len(expected)} expected peers joined: assembling the group now")
            await matchmaking.leader_assemble_group()

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        """hivemind's handler; once a follower is accepted, the group assembles if it now holds every expected peer.
        (Between the ACCEPTED message and the next one, hivemind's handler still holds the join lock.)"""
        async for response in super().rpc_join_group(request, context):
            yield response
            if response.code == averaging_pb2.ACCEPTED:
                await self._assemble_if_all_expected(self._matchmaking)


class OverlappedAccumulation(GradientAverager):
    """Adds a local step's gradients to the accumulators in a background thread, while the next batch computes.

    hivemind adds them inside `Optimizer.step()`: one pass over all gradients per local step (8M values: 5 ms on an
    idle core of this machine, 10 ms with 4 peers on its 2 cores; with `accumulate_grads_on` the CPU and gradients on
    a GPU, a blocking copy to the host as well), time in which nothing computes (benchmarks/compute_utilization.py:
    0.15 s of each 8 s collaborative step). A backward followed by `zero_grad(set_to_none=True)` (the Trainer's
    `model.zero_grad()`, torch's default) leaves each step's gradients in new tensors that nobody writes into again,
    so they can be read after `step()` returned. Gradients zeroed in place instead come back in the same tensors: a
    step whose gradients are any of the last step's tensors is added at once, as hivemind does (so are the first
    step's, before there is a last one). At most one addition is in flight: the next local step, anything reading
    the accumulators (a round loading them, a reset) and `SwarmOptimizer.zero_grad` wait for it first. The result is
    the same sum, bit for bit, in the same order."""

    _accumulators_used_in_step: bool  # (hivemind's)
    _anchor_batch_size: int | None
    _accumulation: Future | None = None
    _accumulating: ThreadPoolExecutor | None = None  # made in the trainer's process, after the averager's fork
    _last_grads: tuple[torch.Tensor, ...] = ()
    overlap_accumulation = True  # (False: added at once, as hivemind does)

    @torch.no_grad()
    def accumulate_grads_(self, batch_size: int) -> None:
        if self.reuse_grad_buffers:
            return super().accumulate_grads_(batch_size)
        grads = tuple(self._grads_from_parameters())
        released = (
            self.overlap_accumulation
            and len(grads) == len(self._last_grads)
            and all(new is not old for new, old in zip(grads, self._last_grads, strict=True))
        )
        self.finish_accumulation()
        self._last_grads = ()
        # adapted from hivemind.optim.grad_averager.GradientAverager.accumulate_grads_ (hivemind 1.1.12)
        if self._accumulators_used_in_step and self.warn:
            logger.warning("Gradient accumulators were not reset since the last averaging round")
            self._accumulators_used_in_step = False
        if self._anchor_batch_size is None:
            self._anchor_batch_size = batch_size
        self.local_samples_accumulated += batch_size
        self.local_times_accumulated += 1
        alpha = float(batch_size) / self._anchor_batch_size
        accumulators = tuple(self._accumulators_now())
        if released:
            if self._accumulating is None:
                self._accumulating = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trahiv-accumulate")
            self._accumulation = self._accumulating.submit(_add_all_, accumulators, grads, alpha)
        else:
            _add_all_(accumulators, grads, alpha)
        self._last_grads = grads  # (held only to compare identities; the thread holds them while it adds)

    def finish_accumulation(self) -> None:
        """Waits for the local step's gradients still being added (their error, if any, is raised here)."""
        pending = self._accumulation
        if pending is None:
            return
        try:
            pending.result()  # (a round may read the accumulators from hivemind's thread: both wait for it)
        finally:
            if self._accumulation is pending:
                self._accumulation = None

    def _accumulators_now(self) -> Iterator[torch.Tensor]:
        yield from GradientAverager._grad_accumulators(self)

    @torch.no_grad()
    def _grad_accumulators(self) -> Iterator[torch.Tensor]:
        self.finish_accumulation()
        yield from self._accumulators_now()

    def shutdown(self) -> None:
        try:
            self.finish_accumulation()
        except Exception as e:  # leaving goes on; the gradients of a step never averaged do not matter any more
            logger.debug(f"The last accumulation of gradients failed: {e!r}")
        if self._accumulating is not None:
            self._accumulating.shutdown(wait=True)
        super().shutdown()


@torch.no_grad()
def _add_all_(accumulators: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], alpha: float) -> None:
    for accumulator, grad in zip(accumulators, grads, strict=True):
        accumulator.add_(grad.to(accumulator.device), alpha=alpha)


class RobustGradientAverager(tell.TellsGroupmates, EpochKeyedMatchmaking, OverlappedAccumulation):
    """hivemind's GradientAverager whose all-reduce excludes garbage and aggregates with `aggregation`. Given the
    swarm's `progress_key`, each sender's weight (its accumulated samples) is clamped to what it reported there.

    A failed round falls back to this peer's own gradients. In hivemind 1.1.12 `step(reset_accumulators=True)` loads
    the accumulators into the averaged tensors and zeroes them before the all-reduce; when the round then fails,
    hivemind.Optimizer ("Proceeding with local gradients") loads the zeroed accumulators again, scaled by 1/0 -> 0.0,
    and the optimizer steps with zero gradients (two peers that could not reach each other trained 4 steps and their
    parameters never moved). Here the averaged tensors, which still hold this peer's gradients (or, after a round that
    broke midway, its gradients with the parts that were averaged), are kept instead."""

    def __init__(
        self,
        *args: Any,
        aggregation: Aggregation = MEAN,
        progress_key: str | None = None,
        target_batch_size: int | None = None,
        **kwargs: Any,
    ):
        self.aggregation = aggregation  # set before the averager process forks
        self.progress_key, self.target_batch_size = progress_key, target_batch_size
        self._holds_local_gradients = False  # the averaged tensors hold the gradients of the round just begun
        self._in_step = False
        tell.install()  # (in this process, where the steps' StepControls are made)
        super().__init__(*args, **kwargs)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        self._in_step = True
        try:
            return super().step(*args, **kwargs)
        finally:
            self._in_step = False

    def load_state_from_peers(self, wait: bool = True, timeout: float | None = None) -> None:
        """No download. hivemind.Optimizer.load_state_from_peers downloads a gradient averager's "state" (another
        peer's averaged gradients, as large as the model's gradients) after the parameters and drops the result (and
        then resets the accumulators). Under load that download once never finished (`test_byzantine.py`: a peer
        waited in it until the test ended; hivemind's timeout is load_state_timeout, 600 s)."""
        return None

    def reset_accumulated_grads_(self) -> None:
        super().reset_accumulated_grads_()
        self._holds_local_gradients = self._in_step  # zeroed by step(): the averaged tensors hold them now

    def load_accumulators_into_averager_(self) -> None:
        if self.local_times_accumulated == 0 and self._holds_local_gradients:
            return  # a failed round: the averaged tensors already hold this peer's gradients
        super().load_accumulators_into_averager_()

    async def _run_allreduce_inplace_(self, tensors: Sequence[torch.Tensor], group_info: Any, **kwargs: Any) -> None:
        """Every peer of the round ends with the same averaged gradients, bit for bit (trahiv.engine.exact): with
        hivemind's differences each peer rounded x_j + (a - x_j) its own way, and two peers' weights drifted apart in
        the last bits at every step (run_clm.py, 2 peers, 8 steps: 325-460 of 136,960 values, up to 3.7e-9)."""
        from trahiv.engine.exact import run_exact_allreduce_  # exact.py builds on this module

        await self.tell_groupmates(group_info)  # (trahiv.engine.tell: the others waiting at their shares begin now)
        caps = await self._weight_caps(group_info.peer_ids)
        await run_exact_allreduce_(self, tensors, group_info, weight_caps=caps, **kwargs)

    # --- weights are clamped to the samples each peer reported -------------------------------------------------
    # The owner (SwarmOptimizer) reads the swarm's progress records right before a step's round and hands them over
    # (`use_reported_progress`); a round of that step clamps with them. Looking them up in the DHT at the start of
    # the round put a lookup on its critical path: 10-140 ms a round over 100 Mbit/s links with 4 peers, longest for
    # the peers that started last (benchmarks/averaging_round.py --engines swarm). Without records for the round's
    # step (another caller, an aux peer), the round looks them up as before.

    def use_reported_progress(self, records: Any, epoch: int) -> None:
        """The swarm's progress records (the DHT's value of `progress_key`) as read for the round of step `epoch`."""
        self._outer_pipe.send(("_set_reported_progress", [], dict(records=records, bits=epoch_group_bits(epoch))))

    async def _set_reported_progress(self, records: Any, bits: str) -> None:
        self._reported_progress = (records, bits)

    async def _weight_caps(self, peers: Sequence[PeerID]) -> dict[PeerID, float] | None:
        if self.progress_key is None:
            return None
        group_bits = fixes.SEARCH_BITS.get() or self._matchmaking.group_key_manager.group_bits  # (this round's step)
        round_epoch = int(group_bits, 2) if len(group_bits) == EPOCH_KEY_BITS else None  # the step, modulo 2**16
        target = getattr(self, "target_batch_size", None)
        limits = dict(round_epoch=round_epoch, step_cap=None if target is None else WEIGHT_SLACK * target + 1)
        records, bits = getattr(self, "_reported_progress", (None, None))
        if bits is not None and bits == group_bits:  # read for this round's step
            return reported_sample_caps(records, peers, get_dht_time(), **limits)
        try:
            found = await asyncio.wait_for(
                self.dht.get(self.progress_key, latest=True, return_future=True),
                timeout=CAPS_FETCH_TIMEOUT_S,
            )
        except Exception as e:  # a slow DHT must not stall the round: it runs unclamped, and says so
            logger.warning(f"Could not read the swarm's progress to check averaging weights ({e!r})")
            return None
        return reported_sample_caps(found.value if found is not None else {}, peers, get_dht_time(), **limits)

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        # hivemind names RPCs after the class: keep hivemind's names so that subclasses and plain peers interoperate
        return GradientAverager._get_handle_name(namespace, method_name)


class CheckedStateDownload(VersionedSchema):
    """A state download (`load_state_from_peers`) that checks what each peer served before anyone loads it, and asks
    the next peer (by priority) when a state fails the checks: one broken or malicious peer cannot hand out NaN
    weights or a model of another shape. Subclasses say what to expect in `_expected_state_shapes`."""

    def _expected_state_shapes(self) -> list[tuple] | None:
        return None  # no expectation on shapes: only the generic checks

    def state_rejection(self, metadata: Any, tensors: Sequence[torch.Tensor]) -> str | None:
        """Why a downloaded state must not be loaded into this averager (None: it may be)."""
        return state_rejection_reason(metadata, tensors, self._expected_state_shapes())

    def load_state_from_peers(self, wait: bool = True, timeout: float | None = None) -> Any:
        if not wait:
            raise ValueError("trahiv's checked state download is synchronous: call it with wait=True")
        rejected: list[str] = []
        for _ in range(MAX_STATE_SOURCES):
            future: MPFuture = MPFuture()
            self._outer_pipe.send(("_load_state_from_peers", [], dict(timeout=timeout, future=future, skip=rejected)))
            loaded = future.result(timeout=timeout)
            if loaded is None:
                return None
            metadata, tensors, peer = loaded
            reason = self.state_rejection(metadata, tensors)
            if reason is None:
                return metadata, tensors
            logger.warning(f"Rejected the state served by peer {peer}: {reason}")
            rejected.append(peer)
        logger.warning(f"No usable state among the {len(rejected)} peers asked: keeping the local state")
        return None

    async def _load_state_from_peers(  # type: ignore[override]
        self, future: MPFuture, timeout: float | None = None, skip: Sequence[str] = ()
    ) -> None:
        """In the averager process: download the state of the highest-priority peer not in `skip`; the result is
        `(metadata, tensors, peer_id)` or None. Decoding goes through hivemind's tensor deserializer (no pickle)."""
        chunk_timeout = None if timeout is None else (self.next_chunk_timeout or self.request_timeout)
        try:
            key = f"{self._matchmaking.group_key_manager.prefix}.all_averagers"
            found = self.dht.get(key, latest=True)
            declared = found.value if found is not None and isinstance(found.value, dict) else {}
            priority = {
                PeerID(peer): (float(info.value), random.random())
                for peer, info in declared.items()
                if isinstance(info, ValueWithExpiration) and isinstance(info.value, float | int)
            }
            sources = [p for p in sorted(priority, key=priority.__getitem__, reverse=True)
                       if p != self.peer_id and str(p) not in skip]  # fmt: skip
            found = await first_download(sources, lambda peer: self._download_state_from(peer, chunk_timeout))
            if found is not None:
                state, peer = found
                future.set_result((*state, str(peer)))
        finally:
            if not future.done():
                future.set_result(None)

    async def _download_state_from(self, peer: PeerID, timeout: float | None) -> tuple[Any, list[torch.Tensor]] | None:
        """One peer's state, whole: a trahiv server ends it with an empty message (VersionedSchema.rpc_download_state),
        on which this end closes the stream, and says in the metadata how many tensors it sent; a stream that ended
        before (cut short) raises, and `first_download` asks again."""
        stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
        stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        metadata: Any = None
        tensors: list[torch.Tensor] = []
        parts: list[Any] = []
        ended = False
        try:
            async for message in aiter_with_timeout(stream, timeout=timeout):
                if not message.ByteSize():  # the end of the state
                    ended = True
                    break
                if message.metadata:
                    metadata = self.serializer.loads(message.metadata)
                if message.tensor_part.dtype and parts:  # a dtype marks the first chunk of the next tensor
                    tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                    parts = []
                parts.append(message.tensor_part)
        finally:
            await stream.aclose()  # (the server waits for it: rpc_download_state)
        if parts:
            tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
        if not metadata:
            return None
        announced = metadata.get("tensors") if isinstance(metadata, dict) else None
        if announced is not None and (not ended or announced != len(tensors)):  # (None: not a trahiv server)
            raise StateCutShort(f"the stream ended after {len(tensors)} of {announced!r} tensors")
        return metadata, tensors


class StateCutShort(ConnectionError):
    """A state download whose stream ended before the state did."""


async def first_download(
    sources: Sequence[PeerID], download: Callable[[PeerID], Awaitable[Any]], attempts: int = DOWNLOAD_ATTEMPTS
) -> tuple[Any, PeerID] | None:
    """The first state that a source (in order) serves, and that source; a source whose download failed (an error:
    a stream cut short, a timeout) is asked again after the others, up to `attempts` times in all. A joiner's only
    honest source once served a stream that ended two chunks into a tensor; with no other source, the joiner trained
    from its own initial weights (tests/test_faults.py, a clean checkout's run)."""
    pending = list(sources)
    for attempt in range(attempts):
        failed = []
        for peer in pending:
            try:
                state = await download(peer)
            except Exception as e:
                again = " (asking it again after the others)" if attempt + 1 < attempts else ""
                logger.warning(f"Failed to download the state from {peer}: {e!r}{again}")
                failed.append(peer)
                continue
            if state is not None:
                return state, peer
        pending = failed
    return None


class RobustTrainingStateAverager(EpochKeyedMatchmaking, TrainingStateAverager, CheckedStateDownload):
    """hivemind's TrainingStateAverager (parameters, optimizer statistics) whose all-reduce excludes garbage and whose
    state download is checked against this model's parameters and optimizer statistics."""

    def __init__(self, *args: Any, aggregation: Aggregation = MEAN, **kwargs: Any):
        self.aggregation = aggregation
        self._updates = threading.Condition()  # guards _updates_due; notified as an update ends
        self._updates_due = 0  # updates (optimizer step, parameter round) asked for by step() and not yet ended
        self.serve_wait: float | None = None  # seconds a state download waits for them (None: half a chunk's timeout)
        self._priority_held = False  # (see priority_held)
        super().__init__(*args, **kwargs)

    async def _run_allreduce_inplace_(self, tensors: Sequence[torch.Tensor], group_info: Any, **kwargs: Any) -> None:
        caps = {peer: 1.0 for peer in group_info.peer_ids}  # every peer weighs 1 in state averaging (hivemind's)
        await run_robust_allreduce_(self, self.aggregation, tensors, group_info, weight_caps=caps, **kwargs)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """hivemind's; counts the update it hands its executor (`_do`) until that update ends. hivemind moves the step
        (`local_epoch`) forward here, before the executor runs the optimizer step: a state served in between carried
        the new step's label with the old step's parameters (a joiner began step 6 with the server's step-5 weights
        in a clean-clone run of tests/test_faults.py)."""
        if not (kwargs.get("optimizer_step") or kwargs.get("zero_grad") or kwargs.get("averaging_round")):
            with fixes.changing_state():  # (applies a background update's results)
                return super().step(*args, **kwargs)
        with self._updates:
            self._updates_due += 1
        known = set(self.pending_updates)
        try:
            with fixes.changing_state():
                return super().step(*args, **kwargs)
        except BaseException:
            if not set(self.pending_updates) - known:  # raised before handing the update over: it never runs
                self._update_ended()
            raise

    def settled(self, timeout: float) -> bool:
        """No update (optimizer step, parameter round) under way within `timeout` seconds, and none that ended in the
        background waits to be applied to the model: parameters and optimizer statistics are of one step."""
        with self._updates:
            idle = self._updates.wait_for(lambda: self._updates_due == 0, timeout=timeout)
        return idle and not self.finished_optimizer_step.is_set() and not self.finished_averaging_round.is_set()

    def _set_state_sharing_priority(self, value: float) -> None:
        """hivemind's setter (it declares the value for download), ignored inside `priority_held()`. hivemind's
        Optimizer declares the new step as its transition begins (`Optimizer._update_global_epoch`), before a
        background update is applied; SwarmOptimizer holds the priority through the transition and declares the step
        itself once its update is applied (`_declare_once_applied`). Set back at once, the new step was still declared
        for a moment: the other peer read it (0.1 s after the transition), took the step's round for over while it
        still ran, left it and downloaded a state without the step's update (test_swarm.py's background test, run
        BC)."""
        if not self._priority_held:
            DecentralizedAverager.state_sharing_priority.fset(self, value)  # type: ignore[attr-defined]

    state_sharing_priority = property(
        DecentralizedAverager.state_sharing_priority.fget,  # type: ignore[attr-defined]
        _set_state_sharing_priority,
    )

    @contextlib.contextmanager
    def priority_held(self) -> Iterator[None]:
        """hivemind's writes of `state_sharing_priority` are ignored meanwhile (`_set_state_sharing_priority`)."""
        self._priority_held = True
        try:
            yield
        finally:
            self._priority_held = False

    def _do(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super()._do(*args, **kwargs)
        finally:
            self._update_ended()

    def _update_ended(self) -> None:
        with self._updates:
            self._updates_due = max(0, self._updates_due - 1)
            self._updates.notify_all()

    def get_current_state(self) -> tuple[Any, list[torch.Tensor], Any]:
        """hivemind's state for a peer that downloads it, as one snapshot of one step: once the updates under way
        have ended (the step's optimizer step, and its parameter round if that ends within `serve_wait`), while no
        other begins. hivemind 1.1.12 read the step, then handed the averager process the live parameter tensors
        themselves (`.cpu()` of a CPU tensor is the tensor; the pipe shares its memory), and they were read while being
        sent: a joiner got step k's label with step k+1's parameters whenever the server stepped meanwhile
        (tests/test_faults.py, once the steps got short). The tensors are copied while no optimizer step runs. (A
        parameter round longer than `serve_wait`, up to `averaging_timeout`, is not waited for: the joiner waits for
        the first chunk only so long; it then gets the step's parameters before that round.)"""
        wait = self.serve_wait
        if wait is None:
            wait = 0.5 * float(self.next_chunk_timeout or self.request_timeout)
        with self._updates:  # step() cannot begin another update while the state is read
            self._updates.wait_for(lambda: self._updates_due == 0, timeout=wait)
            with self.lock_optimizer:
                metadata, tensors, infos = super().get_current_state()
                return metadata, [tensor.detach().clone() for tensor in tensors], infos

    def _expected_state_shapes(self) -> list[tuple] | None:
        with torch.no_grad(), self.lock_averaged_tensors:
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            _, optimizer_tensors = dump_optimizer_state(self.optimizer)
            return [tuple(t.shape) for t in (*params, *self.extra_tensors, *optimizer_tensors)]

    def state_rejection(self, metadata: Any, tensors: Sequence[torch.Tensor]) -> str | None:
        """Also: the served optimizer state must fit this peer's optimizer, leaf for leaf (hivemind loads it by
        packing the served leaves into this optimizer's state_dict)."""
        reason = super().state_rejection(metadata, tensors)
        if reason is not None:
            return reason
        with self.lock_averaged_tensors:  # (the kinds as dump_optimizer_state tells them, without copying tensors)
            ours = ["tensor" if isinstance(leaf, torch.Tensor) else "value" for leaf in
                    nested_flatten(self.optimizer.state_dict())]  # fmt: skip
        optimizer_tensors = len(tensors) - len(self.main_parameters) - len(self.extra_tensors)
        return optimizer_state_mismatch(ours, metadata.get("optimizer_metadata"), optimizer_tensors)

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        return TrainingStateAverager._get_handle_name(namespace, method_name)


class RobustAuxiliaryStateAverager(EpochKeyedMatchmaking):
    """An auxiliary peer's side of the trainers' parameter rounds (`trahiv aux --average`): hivemind's averager in
    auxiliary mode under the trainers' state averager's name, with their robust all-reduce (every trainer weighs 1, as
    in RobustTrainingStateAverager). It holds no model and no optimizer: its tensors give the shapes of the trainers'
    averaged state (their parameters, when they average no optimizer statistics) and it sends none of its own."""

    def __init__(self, *args: Any, aggregation: Aggregation = MEAN, **kwargs: Any):
        self.aggregation = aggregation
        super().__init__(*args, **kwargs)

    async def _run_allreduce_inplace_(self, tensors: Sequence[torch.Tensor], group_info: Any, **kwargs: Any) -> None:
        caps = {peer: 1.0 for peer in group_info.peer_ids}
        await run_robust_allreduce_(self, self.aggregation, tensors, group_info, weight_caps=caps, **kwargs)

    def schedule_step(self, scheduled_time: float | None = None, **kwargs: Any) -> Any:
        """Look for a group now, to average at `scheduled_time` once `step(control=...)` triggers it (as
        GradientAverager.schedule_step)."""
        return super().step(scheduled_time=scheduled_time, wait=False, require_trigger=True, **kwargs)

    def step(self, control: Any = None, wait: bool = True, timeout: float | None = None, **kwargs: Any) -> Any:
        """Trigger a scheduled round (`control`), or run one now (DecentralizedAverager.step)."""
        if control is None:
            return super().step(wait=wait, timeout=timeout, **kwargs)
        control.allow_allreduce()
        return control.result(timeout) if wait else control

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        return TrainingStateAverager._get_handle_name(namespace, method_name)


class PartialRoundRunner(TrafficCountingRunner):
    """The robust runner that records which reducers failed this peer (`local_fallback`, by peer index) and counts
    the bytes it exchanges (trahiv.engine.traffic)."""

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
    The averager process writes a report into a pipe before its round's step completes, so the trainer finds it as
    soon as the step returns (`SwarmOptimizer` checks the gradient round's report right then) - while the pipe has
    room. A write to a full pipe blocks until this process reads: from the event loop, as before, a swarm hung, its
    trainers reading the state averager's reports only when logging (`logging_steps` 10**6): the pipe filled after
    ~170 parameter rounds, each averager process stopped in the middle of a round (its loop, and the averaged
    tensors' lock, held), and each trainer waited for that round or that lock (4 peers, step 880 of
    `benchmarks/diloco.py --steps 1200`'s synchronous run, 2026-11-26). Now a report that would block goes to a
    thread of the averager process that writes it (and every later one, in order) however long the reader takes.
    """

    runner_cls: type[PartialRoundRunner] = PartialRoundRunner  # tests inject faults through a subclass
    allreduce = "butterfly"  # or "ring": asked for at matchmaking, run where the whole group asks (engine.ring)
    aggregation: Aggregation
    deadlines: Deadlines | None
    reports: list[RoundReport]
    round_counts: dict[str, int]
    ring_rounds: int
    traffic: Traffic
    _report_reader: Any  # (multiprocessing Connections, one pipe: the averager process writes)
    _report_writer: Any
    _report_backlog: queue.SimpleQueue | None

    def _init_reporting(self, deadlines: Deadlines | None, aggregation: Aggregation = MEAN) -> None:
        self.aggregation, self.deadlines = aggregation, deadlines
        self.reports, self.round_counts = [], {"complete": 0, "partial": 0, "failed": 0}
        self.ring_rounds = 0  # of those, rounds run as a ring (trahiv.engine.ring)
        self._report_reader, self._report_writer = mp.get_context("fork").Pipe(duplex=False)
        self._report_backlog = None  # (made by the averager process if the pipe is ever full: see _send_report)
        self.traffic = Traffic()  # averaging_bytes_sent / averaging_bytes_received, counted in the averager process

    # --- leaving: the parts this peer reduces reach their senders first ------------------------------------------
    # A peer's own round ends once it holds every averaged part it asked for; the parts it reduces for the others may
    # still be on their way (its handler serves them until each sender closes the stream). hivemind 1.1.12's shutdown
    # stops the process at once, and p2pd resets those streams: a peer leaving on Ctrl+C right after a step left its
    # groupmate with a partial round for that step (its share of the values kept local, so the two peers' parameters
    # differ; tests/test_partial_rounds.py shows it). The averager process counts the handlers serving parts (and
    # a ring round's stream to the next peer, trahiv.engine.ring.SENDING); `_shutdown` waits for them, for at most
    # SERVE_BEFORE_SHUTDOWN_S.

    _serving = 0  # in the averager process: rpc_aggregate_part handlers still serving averaged parts

    async def rpc_aggregate_part(  # (hivemind reads the message types from these annotations)
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        self._serving += 1
        try:
            async for message in super().rpc_aggregate_part(stream, context):  # type: ignore[misc]
                yield message
        finally:
            self._serving -= 1

    async def _shutdown(self, timeout: float | None) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(SERVE_BEFORE_SHUTDOWN_S, timeout if timeout is not None else math.inf)
        from trahiv.engine.ring import SENDING  # (ring rounds' streams to the next peer, still finishing)

        while (self._serving > 0 or SENDING) and loop.time() < deadline:
            await asyncio.sleep(0.02)
        if self._serving > 0 or SENDING:
            logger.warning(f"Leaving with {self._serving + len(SENDING)} averaged part stream(s) still being served")
        await super()._shutdown(timeout)  # type: ignore[misc]

    def round_reports(self) -> list[RoundReport]:
        """Reports of rounds finished since the last call (in the process that created the averager)."""
        new = []
        while self._report_reader.poll():
            try:
                new.append(RoundReport(**pickle.loads(self._report_reader.recv_bytes())))
            except (EOFError, OSError):
                break
        for report in new:
            self.round_counts[report.status] += 1
            self.ring_rounds += report.allreduce == "ring"
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
            # a stalled peer costs a sender its reducer_timeout before the round ends partial: the round's deadline
            # must leave room for that, or a partial round (values kept) becomes a failed one
            timeout = max(self.deadlines.round_timeout(payload, group_size),
                          (kwargs.get("reducer_timeout") or 0.0) + self.deadlines.floor)  # fmt: skip
        if issubclass(self.runner_cls, TrafficCountingRunner):
            kwargs.setdefault("traffic", self.traffic)
        from trahiv.engine.ring import RingRoundRunner, ring_group  # ring.py builds on this module

        if issubclass(self.runner_cls, RingRoundRunner):
            averager: Any = self
            kwargs["ring"] = self.allreduce == "ring" and ring_group(averager.serializer, group_info.gathered)
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

    async def _step(self, *, step: Any, future_for_init: Any) -> None:
        """hivemind's step, in the averager process, and a `failed` report for a step that ended in an error before
        any all-reduce began (no group formed: hivemind 1.1.12 logs it and falls back to local values, and nothing
        counted it). A step cancelled by its owner (e.g. no other peer was left) is not a failure."""
        if self.allreduce == "ring":  # ask the group for a ring round (engine.ring: taken if every member asks)
            from trahiv.engine.ring import tag_for_ring

            averager: Any = self
            step._data_for_gather = tag_for_ring(averager.serializer, step.data_for_gather)
        trail, began = matchmaking_trail(), time.time()  # (what its search did: told if it goes wrong)
        started, reported = time.perf_counter(), [False]
        token, began_token = _ROUND_REPORTED.set(reported), _STEP_BEGAN.set(began)  # (seen by its child tasks too)
        running = asyncio.current_task()
        if running is not None:
            _RUNNING_STEPS.add(running)  # (see _RUNNING_STEPS: not collected while it runs)
        try:
            await super()._step(step=step, future_for_init=future_for_init)  # type: ignore[misc]
        finally:
            _RUNNING_STEPS.discard(running)  # type: ignore[arg-type]
            _ROUND_REPORTED.reset(token)
            _STEP_BEGAN.reset(began_token)
            error = step.exception() if step.done() and not step.cancelled() else None
            if error is not None and not reported[0]:
                seconds = time.perf_counter() - started
                why = f"no averaging group formed ({error!r})"
                report = RoundReport(peers=(), total_values=0, seconds=seconds, payload_bytes=0, error=why)
                logger.info(report.describe())
                trail.tell(began, "this search", only_if_asked=True)  # (a lone peer's search: nothing to tell)
                self._send_report(report)

    def _report_round(self, group_id: bytes, seconds: float, payload: int, error: BaseException | None) -> None:
        averager: Any = self
        future = averager._running_groups.get(group_id)
        if (
            future is None
            or not future.done()
            or future.cancelled()
            or not isinstance(future.result(), PartialRoundRunner)
        ):
            return  # the round failed before it started: `_step` reports that failure
        _ROUND_REPORTED.get([False])[0] = True  # (a default list when called outside `_step`)
        report = future.result().report(seconds, payload, error)
        if report.complete and self.deadlines is not None:
            self.deadlines.observe(payload, len(report.peers), seconds)
        (logger.debug if report.complete else logger.warning)(report.describe(), extra={"trail": True})  # (not kept)
        if not report.complete:
            matchmaking_trail().tell(_STEP_BEGAN.get(time.time() - seconds), "this round")
        self._send_report(report)

    def _send_report(self, report: RoundReport) -> None:
        """Send a report to the process that created the averager, never blocking the caller (the averager's event
        loop): written at once while the pipe has room for it (one write of at most PIPE_BUF bytes into a pipe with
        room does not block), else - and from then on, to keep the order - handed to a thread that writes it."""
        data = pickle.dumps(asdict(report))
        if self._report_backlog is None:
            if len(data) + 4 <= select.PIPE_BUF and _writable(self._report_writer):  # (4: the message's header)
                self._report_writer.send_bytes(data)
                return
            self._report_backlog = queue.SimpleQueue()
            threading.Thread(target=self._write_backlog, name="trahiv-round-reports", daemon=True).start()
        self._report_backlog.put(data)

    def _write_backlog(self) -> None:
        assert self._report_backlog is not None
        while True:
            self._report_writer.send_bytes(self._report_backlog.get())


def _writable(connection: Any) -> bool:
    """Whether a pipe has room for a write (a free buffer: at least PIPE_BUF bytes), without waiting."""
    poller = select.poll()
    poller.register(connection.fileno(), select.POLLOUT)
    return bool(poller.poll(0))


class RobustAverager(VersionedSchema):
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

    def __init__(
        self,
        *args: Any,
        deadlines: Deadlines | None = None,
        aggregation: Aggregation = MEAN,
        allreduce: str = "butterfly",
        **kwargs: Any,
    ):
        from trahiv.engine.ring import RingRoundRunner  # ring.py builds on this module

        if allreduce not in ("butterfly", "ring"):
            raise ValueError(f"allreduce must be 'butterfly' or 'ring', not {allreduce!r}")
        if allreduce == "ring" and aggregation.name != "mean":
            raise ValueError(f"a ring all-reduce sums as it goes: aggregation {aggregation.name!r} needs 'butterfly'")
        # rounds that hand every peer the same bits (RobustGradientAverager), as a ring where the group asks for it
        self.runner_cls, self.allreduce = RingRoundRunner, allreduce
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


class AuxiliaryStateAverager(ReportingMixin, RobustAuxiliaryStateAverager):
    """RobustAuxiliaryStateAverager with deadlines and round reports (the trainers' ReportingStateAverager's runner)."""

    def __init__(self, *args: Any, deadlines: Deadlines | None = None, aggregation: Aggregation = MEAN, **kwargs: Any):
        self._init_reporting(deadlines if deadlines is not None else Deadlines(), aggregation)
        super().__init__(*args, aggregation=aggregation, **kwargs)


class _RobustPowerSGD(VersionedSchema, PowerSGDGradientAverager):
    aggregation: Aggregation
    progress_key: str | None
    target_batch_size: int | None
    use_reported_progress = RobustGradientAverager.use_reported_progress
    _set_reported_progress = RobustGradientAverager._set_reported_progress
    _weight_caps = RobustGradientAverager._weight_caps

    async def _run_allreduce_inplace_(
        self, tensors: Sequence[torch.Tensor], group_info: Any, group_id: bytes | None = None, **kwargs: Any
    ) -> None:
        caps = await self._weight_caps(group_info.peer_ids)
        await run_robust_allreduce_(
            self, self.aggregation, tensors, group_info, group_id=group_id, weight_caps=caps, **kwargs
        )

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        return PowerSGDGradientAverager._get_handle_name(namespace, method_name)


class RobustPowerSGDGradientAverager(ReportingMixin, _RobustPowerSGD):
    """PowerSGD gradient averager of rank `averager_rank` on trahiv's robust reducer (mean only), with deadlines and
    round reports (each round is two all-reduce phases, each reported)."""

    def __del__(self) -> None:
        if hasattr(self, "_parent_pid"):  # a refused configuration never became a process
            super().__del__()

    def __init__(
        self,
        parameters: Iterable[torch.nn.Parameter],
        averager_rank: int,
        *,
        deadlines: Deadlines | None = None,
        aggregation: Aggregation = MEAN,
        progress_key: str | None = None,
        target_batch_size: int | None = None,
        **kwargs: Any,
    ):
        if aggregation.name != "mean":
            raise ValueError(
                f"PowerSGD cannot be combined with aggregation {aggregation.name!r}: it averages low-rank factors of "
                "the gradients, and a robust aggregate of the factors is not a robust aggregate of the gradients"
            )
        if averager_rank < 1:
            raise ValueError(f"PowerSGD needs averager_rank >= 1, got {averager_rank}")
        self.progress_key, self.target_batch_size = progress_key, target_batch_size
        self._init_reporting(deadlines if deadlines is not None else Deadlines(), aggregation)
        super().__init__(parameters, averager_rank, **kwargs)
