"""Robust aggregation, in-process: the reducer excludes garbage, CenteredClip bounds one sender's influence, the
config is strict, and forged progress records are not trusted."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from functools import partial

import pytest
import torch
from hivemind.averaging.partition import TensorPartReducer

from trahiv import protocol
from trahiv.averaging import Aggregation, centered_clip
from trahiv.averaging.robust import (
    all_finite,
    optimizer_state_mismatch,
    rejection_reason,
    reported_sample_caps,
    state_rejection_reason,
    weighted_median,
)
from trahiv.config import HivemindConfig
from trahiv.engine.allreduce import RobustTensorPartReducer
from trahiv.protocol import trusted_epoch

CLIP = Aggregation("centered_clip", tau=0.5, n_iters=50)


def reduce(make_reducer: Callable[[], TensorPartReducer], parts: list[list[torch.Tensor]], weights: list[float]):
    """Every sender sends all its parts concurrently, as in an all-reduce; returns what each sender got back."""

    async def send(reducer: TensorPartReducer, sender: int) -> list:
        results = []
        for index, part in enumerate(parts[sender]):
            try:
                results.append(await reducer.accumulate_part(sender, index, part, weight=weights[sender]))
            except Exception as e:
                results.append(e)
        return results

    async def run() -> list[list]:
        reducer = make_reducer()  # its futures belong to this event loop
        return list(await asyncio.gather(*(send(reducer, i) for i in range(len(parts)))))

    return asyncio.run(run())


def honest_parts(senders: int, seed: int = 0) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(6, generator=gen), torch.randn(3, generator=gen)] for _ in range(senders)]


def test_mean_matches_hivemind():
    parts, weights = honest_parts(3), [1.0, 2.5, 0.5]
    shapes = [p.shape for p in parts[0]]
    ours = reduce(partial(RobustTensorPartReducer, shapes, 3), parts, weights)
    theirs = reduce(partial(TensorPartReducer, shapes, 3), parts, weights)
    for sender in range(3):
        for a, b in zip(ours[sender], theirs[sender], strict=True):
            assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("aggregation", [Aggregation(), CLIP])
@pytest.mark.parametrize(("garbage", "weight"), [(float("nan"), 1.0), (float("inf"), 1.0), (1.0, float("nan")),
                                                 (1.0, -1.0), (1.0, float("inf"))])  # fmt: skip
def test_unusable_parts_are_excluded_and_logged(aggregation, garbage, weight, caplog):
    parts = honest_parts(3)
    parts.append([torch.full((6,), garbage), torch.full((3,), garbage)])
    reducer = partial(RobustTensorPartReducer, [p.shape for p in parts[0]], 4, aggregation=aggregation,
                      sender_names=["a", "b", "c", "EVIL"])  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="trahiv.averaging"):
        results = reduce(reducer, parts, [1.0, 1.0, 1.0, weight])
    honest_only = reduce(partial(RobustTensorPartReducer, [p.shape for p in parts[0]], 3, aggregation=aggregation),
                         parts[:3], [1.0] * 3)  # fmt: skip
    for got, expected in zip(results[0], honest_only[0], strict=True):
        assert torch.isfinite(got).all() and torch.allclose(got, expected, atol=1e-5)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "peer EVIL" in warnings[0], warnings  # once per round, by peer


def test_wrong_shape_is_excluded():
    parts = honest_parts(2)
    parts.append([torch.zeros(7), torch.zeros(3)])
    results = reduce(partial(RobustTensorPartReducer, [p.shape for p in parts[0]], 3), parts, [1.0] * 3)
    assert torch.allclose(results[0][0], (parts[0][0] + parts[1][0]) / 2)


def test_a_part_nobody_can_aggregate_fails_without_nan():
    parts = [[torch.full((4,), float("nan"))], [torch.full((4,), float("inf"))]]
    results = reduce(partial(RobustTensorPartReducer, [torch.Size([4])], 2), parts, [1.0, 1.0])
    assert all(isinstance(result[0], Exception) for result in results)


def test_centered_clip_bounds_one_senders_influence():
    gen = torch.Generator().manual_seed(1)
    honest = [torch.ones(1000) + 0.01 * torch.randn(1000, generator=gen) for _ in range(3)]
    truth = torch.stack(honest).mean(0)
    for attack in (honest[0] * 1e3, -10 * honest[0], torch.randn(1000, generator=gen) * 100):
        robust = centered_clip([*honest, attack], [1.0] * 4, tau=0.1, n_iters=50)
        mean = torch.stack([*honest, attack]).mean(0)
        assert (robust - truth).norm() <= 0.1  # at most ~tau * w_attacker / w_honest away
        assert (mean - truth).norm() > 10


def test_centered_clip_without_attackers_is_the_mean_with_weights_capped_at_the_median():
    parts = [torch.randn(50) for _ in range(4)]
    mean = (1 * parts[0] + 2 * parts[1] + 2 * parts[2] + 2 * parts[3]) / 7  # weights 3 and 4 capped at the median, 2
    assert torch.allclose(centered_clip(parts, [1.0, 2.0, 3.0, 4.0], tau=100.0, n_iters=100), mean, atol=1e-4)
    weights = [1.0, 2.0, 2.0]  # none above the median: the weighted mean
    mean = sum(w * p for w, p in zip(weights, parts, strict=False)) / sum(weights)
    assert torch.allclose(centered_clip(parts[:3], weights, tau=100.0, n_iters=100), mean, atol=1e-4)


def test_centered_clip_is_not_bought_with_weight():
    """A Byzantine copy with as much weight as all the honest ones together, or far more, stays an outlier: its weight
    is capped at the median copy's (without the cap, it is the weighted median of half the coordinates at least)."""
    gen = torch.Generator().manual_seed(2)
    honest = [torch.ones(1000) + 0.01 * torch.randn(1000, generator=gen) for _ in range(3)]
    truth = torch.stack(honest).mean(0)
    for attack_weight in (3.0, 30.0, 3e6):
        for attack in (honest[0] * 1e3, -10 * honest[0], torch.randn(1000, generator=gen) * 100):
            robust = centered_clip([*honest, attack], [1.0, 1.0, 1.0, attack_weight], tau=0.1, n_iters=50)
            assert (robust - truth).norm() <= 0.1, (attack_weight, (robust - truth).norm())


