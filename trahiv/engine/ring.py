"""A ring all-reduce for gradient rounds: one stream to the next peer, each link carrying 2 (N - 1) / N x S.

hivemind 1.1.12 has only the butterfly all-reduce: each peer sends every other peer that peer's share and gets the
aggregate back, so every uplink carries N - 1 flows at once. Over shaped links the same bytes moved that way take
1.17-1.30x the bound 2 (N - 1) / N x S / B, and as a ring's traffic 1.07-1.12x (plain TCP and libp2p streams alike:
README, "The traffic pattern"). Here the group's peers, in the group's order, form a ring; the tensors are cut into
N segments (segment k is the share the butterfly gives peer k), each of parts of `part_size_bytes`:

- reduce-scatter, N - 1 steps: at step s peer i sends the next peer segment (i - s - 1) mod N as the weighted mean of
  its own values and what it received for that segment (at step 0 its own values), with the total weight behind it;
  a part goes on as soon as its predecessor's copy arrived. After the last step peer i holds the mean of segment i.
- all-gather, N - 1 steps: peer i encodes the mean of segment i once and sends it on; every peer forwards what it
  received, unchanged, to the next one (but the peer whose segment it is). Every peer decodes the same message: the
  round hands every peer the same bits (as `trahiv.engine.exact`).

The robust reducer's checks, per part as it arrives: a peer's own non-finite values or invalid weight are left out
(its weight counts as 0); a received running mean that is not finite or has the wrong shape drops what came before
it (the values of the peers upstream in that segment: a running mean cannot be split back into its senders); a
running weight above the sum of the samples its senders reported is clamped to that sum. A segment nobody could
average (every weight 0, or its mean arrived unusable) keeps each peer's own values (zeros with `unaveraged_zero`,
the same on every peer), and the round is reported partial. CenteredClip needs every sender's copy at one reducer:
its rounds stay on the butterfly.

The ring is taken only when every member of the group asks for it (`RING_TAG` in the data it gathers at matchmaking)
and every member is a full node (clients cannot accept a stream; auxiliary peers would only forward); otherwise the
round is the butterfly one (`ExactRoundRunner`), so peers configured differently still average together. A ring
round is all or nothing for this peer: the results are applied once every segment arrived; a peer that stalls or
leaves fails the round for the others (each then keeps its own values, as a failed butterfly round) within its
chunk deadline, instead of leaving the others partial.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.partition import AllreduceException
from hivemind.compression import deserialize_torch_tensor
from hivemind.proto import averaging_pb2

from trahiv.averaging.partial import RoundReport
from trahiv.averaging.robust import rejection_reason
from trahiv.engine.allreduce import _retire
from trahiv.engine.exact import ExactRoundRunner, compression_type

logger = logging.getLogger("trahiv.averaging")

__all__ = ["RING_TAG", "RingRoundRunner", "ring_group", "tag_for_ring"]

SENDING: set[asyncio.Task] = set()  # (in an averager process) streams to next peers still finishing after a round
RING_TAG = "trahiv.ring/1"  # in the data a peer gathers at matchmaking: it can run (and asks for) a ring round


def tag_for_ring(serializer: Any, data_for_gather: bytes) -> bytes:
    """hivemind's gathered data `[bandwidth, mode, user data]`, with the user data wrapped as `[RING_TAG, data]`."""
    bandwidth, mode, user_data = serializer.loads(data_for_gather)
    return serializer.dumps([bandwidth, mode, serializer.dumps([RING_TAG, user_data])])


def ring_group(serializer: Any, gathered: Sequence[bytes]) -> bool:
    """Whether a group runs a ring round: two peers or more, every one a full node that tagged its data for it."""
    if len(gathered) < 2:
        return False
    for data in gathered:
        _, mode, user_data = serializer.loads(data)
        if AveragingMode(mode) != AveragingMode.NODE:
            return False
        try:
            tag = serializer.loads(user_data)
        except Exception:
            return False
        if not (isinstance(tag, list | tuple) and len(tag) == 2 and tag[0] == RING_TAG):
            return False
    return True


