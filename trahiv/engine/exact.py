"""An all-reduce after which every peer holds the same bits (DiLoCo's pseudo-gradients, the gradient rounds).

hivemind 1.1.12's reducer returns to each sender the *difference* between the aggregate and that sender's part,
compressed, and the sender adds it to its part: x_j + Q(a - x_j). That is a - x_j + x_j rounded, so peers end with
values that differ in the last bits (measured: 23 of 28 GPT-2 tensors differed after each DiLoCo sync, without
compression; with a lossy compression by the compression error of a - x_j). DiLoCo's outer parameters would drift
apart sync after sync, as each peer applies its own copy of the average; so did the synchronous mode's parameters,
step after step, by the last bits of the averaged gradients each peer applied. Parameter rounds keep hivemind's
differences (Q(a) of a lossy compression would round the parameters themselves): after rounds that failed, and in
which each peer stepped alone, they bring the peers back together within the last bits, not bit for bit.

Here the reducer returns the aggregate itself, Q(a), compressed as the sender's part was; the reducer's own part goes
through the same compression round trip; and each peer *replaces* its values with the result. Every peer decodes the
same message, so every peer holds Q(a), bit for bit. Values whose reducer failed keep their local values (hivemind's
fallback), and the round is reported as partial, as every trahiv round is (trahiv.averaging.partial).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import Any

import torch
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.partition import AllreduceException, BannedException
from hivemind.compression import CompressionBase, CompressionInfo, deserialize_torch_tensor, serialize_torch_tensor
from hivemind.compression.adaptive import AdaptiveCompressionBase
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import amap_in_executor
from hivemind.utils.timed_storage import get_dht_time

from trahiv.averaging.partial import RoundReport
from trahiv.compression import FloatsOnly
from trahiv.engine.allreduce import NoUsablePartError, group_modes
from trahiv.engine.averagers import PartialRoundRunner, RobustAverager

__all__ = ["ExactAverager", "ExactRoundRunner", "compression_type", "run_exact_allreduce_"]


def compression_type(compression: CompressionBase, info: CompressionInfo) -> int | None:
    """The wire codec (`runtime_pb2.CompressionType`) `compression` uses for a tensor described by `info`, without
    encoding it; None for a codec that does not say."""
    if isinstance(compression, FloatsOnly):
        return compression_type(compression._codec(info.descriptor.dtype), info)
    if isinstance(compression, AdaptiveCompressionBase):
        return compression_type(compression.choose_compression(info), info)
    kind = getattr(compression, "compression_type", None)
    return int(kind) if kind is not None else None


class ExactRoundRunner(PartialRoundRunner):
    """A round whose outputs are the aggregates themselves (as every peer decodes them), not differences.

    A part left unaveraged (its reducer failed this peer, or nobody could aggregate it) keeps its local values, or,
    with `unaveraged_zero`, becomes zeros: the same on every peer that missed it (DiLoCo's pseudo-gradients, see
    trahiv.engine.diloco)."""

    unaveraged_zero = False

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        # hivemind's container registers a failed reducer's parts as zeros when it returns deltas, else as the local
        # values; the exact round replaces each tensor with its results, so zeros stay zeros
        self.tensor_part_container.return_deltas = self.unaveraged_zero
        self._results: dict[tuple[int, int], asyncio.Future] = {}

    def report(self, seconds: float, payload: int, error: BaseException | None) -> RoundReport:
        report = super().report(seconds, payload, error)
        return dataclasses.replace(report, unaveraged="set to zero") if self.unaveraged_zero else report

    def _result(self, part_index: int, averaged: torch.Tensor, compression: int) -> asyncio.Future:
        """Q(aggregate) of a part, serialized once per compression for every sender that asks (and for this peer):
        hivemind serialized a difference for each sender, and the aggregate is the same for all. With 4 peers a
        reducer encoded its share 3 times. The serialized parts stay until the round ends (at most this peer's share
        of the payload)."""
        key = (part_index, compression)
        if key not in self._results:
            loop = asyncio.get_running_loop()
            self._results[key] = loop.run_in_executor(None, serialize_torch_tensor, averaged, compression)
        return self._results[key]

    async def _communicate_with_peer(self, peer_id: Any) -> None:
        if peer_id != self.peer_id:
            return await super()._communicate_with_peer(peer_id)
        container = self.tensor_part_container
        peer_index = self.ordered_peer_ids.index(peer_id)
        sender_index = self.sender_peer_ids.index(peer_id)
        own_parts = container._input_parts_by_peer[peer_index]
        for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
            try:
                averaged = await self.tensor_part_reducer.accumulate_part(
                    sender_index, part_index, tensor_part, weight=self.weight
                )
                info = own_parts[part_index][1]
                kind = compression_type(container.compression, info)  # what the others send
                if kind is None:  # a codec that does not say: find out by encoding this part
                    kind = container.compression.compress(tensor_part, info).compression
                result = deserialize_torch_tensor(await self._result(part_index, averaged, kind))
            except NoUsablePartError:  # a part nobody could aggregate
                result = torch.zeros_like(tensor_part) if self.unaveraged_zero else tensor_part
            container.register_processed_part(peer_index, part_index, result)

    async def _accumulate_parts_streaming(self, stream: AsyncIterator[Any], sender_index: int) -> AsyncIterator[Any]:
        """hivemind's reducer loop, returning Q(aggregate) in the compression the sender used (not a difference)."""
        part_index = 0
        try:
            async for tensor_part, weight, part_compression in amap_in_executor(
                lambda msg: (deserialize_torch_tensor(msg.tensor_part), msg.weight, msg.tensor_part.compression),
                stream,
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                try:
                    averaged = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, tensor_part, weight=weight
                    )
                except BannedException:
                    break  # this sender was banned: its results are no longer needed
                serialized = await self._result(part_index, averaged, part_compression)
                part_index += 1
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])


