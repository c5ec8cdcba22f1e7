"""The protocol's decisions (trahiv.protocol), in one process: which progress records to trust, when a peer missed the
swarm's round, which peers count as ready (trusted_epoch: tests/test_robust_aggregation.py)."""

from __future__ import annotations

import pytest

from trahiv.protocol import (
    Contribution,
    expected_in_round,
    fills_shortfall,
    missed_round,
    ready_peers,
    share_done,
    share_of_target,
    silent_too_long,
    stopped_at_share,
)


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


def test_shares_follow_throughput_and_round_to_the_nearest_batch():
    a, b = Contribution(b"a", 0, 30.0), Contribution(b"b", 0, 10.0)
    assert share_of_target(32, a, [a, b]) == pytest.approx(24.0)
    assert share_of_target(32, b, [a, b]) == pytest.approx(8.0)
    unmeasured = Contribution(b"c", 0, 1e-20)  # hivemind's rate before a peer's first step: equal shares
    assert share_of_target(30, a, [a, b, unmeasured]) == pytest.approx(10.0)
    assert not share_done(0, 4, 1.0)  # every peer computes at least one batch
    assert share_done(8, 4, 9.9) and not share_done(8, 4, 10.1)  # the nearest multiple of the batch
    assert share_done(4, 4, 0.5)


def test_a_shortfall_is_filled_once_by_the_peers_furthest_below_their_share():
    peers = [Contribution(b"a", 6, 10.0), Contribution(b"b", 8, 10.0), Contribution(b"c", 8, 10.0)]  # target 24: 22
    assert [fills_shortfall(p.peer, peers, 24, 2) for p in peers] == [True, False, False]
    # 6 missing at 2 a batch: all three; with batches of 4, two (the furthest below, then by ID)
    peers = [Contribution(b"a", 6, 10.0), Contribution(b"b", 6, 10.0), Contribution(b"c", 6, 10.0)]
    assert [fills_shortfall(p.peer, peers, 24, 2) for p in peers] == [True, True, True]
    assert [fills_shortfall(p.peer, peers, 24, 4) for p in peers] == [True, True, False]
    assert not any(fills_shortfall(p.peer, peers, 18, 2) for p in peers)  # the target is reached: nobody


def test_a_peer_that_stopped_at_its_share_stays_done_while_the_rates_move():
    """benchmarks/convergence.py's step 14 (before): a peer stopped at 4 samples for a share of 4.98 (batches of 2);
    the next records put its share at 5.02, the others waited for a batch it would never compute, until a wait gave
    up 2.2 s later and the step overshot."""
    now = 100.0
    stopped = Contribution(b"a", 4, 30.0, now - 0.1)  # reported 0.1 s ago: not silent for long
    assert not share_done(4, 2, 5.02)  # the strict rule a peer stops by
    assert stopped_at_share(stopped, 2, 4.98, now) and stopped_at_share(stopped, 2, 5.02, now)
    assert stopped_at_share(stopped, 2, 5.49, now) and not stopped_at_share(stopped, 2, 5.51, now)  # slack: 1/4 batch
    # silent for 2 of its local steps (2 samples at 30/s: 0.067 s each) + 0.3 s: it stopped, whatever the share says
    assert stopped_at_share(stopped._replace(time=now - 0.44), 2, 8.0, now)
    assert not stopped_at_share(stopped._replace(time=now - 0.40), 2, 8.0, now)
    # a peer that has not computed a batch of this step yet (a slow start, an evaluation) is waited for
    assert not stopped_at_share(Contribution(b"b", 0, 30.0, now - 5.0), 2, 8.0, now)


def test_silence_counts_from_the_start_of_this_peers_step():
    """A peer that waited 2.5 s at the end of the last step for the others' reports, then averaged, reported nothing
    meanwhile: as this peer's next step begins, its record is 3 s old, and its first report of the step is still on
    its way. It was taken for gone (benchmarks/convergence.py: the fresh peers computed its part, steps of 56-92
    samples for 32); counted from the start of this peer's step, it is not, unless silent for the allowance since."""
    record_time, step_began, allowance = 100.0, 103.0, 1.7
    assert not silent_too_long(record_time, step_began, 103.3, allowance)  # 3.3 s after its record: not gone
    assert silent_too_long(record_time, step_began, 104.8, allowance)  # silent 1.8 s into this step: gone
    assert silent_too_long(100.0, 0.0, 101.8, allowance)  # a record older than the allowance in the same step


def test_expected_in_round_is_this_peer_and_the_trainers_at_the_step_or_behind_it():
    records = [(b"joining", 0), (b"finishing", 4), (b"at", 5), (b"ahead", 6), (b"behind", 2)]
    assert expected_in_round(b"me", records, 5) == [b"me", b"joining", b"finishing", b"at", b"behind"]
    assert expected_in_round(b"me", [], 0) == [b"me"]  # alone: fewer than two expects nobody (expect_peers)
