"""trahiv.engine.dht_stats: a DHT node's messages, counted on both sides of each RPC."""

from __future__ import annotations

import time

import hivemind
import pytest
from hivemind.utils import get_dht_time

from trahiv.engine import dht_stats

KINDS = dht_stats.KINDS


def _start(initial_peers: list[str] | None = None) -> hivemind.DHT:
    return hivemind.DHT(
        start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=initial_peers or [], nat_port_map=False
    )


def _settled(a: hivemind.DHT, b: hivemind.DHT, timeout: float = 5.0) -> tuple[dict[str, int], dict[str, int]]:
    """Both nodes' counts once every message one sent has arrived at the other (two nodes, nothing else talks)."""
    deadline = time.monotonic() + timeout
    while True:
        ca, cb = dht_stats.dht_message_counts(a), dht_stats.dht_message_counts(b)
        paired = all(ca[f"{k}_sent"] == cb[f"{k}_received"] and cb[f"{k}_sent"] == ca[f"{k}_received"] for k in KINDS)
        if paired or time.monotonic() > deadline:
            return ca, cb
        time.sleep(0.1)


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {key: after[key] - before[key] for key in after}


@pytest.fixture(scope="module")
def two_dhts():
    dht_stats.install()  # before the DHT processes fork
    first = _start()
    second = None
    try:
        second = _start([str(m) for m in first.get_visible_maddrs()])
        yield first, second
    finally:
        for dht in (second, first):
            if dht is not None:
                dht.shutdown()


def test_joining_pings_and_every_message_is_counted_on_both_sides(two_dhts):
    first, second = two_dhts
    a, b = _settled(first, second)
    assert b["ping_sent"] >= 1 and a["ping_received"] >= 1, (a, b)  # the joiner pinged its initial peer
    for kind in KINDS:  # what one sent, the other received: exactly (no ping counted for a store's or find's sender)
        assert a[f"{kind}_sent"] == b[f"{kind}_received"], (kind, a, b)
        assert b[f"{kind}_sent"] == a[f"{kind}_received"], (kind, a, b)
    assert a["total"] == a["sent"] + a["received"] == sum(a[f"{k}_{w}"] for k in KINDS for w in ("sent", "received"))


def test_a_store_and_a_get_are_counted_on_both_sides(two_dhts):
    first, second = two_dhts
    a0, b0 = _settled(first, second)
    assert second.store("swarm_cost_key", b"value", expiration_time=get_dht_time() + 60)
    a1, b1 = _settled(first, second)
    stored_a, stored_b = _delta(a1, a0), _delta(b1, b0)
    assert stored_b["store_sent"] >= 1, stored_b  # the value was sent to the other node
    assert stored_a["store_received"] == stored_b["store_sent"], (stored_a, stored_b)
    assert stored_a["store_sent"] == stored_b["store_received"] == 0, (stored_a, stored_b)
    assert stored_a["ping_received"] == stored_b["ping_sent"], (stored_a, stored_b)

    found = first.get("swarm_cost_key", latest=True)  # latest: ask the other node, not only the local storage
    assert found is not None and found.value == b"value"
    a2, b2 = _settled(first, second)
    got_a, got_b = _delta(a2, a1), _delta(b2, b1)
    assert got_a["find_sent"] >= 1, got_a
    assert got_b["find_received"] == got_a["find_sent"], (got_a, got_b)
    assert got_a["store_sent"] == got_b["store_sent"] == 0, (got_a, got_b)

    # the requests that caused them, by key (an averager's group bits folded)
    assert second.store("swarm_cost_group.0b0101", 1, expiration_time=get_dht_time() + 60)
    requests_a, requests_b = dht_stats.dht_request_counts(first), dht_stats.dht_request_counts(second)
    assert requests_a.get("get swarm_cost_key") == 1 and "store swarm_cost_key" not in requests_a, requests_a
    assert requests_b.get("store swarm_cost_key") == 1 and "get swarm_cost_key" not in requests_b, requests_b
    assert requests_b.get("store swarm_cost_group.0b*") == 1, requests_b


def test_installing_again_does_not_count_twice(two_dhts):
    first, second = two_dhts
    dht_stats.install()
    assert dht_stats.installed()
    a0, _ = _settled(first, second)
    found = first.get("swarm_cost_key", latest=True)
    assert found is not None
    a1, _ = _settled(first, second)
    assert 1 <= a1["find_sent"] - a0["find_sent"] <= 2, (a0, a1)  # one lookup: one find per other node (one here)
