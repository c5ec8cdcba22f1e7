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

from trahiv.averaging import Aggregation, RobustTensorPartReducer, centered_clip
from trahiv.averaging.robust import weighted_median
from trahiv.config import HivemindConfig
from trahiv.swarm import trusted_epoch

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


def test_centered_clip_without_attackers_is_the_mean():
    parts = [torch.randn(50) for _ in range(4)]
    weights = [1.0, 2.0, 3.0, 4.0]
    mean = sum(w * p for w, p in zip(weights, parts, strict=True)) / sum(weights)
    assert torch.allclose(centered_clip(parts, weights, tau=100.0, n_iters=100), mean, atol=1e-4)


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