class _Incoming:
    """Messages from the previous peer, in order; an exception ends the stream for the reader."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.opened = False

    async def get(self, timeout: float | None) -> averaging_pb2.AveragingData:
        item = await asyncio.wait_for(self.queue.get(), timeout)
        if isinstance(item, BaseException):
            raise item
        return item


class RingRoundRunner(ExactRoundRunner):
    """An exact round (`ExactRoundRunner`) run as a ring all-reduce when `ring` (see the module), else as hivemind's
    butterfly. The group's order is the ring's; its peers' fractions are made equal (the slowest link paces a ring)."""

    def __init__(self, *, ring: bool = False, **kwargs: Any):
        if ring:
            kwargs["peer_fractions"] = (1.0,) * len(kwargs["ordered_peer_ids"])
        super().__init__(**kwargs)
        self.ring = ring
        if not ring:
            return
        assert all(mode == AveragingMode.NODE for mode in self.modes), "a ring round needs full nodes only"
        container = self.tensor_part_container
        self._segments = [_chunks(list(parts), container) for parts in container._input_parts_by_peer]
        self._index = self.ordered_peer_ids.index(self.peer_id)
        size = self.group_size
        self._next = self.ordered_peer_ids[(self._index + 1) % size]
        self._previous = self.ordered_peer_ids[(self._index - 1) % size]
        self._incoming = _Incoming()
        self._timing: dict[str, float] = {}  # (logged at DEBUG once a round ends: where its time went)
        self._caps = list(self.tensor_part_reducer.weight_caps)  # by sender index = group index (all nodes)
        _retire(self.tensor_part_reducer)  # (the butterfly's reducer: a ring round does not use it)

    def report(self, seconds: float, payload: int, error: BaseException | None) -> RoundReport:
        report = super().report(seconds, payload, error)
        return dataclasses.replace(report, allreduce="ring") if self.ring else report

    # --- the schedule --------------------------------------------------------------------------------------------

    def _segment(self, step: int, *, sent_by: int) -> int:
        """The segment peer `sent_by` sends at `step` (0 .. 2 (N - 1) - 1: reduce-scatter, then all-gather)."""
        size = self.group_size
        if step < size - 1:
            return (sent_by - step - 1) % size
        return (sent_by - (step - (size - 1))) % size

    def _expected_incoming(self) -> int:
        previous = (self._index - 1) % self.group_size
        steps = range(2 * (self.group_size - 1))
        return sum(len(self._segments[self._segment(step, sent_by=previous)]) for step in steps)

    # --- the round -----------------------------------------------------------------------------------------------

    async def run(self) -> AsyncIterator[torch.Tensor]:
        if not self.ring:
            async for tensor in super().run():
                yield tensor
            return
        try:
            for tensor in self._outputs(await self._ring()):
                yield tensor
            self.finalize()
        except BaseException as e:
            self.finalize(exception=e)
            raise

    async def _ring(self) -> list[list[torch.Tensor]]:
        """The round: each segment's averaged chunks, as every peer decoded them."""
        if not any(self._segments):
            return []  # nothing to average (no peer has any: their tensors are the same shapes)
        self._timing["started"] = time.perf_counter()
        outgoing: asyncio.Queue = asyncio.Queue()
        sender = asyncio.create_task(self._send(outgoing))

        def sender_done(task: asyncio.Task) -> None:  # a broken stream to the next peer ends the round at once
            if not task.cancelled() and task.exception() is not None:
                self._incoming.queue.put_nowait(AllreduceException(f"sending to {self._next}: {task.exception()!r}"))

        sender.add_done_callback(sender_done)
        await asyncio.sleep(0)  # the stream to the next peer begins to open while the first part is computed
        try:
            results = await self._reduce_and_gather(outgoing)
        except BaseException as e:
            sender.cancel()  # the next peer sees the stream end early and fails the round at once
            await asyncio.gather(sender, return_exceptions=True)
            if isinstance(e, Exception) and not isinstance(e, AllreduceException):
                raise AllreduceException(f"ring all-reduce failed: {e!r}") from e
            raise
        # this peer has every segment: its round is over. The stream to the next peer stays open until the next
        # peer says it has every part (up to a chunk's deadline), in the background (`SENDING`, awaited on shutdown)
        finishing = asyncio.create_task(self._finish_sending(sender))
        SENDING.add(finishing)
        finishing.add_done_callback(SENDING.discard)
        self._log_timing()
        return results

    def _outputs(self, results: list[list[torch.Tensor]]) -> Iterator[torch.Tensor]:
        """Each local tensor's results, in order. The segments hold the tensors' parts in order (hivemind's container
        cuts the flattened tensors into parts and deals them out in turn), so a tensor of one part is a view of its
        chunk's results. The container's outputs were a copy of every tensor (8M values: 20-40 ms a round on a busy
        2-core machine, on the round's critical path) before the caller's own copy into the tensor."""
        parts = iter(
            [
                part
                for segment, chunks in enumerate(results)
                for chunk, result in zip(self._segments[segment], chunks, strict=True)
                for part in result.split(chunk.sizes)
            ]
        )
        container = self.tensor_part_container
        for tensor, count in zip(container.local_tensors, container.num_parts_by_tensor, strict=True):
            pieces = [next(parts) for _ in range(count)]
            yield (pieces[0] if count == 1 else torch.cat(pieces)).view(tensor.shape)
        assert next(parts, None) is None, "a ring round's results hold more parts than its tensors"

    async def _finish_sending(self, sender: asyncio.Task) -> None:
        done, _ = await asyncio.wait({sender}, timeout=self.reducer_timeout)
        if not done or sender.exception() is not None:
            why = "no answer" if not done else repr(sender.exception())
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
            logger.warning(f"Ring all-reduce: {self._next} did not confirm it had every part ({why})")

    async def _reduce_and_gather(self, outgoing: asyncio.Queue) -> list[list[torch.Tensor]]:
        """Walk the schedule: put each message for the next peer in `outgoing` as soon as its inputs are here."""
        size, index = self.group_size, self._index
        results: list[list[torch.Tensor]] = [[] for _ in range(size)]
        own_weight = float(self.weight)
        first_wait = True

        async def receive() -> averaging_pb2.AveragingData:
            nonlocal first_wait
            timeout = self.sender_timeout if first_wait else self.reducer_timeout
            first_wait = False
            try:
                return await self._incoming.get(timeout)
            except TimeoutError as e:
                raise AllreduceException(f"{self._previous} sent nothing for {timeout} s") from e

        # reduce-scatter: at step s, our segment (index - s - 1) is the one the previous peer sent at step s - 1;
        # each part goes on as soon as its predecessor's arrived (at step 0: our own values)
        for step in range(size):  # (step size - 1: our own segment, complete; its mean starts the all-gather)
            segment = self._segment(step, sent_by=index) if step < size - 1 else index
            upstream = [(segment + 1 + k) % size for k in range(step)]  # peers whose values came before ours
            for chunk_index, chunk in enumerate(self._segments[segment]):
                own = chunk.values()
                before, before_weight = None, 0.0
                if step > 0:
                    before, before_weight = await self._work(_decode, await receive())
                mean, weight = await self._work(
                    self._combine, before, before_weight, own, own_weight, segment, chunk_index, upstream
                )
                message = await self._work(self._encode, mean, chunk.info, weight)
                outgoing.put_nowait(message)
                await asyncio.sleep(0)  # the sender writes it now: step 0's parts are computed without a wait between
                if step == size - 1:  # encoded once, decoded by every peer (this one too) from the same bytes
                    results[index].append(await self._work(self._final, message, own, index))

        # all-gather: forward what arrives (but the last segment, which the next peer owns)
        for step in range(size - 1):
            incoming_segment = (index - 1 - step) % size
            for chunk in self._segments[incoming_segment]:
                message = await receive()
                if step < size - 2:
                    outgoing.put_nowait(message)
                own = chunk.values()
                results[incoming_segment].append(await self._work(self._final, message, own, incoming_segment))
        outgoing.put_nowait(None)
        return results

    async def _work(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)` (decoding, averaging, encoding a chunk), its time counted. In the event loop itself: a
        chunk's work is about a millisecond, and three executor hops a chunk made the averager's work take 2-3x longer
        on a busy CPU (0.4 s a round for 0.15 s, 4 peers on 2 cores; the link then waited for the next chunk)."""
        started = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self._timing["work"] = self._timing.get("work", 0.0) + time.perf_counter() - started

    def _log_timing(self) -> None:
        timing = dict(self._timing)
        start = timing.pop("started")
        line = ", ".join(
            f"{key} {value - start:.3f} s" if key in ("first_sent", "last_sent", "first_received", "last_received")
            else f"{key} {value:.3f}" for key, value in sorted(timing.items())
        )  # fmt: skip
        logger.debug(f"Ring round of {self.group_size} peers, {time.perf_counter() - start:.3f} s: {line}")

    def _combine(
        self,
        mean: torch.Tensor | None,
        weight: float,
        own: torch.Tensor,
        own_weight: float,
        segment: int,
        part_index: int,
        upstream: list[int],
    ) -> tuple[torch.Tensor, float]:
        """The weighted mean of what came (`mean`, `weight`, from the peers `upstream`) and this peer's part."""
        if mean is not None:
            reason = rejection_reason(mean, weight, own.shape)
            if reason is not None:
                others = len(upstream) - 1
                self._exclude(
                    [upstream[-1]],
                    f"sent a running mean with {reason} (segment {segment}, part {part_index}): left out with the "
                    f"values of the {others} peer(s) before it there",
                )
                mean, weight = None, 0.0
            else:
                cap = sum(self._caps[peer] for peer in upstream)
                if weight > cap:
                    self._clamp(upstream, weight, cap)
                    weight = cap
        if own_weight > 0:
            reason = rejection_reason(own, own_weight, own.shape)
            if reason is not None:
                self._exclude([self._index], f"has {reason} in its own values (segment {segment}, part {part_index})")
                own_weight = 0.0
        own = own.float()
        if mean is None or weight <= 0:
            return (own.clone() if own_weight > 0 else torch.zeros_like(own)), own_weight
        if own_weight <= 0:
            return mean, weight
        total = weight + own_weight
        return mean.float().add(own - mean.float(), alpha=own_weight / total), total

    def _encode(self, mean: torch.Tensor, info: Any, weight: float) -> averaging_pb2.AveragingData:
        compressed = self.tensor_part_container.compression.compress(mean, info)
        return averaging_pb2.AveragingData(
            code=averaging_pb2.PART_FOR_AVERAGING, group_id=self.group_id, tensor_part=compressed, weight=weight
        )

    def _final(self, message: averaging_pb2.AveragingData, own: torch.Tensor, segment: int) -> torch.Tensor:
        """A segment's final part, as every peer decodes it; this peer's own values (or zeros) if nobody's counted
        or the message is unusable."""
        if message.weight > 0:
            part = deserialize_torch_tensor(message.tensor_part)
            reason = rejection_reason(part, message.weight, own.shape)
            if reason is None:
                return part.to(own.dtype)
            sender = self._index if segment == self._index else (self._index - 1) % self.group_size
            self._exclude([sender], f"sent a segment's mean with {reason} (segment {segment})")
        self.local_fallback[segment] = self.local_fallback.get(segment, 0) + own.numel()
        return torch.zeros_like(own) if self.unaveraged_zero else own.clone()

    def _exclude(self, peers: list[int], why: str) -> None:
        for peer in peers:
            name = self.ordered_peer_ids[peer].to_base58()
            if name not in self.reasons:
                self.reasons[name] = why
                logger.warning(f"Ring all-reduce: leaving out the values of peer {name}: it {why}")

    def _clamp(self, peers: list[int], weight: float, cap: float) -> None:
        names = ", ".join(self.ordered_peer_ids[peer].to_base58() for peer in peers)
        if names not in self.reasons:
            self.reasons[names] = f"their running weight {weight:g} clamped to {cap:g}, the samples they reported"
            logger.warning(
                f"Ring all-reduce: clamping the weight of peers {names} from {weight:g} to {cap:g}: more than the "
                "samples they reported"
            )

    # --- the streams ---------------------------------------------------------------------------------------------

    async def _send(self, outgoing: asyncio.Queue) -> None:
        """One stream to the next peer with every message of the round; ends when the next peer says it has them."""

        timing, clock = self._timing, time.perf_counter

        async def messages() -> AsyncIterator[averaging_pb2.AveragingData]:
            while True:
                if outgoing.empty() and "first_sent" in timing:  # the link idles until the next message is ready
                    waited = clock()
                    message = await outgoing.get()
                    timing["send_waits"] = timing.get("send_waits", 0.0) + clock() - waited
                    timing["send_wait_count"] = timing.get("send_wait_count", 0) + 1
                else:
                    message = await outgoing.get()
                if message is None:
                    timing["last_sent"] = clock()
                    return
                timing.setdefault("first_sent", clock())
                self._count(sent=message.ByteSize())
                yield message

        stream = await self._get_peer_stub(self._next).rpc_aggregate_part(messages())
        try:
            reply = await anext(stream)
            if reply.code != averaging_pb2.AVERAGED_PART:
                raise AllreduceException(f"{self._next} answered {averaging_pb2.MessageCode.Name(reply.code)}")
        except StopAsyncIteration as e:
            raise AllreduceException(f"{self._next} closed the ring's stream before it had every part") from e
        finally:
            await stream.aclose()  # closes our end: the next peer's handler ends when it sees it

    async def rpc_aggregate_part(self, stream: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        if not self.ring:
            async for message in super().rpc_aggregate_part(stream, context):
                yield message
            return
        if context.remote_id != self._previous or self._incoming.opened:
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        self._incoming.opened = True
        stream = self._received(stream)
        expected, count = self._expected_incoming(), 0
        try:
            first = await asyncio.wait_for(anext(stream), self.sender_timeout)
            rejection = self._check_reasons_to_reject(first, context)
            if rejection is not None:
                raise AllreduceException(f"{context.remote_id}: {averaging_pb2.MessageCode.Name(rejection.code)}")
            self._incoming.queue.put_nowait(first)
            self._timing["first_received"] = time.perf_counter()
            count = 1
            while count < expected:
                message = await asyncio.wait_for(anext(stream), self.reducer_timeout)
                self._incoming.queue.put_nowait(message)
                count += 1
            self._timing["last_received"] = time.perf_counter()
        except BaseException as e:
            why = e if isinstance(e, AllreduceException) else None
            if isinstance(e, StopAsyncIteration):
                why = AllreduceException(f"{context.remote_id} ended the ring's stream after {count} of {expected}")
            elif isinstance(e, TimeoutError):
                why = AllreduceException(f"{context.remote_id} sent nothing for a chunk's deadline")
            self._incoming.queue.put_nowait(why or AllreduceException(f"{context.remote_id}: {e!r}"))
            if isinstance(e, Exception):
                yield averaging_pb2.AveragingData(code=averaging_pb2.INTERNAL_ERROR)
                return
            raise
        yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART)  # every part arrived
        await asyncio.sleep(self.reducer_timeout or 10.0)  # cancelled as soon as the sender closes the stream


class _Chunk(NamedTuple):
    """Consecutive parts of a segment that travel as one message (hivemind's parts never span tensors: LoRA's
    65,536-value tensors in 8 bits made parts of 64 KiB, a message each)."""

    parts: list[torch.Tensor]
    info: Any  # the first part's CompressionInfo (all of the chunk's parts use the same codec)

    @property
    def sizes(self) -> list[int]:
        return [part.numel() for part in self.parts]

    def values(self) -> torch.Tensor:
        return self.parts[0] if len(self.parts) == 1 else torch.cat(self.parts)


def _chunks(parts: list[tuple[torch.Tensor, Any]], container: Any) -> list[_Chunk]:
    """A segment's parts grouped into chunks of at most the container's part size (as compressed), each of parts
    with the same codec; a codec that does not say what it uses keeps its parts apart."""
    chunks: list[_Chunk] = []
    size, kind = 0.0, None
    for part, info in parts:
        codec = compression_type(container.compression, info)
        nbytes = part.numel() * part.element_size() * container.compression.estimate_compression_ratio(info)
        if chunks and codec is not None and codec == kind and size + nbytes <= container.part_size_bytes:
            chunks[-1].parts.append(part)
            size += nbytes
        else:
            chunks.append(_Chunk([part], info))
            size, kind = nbytes, codec
    return chunks


def _decode(message: averaging_pb2.AveragingData) -> tuple[torch.Tensor, float]:
    """A running mean and the weight behind it (checked with this peer's own values, in `_combine`)."""
    return deserialize_torch_tensor(message.tensor_part), float(message.weight)
