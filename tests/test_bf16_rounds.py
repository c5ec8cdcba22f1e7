"""bf16 tensors averaged between two averagers in their own processes (a model loaded in bf16 and trained with
offload_optimizer=False sends them): the codecs the Trainer lets through complete the round, and hivemind's fp16
codecs, which the Trainer refuses for bf16 (tests/test_trainer_alone.py), fail it."""

from __future__ import annotations

import hivemind
import pytest
import torch
from swarm_helpers import step_together

from trahiv import engine
from trahiv.averaging.partial import Deadlines
from trahiv.compression import make_compression
from trahiv.engine.averagers import ReportingAverager
from trahiv.engine.exact import ExactAverager, ExactRoundRunner

engine.apply()
pytestmark = pytest.mark.swarm


class ExactReportingAverager(ReportingAverager, ExactAverager):
    runner_cls = ExactRoundRunner


def average_bf16(name: str, floor: float = 5.0) -> tuple[list, list[torch.Tensor], list[str]]:
    """One round of 2 peers with `name`; each peer's step result, peer 0's tensors after it, its round reports."""
    first = hivemind.DHT(start=True, nat_port_map=False)
    second = hivemind.DHT(start=True, initial_peers=first.get_visible_maddrs(), nat_port_map=False)
    gen = torch.Generator().manual_seed(0)
    values = [[torch.full((1000,), float(rank + 1)), torch.randn(70_000, generator=gen)] for rank in range(2)]
    averagers = [
        ExactReportingAverager(
            [t.bfloat16() for t in values[rank]],
            dht=dht,
            prefix=f"bf16-{name}",
            target_group_size=2,
            min_group_size=2,
            min_matchmaking_time=2.0,
            request_timeout=1.0,
            compression=make_compression(name),
            deadlines=Deadlines(assumed_bandwidth=50e6, floor=floor),
            start=True,
        )  # fmt: skip
        for rank, dht in enumerate((first, second))
    ]
    try:
        results, _ = step_together(averagers, [40, 40])
        with averagers[0].get_tensors() as tensors:
            after = [t.clone() for t in tensors]
        reports = [report.status for report in averagers[0].round_reports()]
    finally:
        for averager in averagers:
            averager.shutdown()
        first.shutdown()
        second.shutdown()
    return results, after, reports


@pytest.mark.parametrize("name", ["none", "uniform8bit", "blockwise8bit"])
def test_bf16_tensors_are_averaged(name):
    results, after, reports = average_bf16(name)
    assert all(isinstance(result, dict) for result in results), results
    assert reports == ["complete"], reports
    assert after[0].dtype == torch.bfloat16 and after[0].float().tolist() == [1.5] * 1000  # exact in bf16


def test_fp16_cannot_carry_bf16_tensors():
    """The reason the Trainer refuses fp16, scaled_fp16 and size_adaptive for bf16 trainable parameters."""
    results, after, reports = average_bf16("fp16", floor=1.0)  # a round that fails anyway: a short deadline
    assert not any(isinstance(result, dict) for result in results), results
    assert after[0].float().tolist() == [1.0] * 1000  # this peer's own values kept
