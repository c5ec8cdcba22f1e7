"""What the averagers ask of the DHT while they look for a group and while they average (trahiv.engine.fixes, 7, and
trahiv.engine.allreduce). Each test runs hivemind's own behaviour as its control, in the same test.

- A peer that looks for a group and finds no leader better than itself: hivemind 1.1.12 looks the group key up
  again as soon as the previous lookup returned (~400 lookups a second on loopback); trahiv at most every
  MATCHMAKING_LOOKUP_PERIOD.
- A round of an averager that offers its state for download: hivemind redeclares that state in the DHT after every
  tensor it averaged (the priority, unchanged); trahiv's rounds do not.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import hivemind
import pytest
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.key_manager import GroupKeyManager

from trahiv import engine
from trahiv.engine import dht_stats
from trahiv.engine.averagers import ReportingAverager
from trahiv.engine.fixes import MATCHMAKING_LOOKUP_PERIOD

engine.apply()
SEARCH_S = 2.5  # how long the lone peer looks for a group
TENSORS = 48  # tensors averaged in one round (a model's parameters)


@pytest.fixture(scope="module")
def dhts() -> Iterator[list[hivemind.DHT]]:
    dht_stats.install()  # before the DHT processes fork
    first = hivemind.DHT(start=True, nat_port_map=False)
    second = hivemind.DHT(start=True, nat_port_map=False, initial_peers=first.get_visible_maddrs())
    yield [first, second]
    for dht in (second, first):
        dht.shutdown()


@contextlib.contextmanager
def hivemind_lookups() -> Iterator[None]:
    """hivemind's own GroupKeyManager.get_averagers, for averagers that fork in this block (the control)."""
    paced = GroupKeyManager.get_averagers
    GroupKeyManager.get_averagers = paced.__wrapped__  # type: ignore[attr-defined,method-assign]
    try:
        yield
    finally:
        GroupKeyManager.get_averagers = paced  # type: ignore[method-assign]


def lookups_while_alone(dht: hivemind.DHT, prefix: str) -> int:
    """Lookups of its group key by one averager that looks for a group for SEARCH_S seconds and finds nobody."""
    averager = ReportingAverager(
        [torch.zeros(4)], dht=dht, prefix=prefix, min_group_size=2, min_matchmaking_time=SEARCH_S - 0.5,
        request_timeout=0.5, start=True,
    )  # fmt: skip
    try:
        with pytest.raises(Exception, match="could not find a group"):
            averager.step(timeout=SEARCH_S)
    finally:
        averager.shutdown()
    return dht_stats.dht_request_counts(dht).get(f"get {prefix}.0b*", 0)


def test_a_peer_that_finds_no_group_looks_up_its_key_at_a_bounded_rate(dhts):
    paced = lookups_while_alone(dhts[0], "alone_paced")
    with hivemind_lookups():
        unpaced = lookups_while_alone(dhts[0], "alone_hivemind")
    bound = math.ceil(SEARCH_S / MATCHMAKING_LOOKUP_PERIOD) + 2
    assert 1 <= paced <= bound, (paced, bound)
    assert unpaced > 3 * bound, f"the control looked up its key only {unpaced} times: the test shows nothing"


def redeclarations_in_one_round(dhts: list[hivemind.DHT], cls: type, prefix: str) -> int:
    """Stores of the state-download key by two averagers (state sharing on) around one round of TENSORS tensors."""
    averagers = [
        cls(
            [torch.full((64,), float(i)) for _ in range(TENSORS)],
            dht=dht,
            prefix=prefix,
            min_group_size=2,
            target_group_size=2,
            min_matchmaking_time=1.0,
            request_timeout=0.5,
            start=True,
        )  # fmt: skip
        for i, dht in enumerate(dhts)
    ]
    key = f"store {prefix}.all_averagers"
    try:
        before = sum(dht_stats.dht_request_counts(dht).get(key, 0) for dht in dhts)
        controls = [averager.step(wait=False, timeout=15) for averager in averagers]
        for control in controls:
            control.result(timeout=20)
        with averagers[0].get_tensors() as tensors:
            assert all(torch.allclose(t, torch.full((64,), 0.5)) for t in tensors)  # the round did average
        return sum(dht_stats.dht_request_counts(dht).get(key, 0) for dht in dhts) - before
    finally:
        for averager in averagers:
            averager.shutdown()


def test_a_round_does_not_redeclare_the_averagers_state_after_every_tensor(dhts):
    trahiv_stores = redeclarations_in_one_round(dhts, ReportingAverager, "declare_trahiv")
    hivemind_stores = redeclarations_in_one_round(dhts, DecentralizedAverager, "declare_hivemind")
    assert trahiv_stores <= 2, trahiv_stores  # (a periodic redeclaration may fall into the round)
    assert hivemind_stores >= TENSORS // 2, f"the control stored {hivemind_stores} times: the test shows nothing"
