"""The auth gate on averaging RPCs: matchmaking, all-reduce and state download serve only token holders.

hivemind's averagers accept `rpc_join_group`, `rpc_aggregate_part` and `rpc_download_state` from anyone. libp2p
authenticates the caller's peer ID on every stream (`context.remote_id`); `AuthGate` maps a peer ID to a valid access
token published in the DHT under `{run_id}_auth` (signed by the experiment key, unexpired, and bound to the key that
peer ID is derived from). `trahiv.engine.gate.gated(averager_cls, gate)` is the averager class with the gate in front
of all three RPCs:

- a join request from a peer without a valid token is answered PROTOCOL_VIOLATION (the follower looks elsewhere);
- a part for aggregation from such a peer is answered PROTOCOL_VIOLATION and never reaches the reducer;
- a state download request from such a peer gets no data (the engine's way to say "ask another peer");
- a state download is never asked of such a peer (the next source is);
- before an all-reduce, every member of the group must hold a valid token, or this peer leaves the round.

A ban takes effect when the banned peer's token expires: the server refuses to renew it, and the gate stops accepting
it. What a refused peer sends is never read.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any  # noqa: UP035  (hivemind finds streaming RPCs by typing.AsyncIterator)

from hivemind.p2p import PeerID
from hivemind.utils.timed_storage import ValueWithExpiration, get_dht_time

from trahiv.auth.client import auth_key
from trahiv.auth.tokens import TokenError, TokenInfo, token_from_bytes, verify_access_token

logger = logging.getLogger("trahiv.auth")

__all__ = ["AuthGate"]

MIN_FETCH_PERIOD = 1.0  # seconds between DHT reads for a peer not in the cache (an unknown caller cannot flood the DHT)
REFRESH_AHEAD_S = 3.0  # a cached token with less than this left is looked up again (its holder renewed it by then)
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
        self._background: asyncio.Future | None = None
        self._warned: dict[tuple[PeerID, str], float] = {}

    def cached(self, peer_id: PeerID) -> TokenInfo | None:
        info = self._tokens.get(peer_id)
        return info if info is not None and info.expires_at > get_dht_time() else None

    async def check(self, dht: Any, peer_id: PeerID) -> TokenInfo | None:
        """The valid token of `peer_id`, or None once a DHT read under way or begun after this call did not find one.

        The gate reads the DHT at most every MIN_FETCH_PERIOD seconds (concurrent callers share a read); a caller
        whose token is not cached waits for the next read rather than being refused on an older one: a peer renews
        its token before it expires, and the gate, which keeps the newest token it has seen, may still hold the
        previous one when that expires (a peer that renewed right after the gate's first read of its token was refused
        once, if that first token expired less than MIN_FETCH_PERIOD after another read). Tokens about to expire are
        looked up again in the background (REFRESH_AHEAD_S), so that their holders do not wait at all."""
        info = self.cached(peer_id)
        if info is not None:
            if info.expires_at - get_dht_time() < REFRESH_AHEAD_S:
                self._refresh_in_background(dht)
            return info
        asked = time.monotonic()
        if self._fetching is None:  # (a read under way is shared)
            while self._last_fetch < asked:  # at most one wait for the rate limit, then a read
                if (wait := self._last_fetch + MIN_FETCH_PERIOD - time.monotonic()) > 0:
                    await asyncio.sleep(wait)  # (another caller may start the read meanwhile)
                else:
                    await self._refresh(dht)
        if self._fetching is not None:
            await asyncio.shield(self._fetching)
        return self.cached(peer_id)

    def _refresh_in_background(self, dht: Any) -> None:
        if self._fetching is None and time.monotonic() - self._last_fetch >= MIN_FETCH_PERIOD:
            self._background = asyncio.ensure_future(self._refresh(dht))  # (a reference, so that it is not collected)

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

    def warn_refused(self, peer_id: PeerID, what: str, source: bool = False) -> None:
        """Warn (once per WARN_PERIOD for the peer and `what`) that `what` from `peer_id` was refused, or (`source`) not
        asked for: a state download source without a valid token."""
        now = time.monotonic()
        if now - self._warned.get((peer_id, what), -float("inf")) >= WARN_PERIOD:
            self._warned[(peer_id, what)] = now
            action = f"Did not download {what} from peer {peer_id}" if source else f"Refused {what} from peer {peer_id}"
            logger.warning(f"{action}: it holds no valid access token for this run")
