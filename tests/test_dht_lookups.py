"""How many peers one DHT lookup asks, in a swarm larger than the lookup's beam (trahiv.config.DHTConfig.bucket_size).

hivemind's default k (bucket_size) of 20 is also the beam of every lookup: in a swarm of up to ~20 peers each progress
read, matchmaking lookup and store asked every peer, so a peer's DHT traffic grew with the swarm's size
(benchmarks/swarm_cost.py, 16 peers: 706 DHT messages per peer and step with k = 20, 404 with trahiv's 8). The
control, in the same swarm, is a peer with hivemind's default.
"""

from __future__ import annotations

from collections.abc import Iterator

import hivemind
import pytest
from hivemind.utils.timed_storage import get_dht_time

from trahiv.config import DHTConfig
from trahiv.engine import dht_stats
from trahiv.engine.dht_stats import dht_message_counts

PEERS = 14  # more than trahiv's beam (8), fewer than hivemind's (20)
HIVEMIND_BUCKET_SIZE = 20


@pytest.fixture(scope="module")
def swarm() -> Iterator[tuple[list[hivemind.DHT], hivemind.DHT]]:
    dht_stats.install()  # before the DHT processes fork
    config = DHTConfig(nat_port_map=False)
    dhts = [hivemind.DHT(start=True, **config.kwargs())]
    initial = [str(maddr) for maddr in dhts[0].get_visible_maddrs()]
    for _ in range(PEERS - 1):
        dhts.append(hivemind.DHT(start=True, **{**config.kwargs(), "initial_peers": initial}))
    control = hivemind.DHT(start=True, **{**config.kwargs(), "initial_peers": initial, "bucket_size": 20})
    for i in range(3):  # the control meets the swarm (lookups fill its routing table): once it asked only 11 of 14
        control.get(f"unknown{i}", latest=True)
    yield dhts, control
    for dht in (control, *reversed(dhts)):
        dht.shutdown()


def finds_of_one_lookup(dht: hivemind.DHT, key: str) -> int:
    before = dht_message_counts(dht)["find_sent"]
    found = dht.get(key, latest=True)
    assert found is not None and found.value == "value", found
    return dht_message_counts(dht)["find_sent"] - before


def test_a_lookup_asks_the_beam_not_the_whole_swarm(swarm):
    dhts, control = swarm
    assert DHTConfig().bucket_size == 8 and HIVEMIND_BUCKET_SIZE > PEERS
    for i in range(3):  # keys land near different peers
        key = f"lookup{i}"
        assert dhts[i].store(key, "value", get_dht_time() + 60)
        trahiv_finds = finds_of_one_lookup(dhts[-1 - i], key)
        hivemind_finds = finds_of_one_lookup(control, key)
        assert trahiv_finds <= 10, (key, trahiv_finds)
        assert hivemind_finds >= PEERS - 2, (key, hivemind_finds)  # (the control asks nearly every peer)
