"""Rounds lost to early-ending streams: two averagers on 127.0.0.1 (the second in client mode, as in a swarm with a peer
behind NAT) average 3.5M values round after round while busy processes load the CPU, once with hivemind's all-reduce
runner and once with trahiv's (the sender closes each stream once it has every part; the reducer waits for that).

With hivemind's runner, a reducer's handler returns after its last part, its p2pd resets the stream, and on a busy CPU
the client then received only k of n parts, without an error: a partial round. Counts rounds whose client raised
"sent k parts, but we expected n" (read from the averagers' DEBUG logs) and rounds that were not complete.

Prints JSON. Run: .venv/bin/python benchmarks/stream_end.py [--rounds 400] [--load 3] [--runner both|hivemind|trahiv]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["main", "run_rounds"]

NUMEL = 3_500_000  # about a 2-layer GPT-2's trainable values: 27 parts of 2^19 bytes


def busy() -> None:
    deadline = time.monotonic() + 3600
    while time.monotonic() < deadline:
        pass


def run_rounds(runner: str, rounds: int) -> dict:
    """Child process body: `rounds` averaging rounds with `runner`; prints the result as JSON on its last line."""
    import logging

    import hivemind
    import torch
    from hivemind.averaging import DecentralizedAverager

    from trahiv import engine
    from trahiv.averaging.robust import MEAN
    from trahiv.engine.allreduce import run_robust_allreduce_

    engine.apply()
    logging.basicConfig(format="%(name)s %(message)s")
    logging.getLogger("trahiv.averaging").setLevel(logging.DEBUG)  # trahiv's runner logs a short stream at DEBUG too

    class TrahivAverager(DecentralizedAverager):
        async def _run_allreduce_inplace_(self, tensors, group_info, **kwargs):
            await run_robust_allreduce_(self, MEAN, tensors, group_info, **kwargs)

    cls = TrahivAverager if runner == "trahiv" else DecentralizedAverager
    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False)
    second = hivemind.DHT(start=True, initial_peers=first.get_visible_maddrs(), client_mode=True, nat_port_map=False)
    common = dict(prefix="stream_end", target_group_size=2, min_group_size=2, min_matchmaking_time=1.0,
                  request_timeout=0.5, start=True)  # fmt: skip
    a = cls([torch.randn(NUMEL)], dht=first, **common)
    b = cls([torch.randn(NUMEL)], dht=second, client_mode=True, **common)
    failed, started = 0, time.perf_counter()
    try:
        for _ in range(rounds):
            futures = a.step(wait=False, timeout=30), b.step(wait=False, timeout=30)
            try:
                if any(future.result() is None for future in futures):
                    failed += 1
            except Exception:
                failed += 1
    finally:
        for process in (a, b, first, second):
            process.shutdown()
    return {"rounds": rounds, "rounds_failed": failed, "seconds": round(time.perf_counter() - started, 1)}


def measure(runner: str, rounds: int, load: int) -> dict:
    env = {**os.environ, "HIVEMIND_LOGLEVEL": "DEBUG"}  # the engine logs a reducer's missing parts at DEBUG only
    hogs = [mp.Process(target=busy, daemon=True) for _ in range(load)]
    for hog in hogs:
        hog.start()
    try:
        with tempfile.TemporaryFile("w+") as log:
            command = [sys.executable, __file__, "--child", runner, "--rounds", str(rounds)]
            subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, check=True, timeout=3600)
            log.seek(0)
            text = log.read()
    finally:
        for hog in hogs:
            hog.kill()
    result = json.loads(text.strip().splitlines()[-1])
    truncated = re.findall(r"Caught AllreduceException\('peer \S+ sent \d+ parts, but we expected \d+'", text)
    partial = len(re.findall(r"Averaging: received [\d.]+% results", text))
    cut = len(truncated)
    return {"runner": runner, **result, "cpu_hogs": load, "streams_cut_short": cut, "partial_rounds": partial}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--load", type=int, default=3, help="busy processes beside the two peers")
    parser.add_argument("--runner", choices=["both", "hivemind", "trahiv"], default="both")
    parser.add_argument("--child", choices=["hivemind", "trahiv"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_rounds(args.child, args.rounds)), flush=True)
        return
    runners = ["hivemind", "trahiv"] if args.runner == "both" else [args.runner]
    results = [measure(runner, args.rounds, args.load) for runner in runners]
    print(json.dumps({"benchmark": "stream_end", "values": NUMEL, "results": results}, indent=2))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