async def run_exact_allreduce_(
    averager: Any,
    tensors: Sequence[torch.Tensor],
    group_info: Any,
    group_id: bytes | None = None,
    runner_cls: type[ExactRoundRunner] | None = None,
    **kwargs: Any,
) -> None:
    """Like trahiv.averaging.robust.run_robust_allreduce_, but the tensors are replaced by the round's results."""
    group_id = group_info.group_id if group_id is None else group_id
    kwargs.setdefault("modes", group_modes(averager, group_info))
    runner = (runner_cls or ExactRoundRunner)(
        aggregation=averager.aggregation,
        p2p=averager._p2p,
        servicer_type=type(averager),
        prefix=averager.prefix,
        tensors=tensors,
        group_id=group_id,
        ordered_peer_ids=group_info.peer_ids,
        **kwargs,
    )
    assert isinstance(runner, ExactRoundRunner), "an exact round needs an ExactRoundRunner"
    assert group_id in averager._running_groups, f"group {group_id!r} was not registered"
    averager._running_groups[group_id].set_result(runner)
    if runner.modes[group_info.peer_ids.index(averager.peer_id)] == AveragingMode.AUX:
        async for _ in runner:
            raise ValueError("aux peers should not receive averaged tensors")
        return
    index = 0
    async for result in runner:  # (hivemind zipped the tensors and the results with a gather of two tasks a tensor)
        tensors[index].copy_(result)
        averager.last_updated = get_dht_time()  # (no `_state_updated`: see trahiv.engine.allreduce)
        index += 1
    if index != len(tensors):
        raise AllreduceException(f"the round returned {index} of {len(tensors)} tensors")


class ExactAverager(RobustAverager):
    """A robust averager whose rounds leave every peer with the same bits (mix in ReportingMixin first, with
    `runner_cls = ExactRoundRunner`)."""

    runner_cls: type[ExactRoundRunner] = ExactRoundRunner

    async def _run_allreduce_inplace_(self, tensors: Sequence[torch.Tensor], group_info: Any, **kwargs: Any) -> None:
        kwargs.pop("aggregation", None)
        await run_exact_allreduce_(self, tensors, group_info, **kwargs)
