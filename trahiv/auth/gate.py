"""The auth gate on averaging RPCs: matchmaking, all-reduce and state download serve only token holders.

hivemind's averagers accept `rpc_join_group`, `rpc_aggregate_part` and `rpc_download_state` from anyone. libp2p
authenticates the caller's peer ID on every stream (`context.remote_id`); `AuthGate` maps a peer ID to a valid access
token published in the DHT under `{run_id}_auth` (signed by the experiment key, unexpired, and bound to the key that
peer ID is derived from). `gated(averager_cls, gate)` is the averager class with the gate in front of all three RPCs:

- a join request from a peer without a valid token is answered PROTOCOL_VIOLATION (the follower looks elsewhere);
- a part for aggregation from such a peer is answered PROTOCOL_VIOLATION and never reaches the reducer;
- a state download request from such a peer gets no data (the engine's way to say "ask another peer");
- before an all-reduce, every member of the group must hold a valid token, or this peer leaves the round.

A ban takes effect when the banned peer's token expires: the server refuses to renew it, and the gate stops accepting
it. What a refused peer sends is never read.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any, AsyncIterator  # noqa: UP035  (hivemind finds streaming RPCs by typing.AsyncIterator)

from hivemind.averaging.partition import AllreduceException
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.timed_storage import ValueWithExpiration, get_dht_time

from trahiv.auth.client import auth_key
from trahiv.auth.tokens import TokenError, TokenInfo, token_from_bytes, verify_access_token

logger = logging.getLogger("trahiv.auth")

__all__ = ["AuthGate", "gated"]

MIN_FETCH_PERIOD = 1.0  # seconds between DHT reads for a peer not in the cache (an unknown caller cannot flood the DHT)
WARN_PERIOD = 30.0  # seconds between warnings about the same refused peer


class AuthGate:
    """Which peers hold valid access tokens for one run, read from the DHT and cached until the tokens expire."""

    def __init__(self, run_id: str, experiment_public_key: bytes, local_peer_id: PeerID | None = None):
        self.key = auth_key(run_id)
        self.experiment_public_key = experiment_public_key
        self.local_peer_id = local_peer_id
        self._tokens: dict[PeerID, TokenInfo] = {}
        self._last_fetch = -float("inf")
        self._fetching: asyncio.Future | None = None
        self._warned: dict[tuple[PeerID, str], float] = {}

    def cached(self, peer_id: PeerID) -> TokenInfo | None:
        info = self._tokens.get(peer_id)
        return info if info is not None and info.expires_at > get_dht_time() else None

    async def check(self, dht: Any, peer_id: PeerID) -> TokenInfo | None:
        """The valid token of `peer_id`, or None; reads the DHT at most every MIN_FETCH_PERIOD seconds."""
        info = self.cached(peer_id)
        if info is not None:
            return info
        if time.monotonic() - self._last_fetch >= MIN_FETCH_PERIOD or self._fetching is not None:
            await self._refresh(dht)
        return self.cached(peer_id)

    async def _refresh(self, dht: Any) -> None:
        if self._fetching is not None:  # one DHT read at a time; concurrent callers share it
            await asyncio.shield(self._fetching)
            return
        self._fetching = asyncio.get_running_loop().create_future()
        self._last_fetch = time.monotonic()
        try:
            found = await dht.get(self.key, latest=True, return_future=True)
            self.update(found.value if found is not None and isinstance(found.value, dict) else {})
        except Exception as e:
            logger.warning(f"Could not read access tokens from the DHT: {e!r}")
        finally:
            self._fetching.set_result(None)
            self._fetching = None

    def update(self, entries: dict[Any, Any]) -> None:
        """Cache the valid tokens among DHT entries {subkey: ValueWithExpiration(serialized token)}."""
        now = get_dht_time()
        for entry in entries.values():
            value = entry.value if isinstance(entry, ValueWithExpiration) else None
            try:
                info = verify_access_token(token_from_bytes(value), self.experiment_public_key, now)  # type: ignore[arg-type]
            except (TokenError, ValueError):
                continue  # forged, expired, malformed: as if absent
            known = self._tokens.get(info.peer_id)
            if known is None or known.expires_at < info.expires_at:
                self._tokens[info.peer_id] = info
        for peer_id in [p for p, i in self._tokens.items() if i.expires_at <= now]:
            del self._tokens[peer_id]

    def warn_refused(self, peer_id: PeerID, what: str) -> None:
        now = time.monotonic()
        if now - self._warned.get((peer_id, what), -float("inf")) >= WARN_PERIOD:
            self._warned[(peer_id, what)] = now
            logger.warning(f"Refused {what} from peer {peer_id}: it holds no valid access token for this run")


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


def gated(averager_cls: type, gate: AuthGate | None) -> Any:
    """`averager_cls` with the gate in front of its averaging RPCs (`averager_cls` itself if there is no gate)."""
    if gate is None:
        return averager_cls
    return type(f"Gated{averager_cls.__name__}", (_Gated, averager_cls), {"auth_gate": gate})