def test_weighted_median():
    stacked = torch.tensor([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0]])
    assert weighted_median(stacked, torch.tensor([1.0, 1.0, 1.0])).tolist() == [2.0, 20.0]
    assert weighted_median(stacked, torch.tensor([0.1, 0.1, 5.0])).tolist() == [3.0, 30.0]


def test_aggregation_config():
    opt = {"run_id": "run", "target_batch_size": 100}
    config = HivemindConfig.load({"opt": opt})
    assert config.opt.aggregation.name == "mean"
    config = HivemindConfig.load({"opt": {**opt, "aggregation": {"name": "centered_clip", "tau": 0.1, "n_iters": 5}}})
    assert Aggregation(**config.opt.aggregation.model_dump()) == Aggregation("centered_clip", 0.1, 5)
    assert "aggregation" in config.opt.TRAHIV_ONLY
    for bad, message in [({"name": "median"}, "aggregation.name"), ({"tau": 0}, "greater than 0"),
                         ({"tau": float("inf")}, "aggregation.tau"), ({"n_iters": 0}, "aggregation.n_iters"),
                         ({"taus": 1.0}, "did you mean 'tau'")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            HivemindConfig.load({"opt": {**opt, "aggregation": bad}})


@pytest.mark.parametrize(
    ("epochs", "local", "limit"),
    [
        ([3, 3, 10**9], 3, 4),  # one forged record: not trusted
        ([5, 5, 0], 0, 5),  # a late joiner: two peers agree
        ([5, 5, 5, 0, 10**9], 0, 5),  # a late joiner and a forger: the honest majority wins
        ([5, 0], 0, 1),  # one peer far ahead: checked by a state download instead
        ([10**9, 10**9, 3, 3, 3, 3], 3, 4),  # two forgers but no majority
    ],
)
def test_trusted_epoch(epochs, local, limit):
    assert trusted_epoch(epochs, local) == limit


def test_weights_are_clamped_to_their_caps(caplog):
    parts, weights = honest_parts(3), [4.0, 4.0, 4000.0]
    shapes = [p.shape for p in parts[0]]
    with caplog.at_level(logging.WARNING, logger="trahiv.averaging"):
        clamped = reduce(partial(RobustTensorPartReducer, shapes, 3, weight_caps=[9.0, 9.0, 9.0]), parts, weights)
    expected = reduce(partial(RobustTensorPartReducer, shapes, 3), parts, [4.0, 4.0, 9.0])
    unclamped = reduce(partial(RobustTensorPartReducer, shapes, 3), parts, weights)
    for got, want, bad in zip(clamped[0], expected[0], unclamped[0], strict=True):
        assert torch.allclose(got, want, atol=1e-6)
        assert not torch.allclose(got, bad, atol=1e-3)
    assert [r.message for r in caplog.records if "Clamping" in r.message] == [
        "Clamping the weight of peer 2 from 4000 to 9: more than the samples it reported"
    ]


def test_reported_sample_caps():
    from hivemind.p2p import PeerID
    from hivemind.utils.timed_storage import ValueWithExpiration

    a, b, c = (PeerID(bytes([18, 32, *([i] * 32)])) for i in (1, 2, 3))

    def record(peer: PeerID, samples: float, rate: float, at: float) -> ValueWithExpiration:
        value = dict(peer_id=peer.to_bytes(), samples_accumulated=samples, samples_per_second=rate, time=at, epoch=1)
        return ValueWithExpiration(value, at + 60)

    now = 1000.0
    records = {
        b"k1": record(a, 10, 2.0, now - 5),  # extrapolated: 10 + 2 x 5 = 20
        b"k2": record(b, 30, 0.0, now - 1000),  # extrapolation is bounded: 30
        b"k3": record(b, 0, 0.0, now),  # a forged low record for b does not lower its cap
        b"k4": ValueWithExpiration({"peer_id": a.to_bytes(), "samples_accumulated": float("nan")}, now),
        b"k5": ValueWithExpiration("garbage", now),
    }
    caps = reported_sample_caps(records, [a, b, c], now)
    assert caps == {a: 1.25 * 20 + 1, b: 1.25 * 30 + 1, c: 1.25 * 20 + 1}  # c reported nothing: the smallest cap
    assert reported_sample_caps({}, [a, b], now) == {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_part_with_any_nan_or_inf_is_rejected_and_huge_finite_values_are_not(dtype):
    """`all_finite` (the smallest and largest value) in place of a float64 sum: NaN, +inf and -inf anywhere are caught,
    values whose sum would overflow the dtype are not mistaken for non-finite ones, and an empty part is fine."""
    good = torch.linspace(-3, 3, 1000).to(dtype)
    assert all_finite(good) and rejection_reason(good, 1.0, good.shape) is None
    assert all_finite(torch.zeros(0, dtype=dtype))
    huge = torch.full((1000,), torch.finfo(dtype).max, dtype=dtype)
    assert float(huge.sum()) == float("inf") and all_finite(huge)  # (a sum in the dtype would have said "non-finite")
    for bad in (float("nan"), float("inf"), float("-inf")):
        for where in (0, 499, 999):
            part = good.clone()
            part[where] = bad
            assert not all_finite(part), (bad, where)
            assert rejection_reason(part, 1.0, part.shape) == "non-finite values (nan/inf)"


def test_state_rejection_reason():
    good = [torch.zeros(2, 3), torch.ones(4), torch.tensor([1, 2])]
    shapes = [(2, 3), (4,), (2,)]
    meta = {"epoch": 3, "protocol": protocol.WIRE_PROTOCOL}
    assert state_rejection_reason(meta, good, shapes) is None
    assert state_rejection_reason(meta, good, None) is None
    nan = [good[0], torch.tensor([1.0, float("nan"), 0.0, 0.0]), good[2]]
    assert state_rejection_reason(meta, nan, shapes) == "tensor 1 holds non-finite values"
    assert state_rejection_reason(meta, good[:2], shapes) == "2 tensors where this model has 3"
    assert state_rejection_reason(meta, [torch.zeros(3, 2), *good[1:]], shapes) == (
        "tensor 0 has shape (3, 2), expected (2, 3)"
    )
    assert state_rejection_reason({**meta, "epoch": -1}, good, shapes) == "epoch -1 is not a non-negative integer"
    assert state_rejection_reason({**meta, "epoch": True}, good, shapes) == "epoch True is not a non-negative integer"
    assert state_rejection_reason([1, 2], good, shapes) == "metadata is a list, not a dict"
    assert state_rejection_reason({"epoch": 3}, good, shapes).startswith(
        "it carries no wire protocol (a plain hivemind"
    )
    other = {**meta, "protocol": protocol.WIRE_PROTOCOL + 1}
    assert state_rejection_reason(other, good, shapes) == (
        f"it is of wire protocol {protocol.WIRE_PROTOCOL + 1}, this peer's is {protocol.WIRE_PROTOCOL} (another trahiv "
        "version)"
    )


def test_optimizer_state_mismatch():
    ours = ["value", "tensor", "tensor", "value"]
    served = [{"type": "value", "value": 0.1}, {"type": "tensor", "index": 1}, {"type": "tensor", "index": 0},
              {"type": "value", "value": None}]  # fmt: skip
    assert optimizer_state_mismatch(ours, served, 2) is None
    assert optimizer_state_mismatch(ours, None, 2) == "it has no optimizer state"
    assert optimizer_state_mismatch(ours, served[:3], 2) == (
        "its optimizer state has 2 tensors and 1 values, this peer's optimizer 2 and 2 (another optimizer, or other "
        "optimizer settings)"
    )
    assert optimizer_state_mismatch(ours, [*served, {"type": "value", "value": 1}], 2) is not None  # one leaf more
    assert optimizer_state_mismatch(ours, served, 1) == "its optimizer state refers to tensor 1 of 1"
    assert optimizer_state_mismatch(ours, [served[0], {"type": "tensor", "index": "0"}, *served[2:]], 2) is not None
    assert optimizer_state_mismatch(ours, [{"type": "value"}, *served[1:]], 2) == (
        "its optimizer state has a value without one"
    )


def test_a_peer_past_the_rounds_step_is_capped_by_the_target_not_its_new_record():
    """A peer that finished the round's step (background averaging, a slow groupmate) reports the next step's few
    samples: read as its contribution, its 16 samples were clamped to ~1.2 (benchmarks/compute_utilization.py)."""
    from hivemind.p2p import PeerID
    from hivemind.utils.timed_storage import ValueWithExpiration

    a, b, c = (PeerID(bytes([18, 32, *([i] * 32)])) for i in (1, 2, 3))
    now = 1000.0

    def record(peer: PeerID, samples: float, epoch: int) -> ValueWithExpiration:
        value = dict(
            peer_id=peer.to_bytes(), samples_accumulated=samples, samples_per_second=0.0, time=now, epoch=epoch
        )
        return ValueWithExpiration(value, now + 60)

    records = {b"a": record(a, 16, 7), b"b": record(b, 0, 8), b"c": record(c, 12, 6)}  # b moved on; c is behind
    assert reported_sample_caps(records, [a, b, c], now) == {a: 21.0, b: 1.0, c: 16.0}  # b clamped to nothing
    caps = reported_sample_caps(records, [a, b, c], now, round_epoch=7, step_cap=1.25 * 32 + 1)
    assert caps == {a: 21.0, b: 41.0, c: 16.0}
    assert reported_sample_caps(records, [a, b, c], now, round_epoch=7)[b] == 21.0  # no target: the others' largest
    wrapped = {b"a": record(a, 16, 2**16 + 3), b"b": record(b, 0, 2**16 + 4)}  # steps compared as matchmaking keys
    assert reported_sample_caps(wrapped, [a, b], now, round_epoch=3, step_cap=41.0) == {a: 21.0, b: 41.0}


def test_no_peer_is_capped_above_what_a_whole_step_holds():
    """With the step's target known, a record's samples or rate (forged, or extrapolated over a second or more) cannot
    lift its peer's cap above WEIGHT_SLACK x target + 1; a record within the step keeps its own cap."""
    from hivemind.p2p import PeerID
    from hivemind.utils.timed_storage import ValueWithExpiration

    a, b, c, d = (PeerID(bytes([18, 32, *([i] * 32)])) for i in (1, 2, 3, 4))
    now, step_cap = 1000.0, 1.25 * 64 + 1

    def record(peer: PeerID, samples: float, rate: float, at: float) -> ValueWithExpiration:
        value = dict(peer_id=peer.to_bytes(), samples_accumulated=samples, samples_per_second=rate, time=at, epoch=1)
        return ValueWithExpiration(value, at + 60)

    records = {
        b"a": record(a, 8, 79.0, now - 1),  # a second's extrapolation past the step: 87 samples
        b"b": record(b, 8, 1e12, now - 1),  # a forged rate
        b"c": record(c, 1e9, 0.0, now),  # forged samples
        b"d": record(d, 8, 4.0, now - 1),  # within the step: 12 samples
    }
    assert reported_sample_caps(records, [a, b, c, d], now)[b] > 1e12  # (without the step's target: unbounded)
    caps = reported_sample_caps(records, [a, b, c, d], now, round_epoch=1, step_cap=step_cap)
    assert caps == {a: step_cap, b: step_cap, c: step_cap, d: 1.25 * 12 + 1}


def test_the_tracker_hands_a_round_each_peers_latest_record():
    """SwarmOptimizer gives its gradient averager, for the round of step k, each peer's latest record: a peer that
    already moved on is capped by the target, not by what was last read of its step k, which may be stale: here b's
    announcement (0 samples) of step 7, read before its reports of 8 samples, would cap it at 1."""
    from types import SimpleNamespace

    from hivemind.p2p import PeerID
    from hivemind.utils.timed_storage import ValueWithExpiration

    from trahiv.engine.optimizer import SwarmProgressTracker

    tracker = object.__new__(SwarmProgressTracker)  # only its record memory: no DHT
    tracker._latest, tracker.local_progress = {}, SimpleNamespace(epoch=7)
    ids = {name: PeerID(name.encode() * 8) for name in "abcd"}

    def fetch(**peers: tuple[int, int]) -> None:
        tracker._remember_latest({
            name.encode(): ValueWithExpiration({"peer_id": ids[name].to_bytes(), "epoch": epoch,
                                                "samples_accumulated": n, "samples_per_second": 1e-20, "time": 0.0}, 0)
            for name, (epoch, n) in peers.items()
        })  # fmt: skip

    fetch(a=(7, 4), b=(7, 0), c=(5, 3), d=(4, 1))
    fetch(a=(7, 8), b=(8, 4), c=(6, 2))  # b finished step 7 (and carried 4 samples over); c, behind, is at step 6
    fetch(a=(7, 8), b=(7, 0), c=(6, 2))  # a lagging replica's older record of b
    records = tracker.records_for_round()
    by_peer = {entry.value["peer_id"]: (entry.value["epoch"], entry.value["samples_accumulated"]) for entry in
               records.values()}  # fmt: skip
    assert by_peer == {ids["a"].to_bytes(): (7, 8), ids["b"].to_bytes(): (8, 4), ids["c"].to_bytes(): (6, 2)}
    caps = reported_sample_caps(records, [ids["a"], ids["b"], ids["c"]], 0.0, round_epoch=7, step_cap=21.0)
    assert caps == {ids["a"]: 11.0, ids["b"]: 21.0, ids["c"]: 3.5}  # (d, 3 steps behind, is forgotten)
