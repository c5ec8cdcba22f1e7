"""hivemind 1.1.12's butterfly all-reduce with trahiv's reducer and stream ends: `RobustTensorPartReducer` buffers every
sender's copy of a part and aggregates once all arrived (garbage excluded, weights clamped, `trahiv.averaging.robust`
decides); `RobustAllReduceRunner` runs it, and its senders close each stream once they have every part;
`run_robust_allreduce_` is `DecentralizedAverager._run_allreduce_inplace_` with that runner and the group's modes,
without redeclaring the averager's state in the DHT after every tensor."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Sequence
from typing import Any

import torch
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartReducer
from hivemind.compression import deserialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import aiter_with_timeout, amap_in_executor, as_aiter, attach_event_on_finished, azip
from hivemind.utils.timed_storage import get_dht_time

from trahiv.averaging.robust import MEAN, Aggregation, aggregate, rejection_reason
from trahiv.engine import fixes

fixes.apply()  # the engine's fixes hold wherever its all-reduce runs
logger = logging.getLogger("trahiv.averaging")

__all__ = [
    "NoUsablePartError",
    "RobustAllReduceRunner",
    "RobustTensorPartReducer",
    "group_modes",
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

        async def parts_to_send() -> AsyncIterator[averaging_pb2.AveragingData]:
            # hivemind writes them from a task of its own whose failure nobody sees until the exchange ends (the
            # reducer, missing parts, bans this peer at its deadline): say so as it happens
            sent = 0
            try:
                async for message in self._generate_input_for_peer(peer_index):
                    yield message
                    sent += 1
            except Exception as e:
                logger.warning(f"Sending parts to {peer_id} failed after {sent} of {expected}: {e!r}")
                raise

        try:
            done_sending = asyncio.Event()
            inputs = attach_event_on_finished(parts_to_send(), done_sending)
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
    # (hivemind also sets `_state_updated` after every tensor: each wakes the state-sharing loop, which stores the
    # unchanged priority in the DHT again: 128 stores a round for 128 tensors, 3,930 DHT messages in one parameter
    # round of 4 peers, over the links the round itself needs. A new priority is declared by its setter.)


def group_modes(averager: Any, group_info: Any) -> tuple[AveragingMode, ...]:
    """Each group member's averaging mode (node, client, auxiliary), from the data gathered at matchmaking."""
    return tuple(AveragingMode(averager.serializer.loads(data)[1]) for data in group_info.gathered)
