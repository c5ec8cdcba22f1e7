"""The protocol's decisions (trahiv.protocol), in one process: which progress records to trust, when a peer missed the
swarm's round, which peers count as ready (trusted_epoch: tests/test_robust_aggregation.py)."""

from __future__ import annotations

import pytest

from trahiv.protocol import missed_round, ready_peers


@pytest.mark.parametrize(
    ("local", "swarm", "in_group", "served", "expected"),
    [
        (3, 3, False, 3, False),  # the swarm has not moved on: average as usual
        (3, 4, False, 4, True),  # it moved on without this peer and serves its state: download it
        (3, 4, True, 4, False),  # this peer is in the round's group: the round waits for it
        (3, 4, False, 3, False),  # nobody serves step 4 (all peers in client mode): keep this peer's gradients
        (3, 6, False, 6, True),  # far behind
    ],
)
def test_missed_round(local, swarm, in_group, served, expected):
    assert missed_round(local, swarm, in_group=in_group, newest_served=served) is expected


def test_ready_peers_are_announced_and_tracked():
    own = "me"
    assert ready_peers([], [], own) == {"me"}
    # a Trainer that was built but has not started training is not announced as ready
    assert ready_peers(["me"], ["me", "built-only"], own) == {"me"}
    # announced ready, but its progress is not visible yet: the first step would not count its samples
    assert ready_peers(["me", "b"], ["me"], own) == {"me"}
    assert ready_peers(["me", "b", "c"], ["b", "c", "stale"], own) == {"me", "b", "c"}
