"""How many bytes a peer's averagers sent and received: `averaging_bytes_sent` / `averaging_bytes_received`.

hivemind 1.1.12 does not count what an all-reduce moves. Here every averaging message (hivemind's `AveragingData`
protobuf: a compressed tensor part, its weight, the round's codes) is counted at its serialized size, both ways:

- as a sender: the parts this peer streams to the other reducers, and the averaged parts they return;
- as a reducer: the parts the other senders stream to this peer, and the averaged parts it returns to them.

The exchange of a peer with itself never leaves the process and is not counted, nor is libp2p's framing (a few bytes
per message), nor DHT traffic. The counters live in shared memory: the averager process counts, the training process
reads (`Traffic.sent`, `Traffic.received`), cumulative since the averager was made.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import AsyncIterator
from typing import Any

from trahiv.engine.allreduce import RobustAllReduceRunner

__all__ = ["Traffic", "TrafficCountingRunner", "total_traffic"]


class Traffic:
    """Cumulative bytes sent and received by one averager, shared between its process and the one that made it."""

    def __init__(self) -> None:
        self._counts = mp.get_context("fork").Array("q", 2)  # [sent, received], with a lock

    def add(self, sent: int = 0, received: int = 0) -> None:
        with self._counts.get_lock():
            self._counts[0] += sent
            self._counts[1] += received

    @property
    def sent(self) -> int:
        return int(self._counts[0])

    @property
    def received(self) -> int:
        return int(self._counts[1])


def total_traffic(averagers: Any) -> dict[str, int]:
    """`averaging_bytes_sent` / `averaging_bytes_received` summed over the averagers that count (None are skipped)."""
    counters = [getattr(a, "traffic", None) for a in averagers if a is not None]
    counted = [c for c in counters if isinstance(c, Traffic)]
    return {
        "averaging_bytes_sent": sum(c.sent for c in counted),
        "averaging_bytes_received": sum(c.received for c in counted),
    }


class TrafficCountingRunner(RobustAllReduceRunner):
    """The robust all-reduce runner that adds the bytes of every message it exchanges with other peers to `traffic`."""

    def __init__(self, *, traffic: Traffic | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.traffic = traffic

    def _count(self, sent: int = 0, received: int = 0) -> None:
        if self.traffic is not None:
            self.traffic.add(sent, received)

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[Any]:
        async for message in super()._generate_input_for_peer(peer_index):
            self._count(sent=message.ByteSize())
            yield message

    def _get_peer_stub(self, peer: Any) -> Any:
        return _CountingStub(super()._get_peer_stub(peer), self)

    async def rpc_aggregate_part(self, stream: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        async for message in super().rpc_aggregate_part(self._received(stream), context):
            self._count(sent=message.ByteSize())
            yield message

    async def _received(self, stream: AsyncIterator[Any]) -> AsyncIterator[Any]:
        try:
            async for message in stream:
                self._count(received=message.ByteSize())
                yield message
        finally:
            close = getattr(stream, "aclose", None)
            if close is not None:
                await close()


class _CountingStub:
    """A reducer's stub whose `rpc_aggregate_part` replies are counted as received."""

    def __init__(self, stub: Any, runner: TrafficCountingRunner):
        self._stub, self._runner = stub, runner

    async def rpc_aggregate_part(self, inputs: AsyncIterator[Any]) -> AsyncIterator[Any]:
        return self._runner._received(await self._stub.rpc_aggregate_part(inputs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stub, name)
