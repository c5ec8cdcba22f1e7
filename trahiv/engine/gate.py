"""The auth gate in front of an averager's RPCs (`gated`): the engine side of `trahiv.auth.gate.AuthGate`.

Overrides hivemind 1.1.12's averaging RPC handlers (`DecentralizedAverager.rpc_join_group`, `rpc_aggregate_part`,
`rpc_download_state`) and `_run_allreduce_inplace_`, trahiv's handler of news that a round began
(`rpc_trahiv_round_began`, trahiv.engine.tell) and its state download from one peer
(`CheckedStateDownload._download_state_from`); what counts as a valid token is the gate's business.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, AsyncIterator  # noqa: UP035  (hivemind finds streaming RPCs by typing.AsyncIterator)

from hivemind.averaging.partition import AllreduceException
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2

from trahiv.engine.fixes import until_the_sender_ends

if TYPE_CHECKING:
    from trahiv.auth.gate import AuthGate

__all__ = ["gated"]


class _Gated:
    """Mixin for a hivemind DecentralizedAverager subclass: every averaging RPC passes `auth_gate` first."""

    auth_gate: AuthGate  # set by gated(): a class attribute, so the class stays a class (issubclass checks, forks)
    dht: Any
    peer_id: PeerID

    async def _admit(self, context: P2PContext, what: str) -> bool:
        if await self.auth_gate.check(self.dht, context.remote_id) is not None:
            return True
        self.auth_gate.warn_refused(context.remote_id, what)
        return False

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if not await self._admit(context, "a request to join an averaging group"):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().rpc_join_group(request, context):  # type: ignore[misc]
            yield message

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        if not await self._admit(context, "tensors for averaging"):
            try:  # read the first message, as hivemind does, so that the refusal is delivered before the stream closes
                await asyncio.wait_for(anext(stream), timeout=5.0)
            except (TimeoutError, StopAsyncIteration):
                pass
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            await until_the_sender_ends(stream)  # (or the refusal may be lost with the stream: see there)
            return
        async for message in super().rpc_aggregate_part(stream, context):  # type: ignore[misc]
            yield message

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        if not await self._admit(context, "a state download request"):
            return
        async for message in super().rpc_download_state(request, context):  # type: ignore[misc]
            yield message

    async def _download_state_from(self, peer: PeerID, timeout: float | None) -> Any:
        """A state download (CheckedStateDownload) reads only peers that hold a valid token: a banned peer, whose
        token expired, stays in the DHT's list of state sources until its entry expires, and served its own state to
        whoever picked it (the next source is asked instead)."""
        if await self.auth_gate.check(self.dht, peer) is None:
            self.auth_gate.warn_refused(peer, "the state", source=True)
            return None
        return await super()._download_state_from(peer, timeout)  # type: ignore[misc]

    async def _run_allreduce_inplace_(self, tensors: Sequence[Any], group_info: Any, **kwargs: Any) -> None:
        refused = []
        for peer_id in group_info.peer_ids:
            if peer_id != self.peer_id and await self.auth_gate.check(self.dht, peer_id) is None:
                refused.append(peer_id)
        if refused:
            group_id = kwargs.get("group_id") or group_info.group_id
            running = getattr(self, "_running_groups", {}).get(group_id)
            if running is not None and not running.done():
                running.cancel()  # groupmates that already sent parts here stop waiting for this peer
            raise AllreduceException(f"leaving the averaging round: peers {refused} hold no valid access token")
        await super()._run_allreduce_inplace_(tensors, group_info, **kwargs)  # type: ignore[misc]


class _GatedTelling(_Gated):
    """_Gated, for an averager that is told as a groupmate's round begins (trahiv.engine.tell.TellsGroupmates)."""

    async def rpc_trahiv_round_began(
        self, request: averaging_pb2.AveragingData, context: P2PContext
    ) -> averaging_pb2.AveragingData:
        if not await self._admit(context, "news that an averaging round began"):
            return averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
        return await super().rpc_trahiv_round_began(request, context)  # type: ignore[misc]


def gated(averager_cls: type, gate: AuthGate | None) -> Any:
    """`averager_cls` with the gate in front of its averaging RPCs (`averager_cls` itself if there is no gate)."""
    if gate is None:
        return averager_cls
    mixin = _GatedTelling if callable(getattr(averager_cls, "rpc_trahiv_round_began", None)) else _Gated
    return type(f"Gated{averager_cls.__name__}", (mixin, averager_cls), {"auth_gate": gate})
