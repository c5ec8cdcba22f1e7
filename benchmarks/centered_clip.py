"""Time per reduction of an 8M-parameter average from 4 senders: hivemind's reducer vs trahiv's robust reducer with
the mean and with CenteredClip, in-process (no network), parts of hivemind's default size (2^19 bytes).

Prints JSON. Run: .venv/bin/python benchmarks/centered_clip.py [--parameters 8000000] [--senders 4] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
from hivemind.averaging.partition import DEFAULT_PART_SIZE_BYTES, TensorPartReducer

from trahiv.averaging import Aggregation
from trahiv.engine.allreduce import RobustTensorPartReducer

__all__ = ["main", "time_reduction"]


def make_parts(parameters: int, senders: int, part_numel: int) -> list[list[torch.Tensor]]:
    """Each sender's gradient (honest ones close together, the last one scaled x1000), cut into parts."""
    base = torch.randn(parameters)
    vectors = [base + 0.1 * torch.randn(parameters) for _ in range(senders - 1)] + [base * 1e3]
    return [list(vector.split(part_numel)) for vector in vectors]


def time_reduction(make_reducer: Callable[[list[torch.Size], int], TensorPartReducer], parts: list[list]) -> float:
    """Seconds for one reduction: every sender streams all its parts concurrently, as in an all-reduce."""

    async def send(reducer: TensorPartReducer, sender: int) -> None:
        for index, part in enumerate(parts[sender]):
            await reducer.accumulate_part(sender, index, part, weight=1.0)

    async def run() -> float:
        reducer = make_reducer([part.shape for part in parts[0]], len(parts))
        start = time.perf_counter()
        await asyncio.gather(*(send(reducer, sender) for sender in range(len(parts))))
        return time.perf_counter() - start

    return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--parameters", type=int, default=8_000_000)
    parser.add_argument("--senders", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tau", type=float, default=1.0)
    parser.add_argument("--n-iters", type=int, default=20)
    args = parser.parse_args()

    torch.manual_seed(0)
    part_numel = DEFAULT_PART_SIZE_BYTES // 4
    parts = make_parts(args.parameters, args.senders, part_numel)
    clip = Aggregation("centered_clip", tau=args.tau, n_iters=args.n_iters)
    reducers: dict[str, Callable] = {
        "hivemind_mean": TensorPartReducer,
        "trahiv_mean": RobustTensorPartReducer,
        "trahiv_centered_clip": lambda shapes, n: RobustTensorPartReducer(shapes, n, aggregation=clip),
    }
    seconds: dict[str, list[float]] = {name: [] for name in reducers}
    for _ in range(args.repeats):  # alternate, so that every reducer sees the same machine state
        for name, make_reducer in reducers.items():
            seconds[name].append(time_reduction(make_reducer, parts))
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    result = {
        "parameters": args.parameters,
        "senders": args.senders,
        "parts": len(parts[0]),
        "part_numel": part_numel,
        "aggregation": {"tau": args.tau, "n_iters": args.n_iters},
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "seconds_per_reduction_median": {name: round(value, 4) for name, value in medians.items()},
        "seconds_per_reduction_all": {name: [round(v, 4) for v in values] for name, values in seconds.items()},
        "centered_clip_vs_hivemind_mean": round(medians["trahiv_centered_clip"] / medians["hivemind_mean"], 2),
        "trahiv_mean_vs_hivemind_mean": round(medians["trahiv_mean"] / medians["hivemind_mean"], 2),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
