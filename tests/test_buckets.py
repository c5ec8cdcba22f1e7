"""Small tensors averaged as one (trahiv.engine.buckets): the plan, and rounds of averagers in their own processes on
loopback whose runner gets one flat tensor instead of many small ones, with the same result."""

from __future__ import annotations

import json
import os
import threading
from contextlib import ExitStack
from pathlib import Path

import hivemind
import pytest
import torch
from hivemind.compression import CompressionInfo
from hivemind.compression.base import TensorRole

from trahiv import engine
from trahiv.averaging.partial import Deadlines
from trahiv.compression import make_compression
from trahiv.engine.averagers import ReportingAverager
from trahiv.engine.buckets import Buckets, plan_buckets
from trahiv.engine.exact import ExactAverager, ExactRoundRunner

engine.apply()

PART = 2**15  # bytes: tensors under 32 KiB are bucketed


def test_small_float_tensors_share_a_bucket_per_dtype_and_role():
    tensors = [torch.zeros(100), torch.zeros(8_192), torch.zeros(50, dtype=torch.float16), torch.zeros(7),
               torch.zeros(9, dtype=torch.int64), torch.zeros(3, dtype=torch.float16)]  # fmt: skip
    assert plan_buckets(tensors, 3, part_size_bytes=PART) == [[0, 3], [1], [2, 5], [4]]
    roles = [TensorRole.PARAMETER] * 3 + [TensorRole.OPTIMIZER] + [TensorRole.PARAMETER] * 2
    infos = [CompressionInfo.from_tensor(t, key=i, role=r) for i, (t, r) in enumerate(zip(tensors, roles, strict=True))]
    assert plan_buckets(tensors, 3, part_size_bytes=PART, tensor_infos=infos) == [[0], [1], [2, 5], [3], [4]]


@pytest.mark.parametrize("name", ["scaled_fp16", "uniform8bit", "quantile8bit", "blockwise8bit", "size_adaptive"])
def test_codecs_with_one_scale_per_part_and_lone_peers_keep_every_tensor(name):
    tensors = [torch.zeros(100), torch.zeros(7)]
    assert plan_buckets(tensors, 3, compression=make_compression(name)) == [[0], [1]]
    assert plan_buckets(tensors, 1, compression=make_compression("fp16")) == [[0], [1]]
    assert plan_buckets(tensors, 2, compression=make_compression("fp16")) == [[0, 1]]


def test_results_are_written_back_into_the_original_tensors():
    originals = [torch.zeros(2, 3), torch.zeros(40_000), torch.zeros(4)]
    buckets = Buckets.make(originals, 3, part_size_bytes=PART)
    assert [t.shape for t in buckets.tensors] == [torch.Size([10]), torch.Size([40_000])] and buckets.bucketed
    assert buckets.tensors[1] is originals[1]
    buckets.tensors[0].copy_(torch.arange(10.0))
    buckets.write_back()
    assert originals[0].tolist() == [[0, 1, 2], [3, 4, 5]] and originals[2].tolist() == [6, 7, 8, 9]


class CountingRunner(ExactRoundRunner):
    """Records the tensors and parts the round's runner got (in the averager's process: to a file)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        container = self.tensor_part_container
        line = {"tensors": len(container.local_tensors), "parts": sum(container.num_parts_by_peer)}
        with open(os.environ["TRAHIV_TEST_RUNNER_LOG"], "a") as f:
            f.write(json.dumps(line) + "\n")


class CountingAverager(ReportingAverager, ExactAverager):
    """As the gradient rounds average: every peer ends with the same bits (trahiv.engine.exact)."""

    runner_cls = CountingRunner


SHAPES = [(8, 600), (600, 8)] * 12  # 24 LoRA-like tensors of 4,800 values


def local_values(rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    return [torch.randn(shape, generator=gen) * (rank + 1) for shape in SHAPES]


def average_once(tmp_path: Path, compression: str) -> tuple[list[list[torch.Tensor]], list[dict]]:
    """One round of 3 exact reporting averagers with `compression`: each peer's tensors after it, and what the
    runners got."""
    log = tmp_path / f"runners-{compression}.jsonl"
    os.environ["TRAHIV_TEST_RUNNER_LOG"] = str(log)  # read by the averager processes, forked below
    with ExitStack() as stack:
        first = hivemind.DHT(start=True, nat_port_map=False)
        stack.callback(first.shutdown)
        dhts = [first]
        for _ in range(2):
            dhts.append(hivemind.DHT(start=True, initial_peers=first.get_visible_maddrs(), nat_port_map=False))
            stack.callback(dhts[-1].shutdown)
        averagers = []
        for rank, dht in enumerate(dhts):
            averager = CountingAverager(
                local_values(rank), dht=dht, prefix=f"buckets-{compression}", target_group_size=3, min_group_size=3,
                min_matchmaking_time=2.0, request_timeout=1.0, part_size_bytes=PART, allreduce_timeout=60.0,
                compression=make_compression(compression), deadlines=Deadlines(assumed_bandwidth=50e6, floor=5.0),
                start=True,
            )  # fmt: skip
            stack.callback(averager.shutdown)
            averagers.append(averager)
        results: list = [None] * 3
        threads = [
            threading.Thread(target=lambda r=rank: results.__setitem__(r, averagers[r].step(timeout=45)), daemon=True)
            for rank in range(3)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert all(isinstance(result, dict) for result in results), results
        after = []
        for averager in averagers:
            with averager.get_tensors() as tensors:
                after.append([t.clone() for t in tensors])
    runners = [json.loads(line) for line in log.read_text().splitlines()]
    return after, runners


@pytest.mark.swarm
def test_a_round_of_small_tensors_averages_them_as_one_with_the_same_result(tmp_path):
    expected = [torch.stack(values).mean(0) for values in zip(*(local_values(r) for r in range(3)), strict=True)]
    after, runners = average_once(tmp_path, "none")
    # 460,800 bytes in parts of up to 32 KiB: 15 (tensor by tensor, each tensor of 19,200 bytes is a part: 24)
    assert runners == [{"tensors": 1, "parts": 15}] * 3, runners
    for tensors in after:
        assert [t.shape for t in tensors] == [torch.Size(s) for s in SHAPES]
        for got, want in zip(tensors, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(after[0], after[1], strict=True))  # every peer the same bits

    after, runners = average_once(tmp_path, "uniform8bit")  # the control: one scale per part, no bucket
    assert runners == [{"tensors": len(SHAPES), "parts": len(SHAPES)}] * 3, runners
