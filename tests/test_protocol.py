"""The protocol's decisions (trahiv.protocol), in one process: which progress records to trust, when a peer missed the
swarm's round, which peers count as ready (trusted_epoch: tests/test_robust_aggregation.py)."""

from __future__ import annotations

from typing import Any

import pytest

from trahiv.protocol import (
    Contribution,
    expected_in_round,
    fills_shortfall,
    missed_round,
    own_share_done,
    ready_peers,
    seconds_to_target,
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


def samples_of_a_step(views: list[list[Contribution]], target: int, batch: int, done_rule: Any) -> int:
    """Peers compute a step as `_hold_at_share` does: peer i (`views[i][0]`) computes batches until `done_rule` says
    its share, from its own view of the records (`views[i]`), is done, then holds; once the records settled (every
    peer holding, all read the same records), the shortfall is filled by `fills_shortfall`. Returns the samples."""
    samples = []
    for view in views:  # view[0]: the peer itself
        share, total = share_of_target(target, view[0], view), batch
        while not done_rule(total, batch, share):
            total += batch
        samples.append(total)
    for _ in range(len(views)):  # settled: every peer's own latest record, the same for all
        settled = [view[0]._replace(samples=n) for view, n in zip(views, samples, strict=True)]
        filling = [fills_shortfall(c.peer, settled, target, batch) for c in settled]
        if not any(filling):
            break
        samples = [n + batch * f for n, f in zip(samples, filling, strict=True)]
    return sum(samples)


def test_peers_whose_views_of_the_rates_differ_still_compute_the_target():
    """tests/test_swarm.py took 20 samples for 16 once in four clean-clone runs: each peer rounds its share from the
    records as it read them, and a rate that changed between the two reads moved the shares across a rounding point
    (a debug run of the same test: a's share 9.7, b's 6.6, from two views). Over a sweep of rates and of the change
    between the views, two peers (batches of 4, target 16) and three (batches of 2, target 24) take exactly the
    target with `own_share_done`; the strict rule (no slack) overshoots in part of the sweep."""

    def steps(rule: Any) -> set[int]:
        seen = set()
        for rate_b in [x / 10 for x in range(40, 161)]:
            for change in (-0.06, -0.03, 0.03, 0.06):  # b's record as a read it: its rate a few % apart
                a, b = Contribution(b"a", 0, 10.0), Contribution(b"b", 0, rate_b)
                b_seen_by_a = b._replace(rate=rate_b * (1 + change))
                seen.add(samples_of_a_step([[a, b_seen_by_a], [b, a]], 16, 4, rule))
                c = Contribution(b"c", 0, 7.0)
                views = [[a, b_seen_by_a, c], [b, a, c], [c, a, b_seen_by_a]]
                seen.add(samples_of_a_step(views, 24, 2, rule))
        return seen

    assert steps(lambda n, batch, share: own_share_done(n, batch, share, alone=False)) == {16, 24}
    strict = steps(lambda n, batch, share: share_done(n, batch, share))
    assert strict - {16, 24}, "the sweep does not reach the case the slack is for"
    assert own_share_done(12, 4, 14.0, alone=True) is False  # alone, nobody else's view: the nearest multiple


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


def test_the_time_to_the_target_counts_the_peers_still_computing():
    """A peer that computed its share joins its round only once the swarm should reach the target within half of
    matchmaking_time (`SwarmOptimizer._join_round_if_near`): the time is what is missing over the rates of the peers
    still computing (rates 40, 20 and 10 samples a second, target 140: shares of 80, 40 and 20)."""
    now = 100.0
    a, b = Contribution(b"a", 80, 40.0, now), Contribution(b"b", 40, 20.0, now)
    c = Contribution(b"c", 0, 10.0, now)
    assert seconds_to_target([a, b, c], 140, 2, now) == pytest.approx(2.0)  # 20 missing at c's 10 a second
    assert seconds_to_target([a, b, c._replace(samples=16)], 140, 2, now) == pytest.approx(0.4)
    assert seconds_to_target([a, b._replace(samples=20), c], 140, 2, now) == pytest.approx(40 / 30)  # b computes too
    assert seconds_to_target([a, b, c._replace(samples=20)], 140, 2, now) == 0.0  # the target is reached
    # every peer stopped at its share short of the target (c silent for 5 s): nobody computes, the shortfall is filled
    assert seconds_to_target([a, b, c._replace(samples=10, time=now - 5.0)], 140, 2, now) == 0.0
    # no rate measured yet (hivemind reports 1e-20): far off, the round is joined as the step ends
    unmeasured = [p._replace(rate=1e-20) for p in (a, b, c)]
    assert seconds_to_target(unmeasured, 140, 2, now) > 1e6


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
