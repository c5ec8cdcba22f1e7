"""trahiv's averagers: hivemind 1.1.12's all-reduce, matchmaking and state download with trahiv's fixes.

Everything here subclasses hivemind internals (the reducer, the all-reduce runner, the averagers) and is the only place
that does; the policies stay engine-free: aggregation (CenteredClip, checks on parts) in `trahiv.averaging.robust`,
deadlines and round reports in `trahiv.averaging.partial`. Bodies adapted from hivemind say so, with the function
they came from (hivemind 1.1.12).

- `RobustTensorPartReducer` / `RobustAllReduceRunner`: every sender's copy of a part is buffered and aggregated once all
  arrived (garbage excluded, weights clamped); streams end on the sender's side (see `_exchange_with_reducer`).
- `PartialRoundRunner` / `ReportingMixin`: partial rounds detected and reported, payload-based deadlines, rounds without
  a group counted as failed.
- `RobustGradientAverager`: a failed round falls back to this peer's gradients (hivemind's fallback was zeros).
- `EpochKeyedMatchmaking`: rounds of different collaborative steps never meet.
- `CheckedStateDownload` / `RobustTrainingStateAverager`: downloaded states are checked before anyone loads them.
- `RobustPowerSGDGradientAverager`: hivemind's PowerSGD on the robust reducer.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
import multiprocessing as mp
import queue
import random
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import asdict
from typing import Any

import torch
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.averager import DecentralizedAverager
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartReducer
from hivemind.compression import deserialize_torch_tensor
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.power_sgd_averager import PowerSGDGradientAverager
from hivemind.optim.state_averager import TrainingStateAverager, dump_optimizer_state
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import aiter_with_timeout, amap_in_executor, as_aiter, attach_event_on_finished, azip
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.streaming import combine_from_streaming
from hivemind.utils.timed_storage import ValueWithExpiration, get_dht_time

from trahiv.averaging.partial import Deadlines, RoundReport, compressed_sizes
from trahiv.averaging.robust import (
    MEAN,
    Aggregation,
    aggregate,
    rejection_reason,
    reported_sample_caps,
    state_rejection_reason,
)
from trahiv.engine import fixes
from trahiv.engine.fixes import EPOCH_KEY_BITS

fixes.apply()  # the engine's fixes hold wherever its averagers run
logger = logging.getLogger("trahiv.averaging")
_ROUND_REPORTED: contextvars.ContextVar[list[bool]] = contextvars.ContextVar("trahiv_round_reported")
CAPS_FETCH_TIMEOUT_S = 2.0
MAX_STATE_SOURCES = 8  # peers asked for their state, one after the other, before keeping the local state

__all__ = [
    "CheckedStateDownload",
    "EpochKeyedMatchmaking",
    "NoUsablePartError",
    "PartialRoundRunner",
    "ReportingAverager",
    "ReportingGradientAverager",
    "ReportingMixin",
    "ReportingStateAverager",
    "RobustAllReduceRunner",
    "RobustAverager",
    "RobustGradientAverager",
    "RobustPowerSGDGradientAverager",
    "RobustTensorPartReducer",
    "RobustTrainingStateAverager",
    "epoch_group_bits",
    "run_robust_allreduce_",
]


class NoUsablePartError(AllreduceException):
    """Every copy of a part was excluded: its senders keep their local values for it."""


# --- aggregation of one part ----------------------------------------------------------------------------------------


class RobustTensorPartReducer(TensorPartReducer):
    """hivemind's reducer, but it buffers every sender's copy of the current part, excludes unusable copies and
    aggregates with `aggregation` once all expected copies arrived. `sender_names` (peer IDs) are used in logs."""

    current_part_index: int
    current_part_accumulated_from: int
    num_current_senders: int
    current_part_future: asyncio.Future

    def __init__(
        self,
        part_shapes: Sequence[torch.Size],
        num_senders: int,
        *,
        aggregation: Aggregation = MEAN,
        sender_names: Sequence[str] | None = None,
        weight_caps: Sequence[float] | None = None,
    ):
        self.aggregation = aggregation
        self.sender_names = list(sender_names) if sender_names is not None else [str(i) for i in range(num_senders)]
        self.weight_caps = list(weight_caps) if weight_caps is not None else [math.inf] * num_senders
        self.clamped_senders: set[int] = set()
        self.received: list[tuple[torch.Tensor, float]] = []  # usable copies of the current part
        self.excluded_senders: dict[int, str] = {}  # sender index -> why its copies were excluded (this round)
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self) -> None:
        """Move on to the next part (hivemind's, without allocating a sum: copies are buffered in self.received)."""
        assert self.current_part_accumulated_from == self.num_current_senders or self.current_part_index == -1
        self.received = []
        if self.current_part_index >= self.num_parts - 1:
            self.finalize()
            return
        self.current_part_index += 1
        self.current_part_accumulated_from = 0
        self.current_part_future = asyncio.Future()
        self.num_current_senders = sum(self.current_part_index < failed for failed in self.sender_failed_after)
        self.accumulator = None

    async def accumulate_part(
        self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0
    ) -> torch.Tensor:
        """Buffer this copy of the part, wait for all other copies, then return the aggregate."""
        assert 0 <= sender_index < self.num_senders, "invalid sender index"
        assert 0 <= part_index < self.num_parts, "invalid part index"
        self.num_parts_received[sender_index] += 1
        while part_index > self.current_part_index:  # wait for previous parts to finish processing
            await asyncio.wait(
                {self.current_part_future, asyncio.create_task(self.finished.wait())},
                return_when=asyncio.FIRST_COMPLETED,
            )
            if self.finished.is_set():
                raise AllreduceException(f"attempted to aggregate part in a finalized {self.__class__.__name__}")
        if self.sender_failed_after[sender_index] != float("inf"):
            raise BannedException(f"sender {sender_index} was banned in background")
        assert part_index == self.current_part_index
        current_part_future = self.current_part_future
        if part_index < self.sender_failed_after[sender_index]:
            self._receive(sender_index, tensor_part, weight)
            self.current_part_accumulated_from += 1
            self.check_current_part_finished()
        return await current_part_future

    def _receive(self, sender_index: int, part: torch.Tensor, weight: float) -> None:
        reason = rejection_reason(part, weight, self.part_shapes[self.current_part_index])
        cap = self.weight_caps[sender_index]
        if reason is None and weight > cap:
            if sender_index not in self.clamped_senders:
                self.clamped_senders.add(sender_index)
                logger.warning(
                    f"Clamping the weight of peer {self.sender_names[sender_index]} from {weight:g} to {cap:g}: "
                    "more than the samples it reported"
                )
            weight = cap
        if reason is None:
            self.received.append((part, float(weight)))
        elif sender_index not in self.excluded_senders:
            self.excluded_senders[sender_index] = reason
            logger.warning(
                f"Excluding peer {self.sender_names[sender_index]} from this averaging round: it sent {reason} "
                f"(part {self.current_part_index})"
            )

    def check_current_part_finished(self) -> None:
        assert self.current_part_accumulated_from <= self.num_current_senders
        if self.current_part_accumulated_from == self.num_current_senders:
            self._resolve_current_part()
            self.reset_accumulators()

    def _resolve_current_part(self) -> None:
        usable = [(part, weight) for part, weight in self.received if weight > 0]
        if usable:
            parts, weights = [part for part, _ in usable], [weight for _, weight in usable]
            self.current_part_future.set_result(aggregate(parts, weights, self.aggregation))
        elif self.current_part_accumulated_from == 0:  # nobody waits for it (every sender failed)
            self.current_part_future.set_result(torch.zeros(self.part_shapes[self.current_part_index]))
        else:
            self.current_part_future.set_exception(
                NoUsablePartError(f"no usable copy of part {self.current_part_index}: senders keep their own values")
            )


def _retire(reducer: TensorPartReducer) -> None:
    """Retire a reducer that was never used (it must not warn about parts it never received)."""
    reducer.current_part_future.cancel()
    reducer.finished.set()


# --- the all-reduce runner and the averagers --------------------------------------------------------------------------


class RobustAllReduceRunner(AllReduceRunner):
    """hivemind's all-reduce runner with a RobustTensorPartReducer for the part this peer reduces."""

    def __init__(
        self, *, aggregation: Aggregation = MEAN, weight_caps: dict[PeerID, float] | None = None, **kwargs: Any
    ):
        super().__init__(**kwargs)
        _retire(self.tensor_part_reducer)
        caps = weight_caps or {}
        self.tensor_part_reducer: TensorPartReducer = RobustTensorPartReducer(
            tuple(part.shape for part in self.parts_for_local_averaging),
            len(self.sender_peer_ids),
            aggregation=aggregation,
            sender_names=[peer.to_base58() for peer in self.sender_peer_ids],
            weight_caps=[caps.get(peer, math.inf) for peer in self.sender_peer_ids],
        )

    async def _communicate_with_peer(self, peer_id: Any) -> None:
        if peer_id != self.peer_id:
            return await self._exchange_with_reducer(peer_id)
        peer_index = self.ordered_peer_ids.index(peer_id)
        sender_index = self.sender_peer_ids.index(peer_id)
        for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
            try:
                averaged_part = await self.tensor_part_reducer.accumulate_part(
                    sender_index, part_index, tensor_part, weight=self.weight
                )
                delta = averaged_part - tensor_part
            except NoUsablePartError:
                delta = torch.zeros_like(tensor_part)  # keep the local values of a part nobody could aggregate
            self.tensor_part_container.register_processed_part(peer_index, part_index, delta)

    async def _exchange_with_reducer(self, peer_id: Any) -> None:
        """Send our copy of the part `peer_id` reduces, receive the aggregate; then close the stream ourselves.

        hivemind 1.1.12 reads until the reducer closes the stream. But when a reducer's handler returns, the stream
        is reset (p2pd logs "stream reset" some 50 ms later), and on a busy CPU the parts still in flight were lost:
        this peer got only k of n parts, without an error, and the round was partial (2 rounds in 400 between two
        processes beside 3 busy ones, benchmarks/stream_end.py; 0 in 400 with this). Here the
        receiving side, which knows how many parts to expect, closes the stream once it has them all; the reducer
        (`rpc_aggregate_part` below) waits for that.
        """
        peer_index = self.ordered_peer_ids.index(peer_id)
        expected = self.tensor_part_container.num_parts_by_peer[peer_index]
        received = 0

        def deserialize(message: averaging_pb2.AveragingData) -> torch.Tensor:
            if message.code != averaging_pb2.AVERAGED_PART:
                raise AllreduceException(f"{peer_id} sent {averaging_pb2.MessageCode.Name(message.code)}")
            return deserialize_torch_tensor(message.tensor_part)

        try:
            done_sending = asyncio.Event()
            inputs = attach_event_on_finished(self._generate_input_for_peer(peer_index), done_sending)
            stream = await self._get_peer_stub(peer_id).rpc_aggregate_part(inputs)
            if self.should_delay_results(self.peer_id):
                await done_sending.wait()
            results = amap_in_executor(
                deserialize,
                aiter_with_timeout(stream, self.reducer_timeout),
                max_prefetch=self.tensor_part_container.prefetch,
            )
            try:
                async for delta in results:
                    self.tensor_part_container.register_processed_part(peer_index, received, delta)
                    received += 1
                    if received == expected:
                        break
            finally:
                await results.aclose()
                await stream.aclose()  # closes our end: the reducer's handler ends when it sees it
            if received != expected:
                raise AllreduceException(f"peer {peer_id} sent {received} parts, but we expected {expected}")
        except BaseException as e:
            if isinstance(e, Exception):
                logger.debug(f"Caught {e!r} when communicating to {peer_id}", exc_info=True)
            self.tensor_part_container.register_failed_reducer(peer_index)
            raise

    async def rpc_aggregate_part(self, stream: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        """hivemind's handler, then: wait for the sender to close the stream (it does once it has every part, see
        `_exchange_with_reducer`) rather than return, which would let p2pd reset the stream under the sender's
        unread parts. The wait is bounded (a sender that never closes costs it reducer_timeout, 10 s by default)."""
        async for message in super().rpc_aggregate_part(stream, context):
            yield message
        await asyncio.sleep(self.reducer_timeout or 10.0)  # cancelled as soon as the sender closes the stream


async def run_robust_allreduce_(
    averager: Any,
    aggregation: Aggregation,
    tensors: Sequence[torch.Tensor],
    group_info: Any,
    group_id: bytes | None = None,
    runner_cls: type[RobustAllReduceRunner] | None = None,
    **kwargs: Any,
) -> None:
    """hivemind's DecentralizedAverager._run_allreduce_inplace_ with a RobustAllReduceRunner (or `runner_cls`), and
    the group's averaging modes (hivemind 1.1.12 reads them from the group, then does not pass them on: an auxiliary
    peer then runs as a sender of zeros, weight 0, and receives the averaged values)."""
    group_id = group_info.group_id if group_id is None else group_id
    kwargs.setdefault("modes", group_modes(averager, group_info))
    runner = (runner_cls or RobustAllReduceRunner)(
        aggregation=aggregation,
        p2p=averager._p2p,
        servicer_type=type(averager),
        prefix=averager.prefix,
        tensors=tensors,
        group_id=group_id,
        ordered_peer_ids=group_info.peer_ids,
        **kwargs,
    )
    assert group_id in averager._running_groups, f"group {group_id!r} was not registered"
    averager._running_groups[group_id].set_result(runner)
    if runner.modes[group_info.peer_ids.index(averager.peer_id)] == AveragingMode.AUX:
        async for _ in runner:
            raise ValueError("aux peers should not receive averaged tensors")
        return
    updates: AsyncIterator = azip(as_aiter(*tensors), runner)
    async for tensor, update in updates:
        tensor.add_(update, alpha=averager._averaging_alpha)
        averager.last_updated = get_dht_time()
        averager._state_updated.set()


def group_modes(averager: Any, group_info: Any) -> tuple[AveragingMode, ...]:
    """Each group member's averaging mode (node, client, auxiliary), from the data gathered at matchmaking."""
    return tuple(AveragingMode(averager.serializer.loads(data)[1]) for data in group_info.gathered)


def epoch_group_bits(epoch: int) -> str:
    """hivemind's group bits that key matchmaking by collaborative step (see EpochKeyedMatchmaking)."""
    return format(epoch % 2**EPOCH_KEY_BITS, f"0{EPOCH_KEY_BITS}b")


class EpochKeyedMatchmaking(DecentralizedAverager):
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


class RobustGradientAverager(EpochKeyedMatchmaking, GradientAverager):
    """hivemind's GradientAverager whose all-reduce excludes garbage and aggregates with `aggregation`. Given the
    swarm's `progress_key`, each sender's weight (its accumulated samples) is clamped to what it reported there.

    A failed round falls back to this peer's own gradients. In hivemind 1.1.12 `step(reset_accumulators=True)` loads
    the accumulators into the averaged tensors and zeroes them before the all-reduce; when the round then fails,
    hivemind.Optimizer ("Proceeding with local gradients") loads the zeroed accumulators again, scaled by 1/0 -> 0.0,
    and the optimizer steps with zero gradients (two peers that could not reach each other trained 4 steps and their
    parameters never moved). Here the averaged tensors, which still hold this peer's gradients (or, after a round that
    broke midway, its gradients with the parts that were averaged), are kept instead."""

    def __init__(self, *args: Any, aggregation: Aggregation = MEAN, progress_key: str | None = None, **kwargs: Any):
        self.aggregation = aggregation  # set before the averager process forks
        self.progress_key = progress_key
        self._holds_local_gradients = False  # the averaged tensors hold the gradients of the round just begun
        self._in_step = False
        super().__init__(*args, **kwargs)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        self._in_step = True
        try:
            return super().step(*args, **kwargs)
        finally:
            self._in_step = False

    def reset_accumulated_grads_(self) -> None:
        super().reset_accumulated_grads_()
        self._holds_local_gradients = self._in_step  # zeroed by step(): the averaged tensors hold them now

    def load_accumulators_into_averager_(self) -> None:
        if self.local_times_accumulated == 0 and self._holds_local_gradients:
            return  # a failed round: the averaged tensors already hold this peer's gradients
        super().load_accumulators_into_averager_()

    async def _run_allreduce_inplace_(self, tensors: Sequence[torch.Tensor], group_info: Any, **kwargs: Any) -> None:
        caps = await self._weight_caps(group_info.peer_ids)
        await run_robust_allreduce_(self, self.aggregation, tensors, group_info, weight_caps=caps, **kwargs)

    async def _weight_caps(self, peers: Sequence[PeerID]) -> dict[PeerID, float] | None:
        if self.progress_key is None:
            return None
        try:
            found = await asyncio.wait_for(
                self.dht.get(self.progress_key, latest=True, return_future=True),
                timeout=CAPS_FETCH_TIMEOUT_S,
            )
        except Exception as e:  # a slow DHT must not stall the round: it runs unclamped, and says so
            logger.warning(f"Could not read the swarm's progress to check averaging weights ({e!r})")
            return None
        return reported_sample_caps(found.value if found is not None else {}, peers, get_dht_time())

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        # hivemind names RPCs after the class: keep hivemind's names so that subclasses and plain peers interoperate
        return GradientAverager._get_handle_name(namespace, method_name)


class CheckedStateDownload(DecentralizedAverager):
    """A state download (`load_state_from_peers`) that checks what each peer served before anyone loads it, and asks
    the next peer (by priority) when a state fails the checks: one broken or malicious peer cannot hand out NaN
    weights or a model of another shape. Subclasses say what to expect in `_expected_state_shapes`."""

    def _expected_state_shapes(self) -> list[tuple] | None:
        return None  # no expectation on shapes: only the generic checks

    def load_state_from_peers(self, wait: bool = True, timeout: float | None = None) -> Any:
        if not wait:
            raise ValueError("trahiv's checked state download is synchronous: call it with wait=True")
        expected = self._expected_state_shapes()
        rejected: list[str] = []
        for _ in range(MAX_STATE_SOURCES):
            future: MPFuture = MPFuture()
            self._outer_pipe.send(("_load_state_from_peers", [], dict(timeout=timeout, future=future, skip=rejected)))
            loaded = future.result(timeout=timeout)
            if loaded is None:
                return None
            metadata, tensors, peer = loaded
            reason = state_rejection_reason(metadata, tensors, expected)
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
            for peer in sorted(priority, key=priority.__getitem__, reverse=True):
                if peer == self.peer_id or str(peer) in skip:
                    continue
                try:
                    state = await self._download_state_from(peer, chunk_timeout)
                except Exception as e:
                    logger.warning(f"Failed to download the state from {peer}: {e!r}")
                    continue
                if state is not None:
                    future.set_result((*state, str(peer)))
                    return
        finally:
            if not future.done():
                future.set_result(None)

    async def _download_state_from(self, peer: PeerID, timeout: float | None) -> tuple[Any, list[torch.Tensor]] | None:
        stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
        stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        metadata: Any = None
        tensors: list[torch.Tensor] = []
        parts: list[Any] = []
        async for message in aiter_with_timeout(stream, timeout=timeout):
            if message.metadata:
                metadata = self.serializer.loads(message.metadata)
            if message.tensor_part.dtype and parts:  # a dtype marks the first chunk of the next tensor
                tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                parts = []
            parts.append(message.tensor_part)
        if parts:
            tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
        return (metadata, tensors) if metadata else None


class RobustTrainingStateAverager(EpochKeyedMatchmaking, TrainingStateAverager, CheckedStateDownload):
    """hivemind's TrainingStateAverager (parameters, optimizer statistics) whose all-reduce excludes garbage and whose
    state download is checked against this model's parameters and optimizer statistics."""

    def __init__(self, *args: Any, aggregation: Aggregation = MEAN, **kwargs: Any):
        self.aggregation = aggregation
        super().__init__(*args, **kwargs)

    async def _run_allreduce_inplace_(self, tensors: Sequence[torch.Tensor], group_info: Any, **kwargs: Any) -> None:
        caps = {peer: 1.0 for peer in group_info.peer_ids}  # every peer weighs 1 in state averaging (hivemind's)
        await run_robust_allreduce_(self, self.aggregation, tensors, group_info, weight_caps=caps, **kwargs)

    def _expected_state_shapes(self) -> list[tuple] | None:
        with torch.no_grad(), self.lock_averaged_tensors:
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            _, optimizer_tensors = dump_optimizer_state(self.optimizer)
            return [tuple(t.shape) for t in (*params, *self.extra_tensors, *optimizer_tensors)]

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        return TrainingStateAverager._get_handle_name(namespace, method_name)


class PartialRoundRunner(RobustAllReduceRunner):
    """The robust runner that records which reducers failed this peer (`local_fallback`, by peer index)."""

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
    _report_queue: Any

    def _init_reporting(self, deadlines: Deadlines | None, aggregation: Aggregation = MEAN) -> None:
        self.aggregation, self.deadlines = aggregation, deadlines
        self.reports, self.round_counts = [], {"complete": 0, "partial": 0, "failed": 0}
        self._report_queue = mp.get_context("fork").SimpleQueue()

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
        started, reported = time.perf_counter(), [False]
        token = _ROUND_REPORTED.set(reported)  # child tasks share the list: _report_round marks it
        try:
            await super()._step(step=step, future_for_init=future_for_init)  # type: ignore[misc]
        finally:
            _ROUND_REPORTED.reset(token)
            error = step.exception() if step.done() and not step.cancelled() else None
            if error is not None and not reported[0]:
                seconds = time.perf_counter() - started
                why = f"no averaging group formed ({error!r})"
                report = RoundReport(peers=(), total_values=0, seconds=seconds, payload_bytes=0, error=why)
                logger.info(report.describe())
                self._report_queue.put(asdict(report))

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


class _RobustPowerSGD(PowerSGDGradientAverager):
    aggregation: Aggregation
    progress_key: str | None
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
        **kwargs: Any,
    ):
        if aggregation.name != "mean":
            raise ValueError(
                f"PowerSGD cannot be combined with aggregation {aggregation.name!r}: it averages low-rank factors of "
                "the gradients, and a robust aggregate of the factors is not a robust aggregate of the gradients"
            )
        if averager_rank < 1:
            raise ValueError(f"PowerSGD needs averager_rank >= 1, got {averager_rank}")
        self.progress_key = progress_key
        self._init_reporting(deadlines if deadlines is not None else Deadlines(), aggregation)
        super().__init__(parameters, averager_rank, **kwargs)
