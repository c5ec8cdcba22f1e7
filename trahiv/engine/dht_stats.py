"""Count the DHT messages of a peer: the RPCs its DHT node sends (`call_ping`, `call_store`, `call_find`) and those it
answers (`rpc_ping`, `rpc_store`, `rpc_find`, as they arrive from p2pd).

hivemind 1.1.12 counts none of them. `install()` wraps `DHTProtocol`'s three clients and its handler registration at
class level, in this process: every DHT started after it (a `hivemind.DHT` is a forked process and inherits the
patch) keeps its counts on its own protocol object, inside its own process. `dht_message_counts(dht)` reads them back
from there (`DHT.run_coroutine`).

A sent message is an attempt: one that times out counts too. A received message is one request handled; the pings a
node runs on itself for the sender of a store or find (hivemind's `rpc_store` / `rpc_find` call `self.rpc_ping` to
add the sender to the routing table) are not messages and are not counted. A client-mode node answers nothing.

Who causes them: `dht_request_counts(dht)` counts the gets and stores the peer's own processes (the training process,
its averagers) asked of its DHT (`DHT.get` / `DHT.store`, run in the DHT's process as `DHT._get` / `DHT._store`), by
key: each one costs a lookup of some finds and, for a store, some stores. An averager's matchmaking key carries its
group bits (`<prefix>.0b0101...`): counted under `<prefix>.0b*`.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

from trahiv.engine.fixes import _replace

__all__ = ["KINDS", "dht_message_counts", "dht_request_counts", "install", "installed"]

KINDS = ("ping", "store", "find")
_COUNTS = "_trahiv_message_counts"  # attribute of a DHTProtocol instance, in its DHT's process
_REQUESTS = "_trahiv_request_counts"  # attribute of a hivemind.DHT, in its own process
MAX_KEYS = 64  # distinct keys counted per DHT; the others under "other"
_installed = False


def _counts(owner: Any, attribute: str = _COUNTS) -> Counter[str]:
    counts = owner.__dict__.get(attribute)
    if counts is None:
        counts = owner.__dict__[attribute] = Counter()
    return counts


def _counting_client(kind: str, original: Any) -> Any:
    @functools.wraps(original)
    async def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        _counts(self)[f"{kind}_sent"] += 1
        return await original(self, *args, **kwargs)

    return call


class _CountingServicer:
    """Stands in for the servicer whose `rpc_*` methods hivemind registers as p2p handlers: each handler counts."""

    def __init__(self, servicer: Any, counts: Counter[str]):
        self._servicer, self._counts = servicer, counts

    def __getattr__(self, name: str) -> Any:
        handler = getattr(self._servicer, name)
        kind = name.removeprefix("rpc_")
        if not name.startswith("rpc_") or kind not in KINDS:
            return handler

        async def counted(*args: Any, **kwargs: Any) -> Any:
            self._counts[f"{kind}_received"] += 1
            return await handler(*args, **kwargs)

        return counted


def _key_name(key: Any) -> str:
    name = str(key)
    prefix, bits, _ = name.partition(".0b")
    return prefix + ".0b*" if bits else name


def _counting_request(verb: str, original: Any) -> Any:
    @functools.wraps(original)
    async def request(self: Any, *args: Any, **kwargs: Any) -> Any:
        counts = _counts(self, _REQUESTS)
        name = f"{verb} {_key_name(kwargs['key'] if 'key' in kwargs else args[0])}"
        counts[name if name in counts or len(counts) < MAX_KEYS else f"{verb} other"] += 1
        return await original(self, *args, **kwargs)

    return request


def install() -> None:
    """Count the messages of every DHT started from now on in this process (idempotent)."""
    global _installed
    if _installed:
        return
    from hivemind.dht.dht import DHT
    from hivemind.dht.protocol import DHTProtocol

    _replace(DHT, "_get", _counting_request("get", DHT._get))
    _replace(DHT, "_store", _counting_request("store", DHT._store))
    for kind in KINDS:
        name = f"call_{kind}"
        _replace(DHTProtocol, name, _counting_client(kind, getattr(DHTProtocol, name)))
    register = DHTProtocol.add_p2p_handlers  # hivemind's ServicerBase.add_p2p_handlers

    async def add_p2p_handlers(self: Any, p2p: Any, wrapper: Any = None, **kwargs: Any) -> None:
        # DHTProtocol.create registers `AuthRPCWrapper(self, ...)`: the counting servicer goes in front of it
        servicer = _CountingServicer(self if wrapper is None else wrapper, _counts(self))
        return await register(self, p2p, servicer, **kwargs)

    _replace(DHTProtocol, "add_p2p_handlers", add_p2p_handlers)
    _installed = True


def installed() -> bool:
    return _installed


async def _read_counts(_dht: Any, node: Any) -> dict[str, int]:
    counts = node.protocol.__dict__.get(_COUNTS, Counter())
    return {f"{kind}_{way}": int(counts[f"{kind}_{way}"]) for kind in KINDS for way in ("sent", "received")}


def dht_message_counts(dht: Any, timeout: float | None = 30.0) -> dict[str, int]:
    """The messages `dht`'s node sent and received since it started, by kind ('ping_sent', ..., 'find_received') and
    in all ('sent', 'received', 'total'); all zero if `install()` ran after the DHT started."""
    counts: dict[str, int] = dht.run_coroutine(_read_counts, return_future=True).result(timeout)
    sent = sum(counts[f"{kind}_sent"] for kind in KINDS)
    received = sum(counts[f"{kind}_received"] for kind in KINDS)
    return {**counts, "sent": sent, "received": received, "total": sent + received}


async def _read_requests(dht: Any, _node: Any) -> dict[str, int]:
    return dict(dht.__dict__.get(_REQUESTS, Counter()))


def dht_request_counts(dht: Any, timeout: float | None = 30.0) -> dict[str, int]:
    """The gets and stores this peer's processes asked of `dht` since it started, by key ('get run_progress': 12)."""
    counts: dict[str, int] = dht.run_coroutine(_read_requests, return_future=True).result(timeout)
    return counts
