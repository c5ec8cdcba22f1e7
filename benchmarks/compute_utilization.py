"""Benchmark 3, compute utilization: N trahiv peers (each its own process, namespace and shaped link, as in
averaging_round.py) train with a fixed compute time per local step while averaging runs in the background
(`delay_optimizer_step` + `delay_grad_averaging`); prints JSON with the fraction of wall time spent computing.

Run (as root):
    .venv/bin/python benchmarks/compute_utilization.py --peers 4 --bandwidth 100 --compute-s 0.5 --epochs 8

"Compute" is a sleep of --compute-s per local step (a GPU busy with forward/backward: it does not take this
machine's CPU), after which the step's gradients of P LoRA-shaped parameters (default 8M) are in `.grad` (set, as a
backward leaves them, without work on this machine's CPU; --copy-grads copies them there instead, 8 ms a local step
counted as time not computing: the measure before 2026-11-26) and handed to the swarm's optimizer.
Utilization = compute time / wall time over the collaborative steps after the first two (warm-up), up to
the end of the one before the last (peers leave as they reach the last).
Parameter averaging is synchronous in trahiv (delay_state_averaging is refused, see README), so it is moved out of
the measured window with --average-state-every (default: never within the run) and measured as its own cost.

DiLoCo mode (`--diloco H`, with `--overlap` to sync in the background): every peer is a DiLoCo worker
(trahiv.diloco.DiLoCoOptimizer, the Trainer's SGD as inner optimizer) that syncs its pseudo-gradients (fp16, the
default) every H local steps; utilization is measured from the end of the second outer step on, over --epochs outer
steps. Run (as root):
    .venv/bin/python benchmarks/compute_utilization.py --peers 4 --bandwidth 100 --compression fp16 --diloco 20 \
        --overlap --epochs 5
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from averaging_round import ROOT, Namespaces, lora_shapes, read_result, stop  # noqa: E402


def worker(spec: dict) -> None:
    import torch

    from trahiv.config import HivemindConfig
    from trahiv.swarm import Swarm, join_addresses, model_fingerprint

    torch.set_num_threads(1)
    if spec.get("debug"):  # trahiv's debug lines on stderr, each with the peer's rank and the time
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"peer {spec['rank']} %(created).3f %(message)s"))
        trahiv_logger = logging.getLogger("trahiv")
        trahiv_logger.addHandler(handler)
        trahiv_logger.setLevel(logging.DEBUG)
        trahiv_logger.propagate = False
    if spec.get("diloco"):
        return diloco_worker(spec)
    peers, batch = spec["peers"], 1
    config = HivemindConfig.model_validate({
        "dht": {"host_maddrs": [f"/ip4/{spec['host']}/tcp/0"], "initial_peers": spec["initial_peers"],
                "nat_port_map": False},
        "opt": {"run_id": "utilization", "target_batch_size": peers * spec["steps_per_epoch"] * batch,
                "batch_size_per_step": batch, "matchmaking_time": spec["matchmaking_time"],
                "delay_optimizer_step": True, "delay_grad_averaging": True, "min_peers": peers,
                "grad_compression": spec["compression"], "state_averaging_compression": spec["compression"],
                "average_state_every": spec["average_state_every"]},
    })  # fmt: skip
    swarm = Swarm(config, announce=lambda _: None)
    print(json.dumps({"maddrs": join_addresses(swarm.dht)}), flush=True)
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in lora_shapes(spec["params"])]
    named = [(f"p{i}", p) for i, p in enumerate(params)]
    swarm.check_model(model_fingerprint(named, params))  # with the weights: peers that hold the same download nothing
    optimizer = swarm.make_optimizer([{"params": params}], lambda groups: torch.optim.SGD(groups, lr=1e-3), None, batch)
    swarm.mark_ready()  # what trahiv.Trainer does when training begins (min_peers counts only peers marked ready)
    swarm.wait_for_peers()
    swarm.catch_up()
    marks = compute_loop(spec, params, lambda: optimizer.step(batch_size=batch), lambda: optimizer.local_epoch)
    rounds = swarm.metrics()
    swarm.shutdown()
    print(json.dumps({"rank": spec["rank"], "marks": marks, "metrics": rounds}), flush=True)


def compute_loop(spec: dict, params: list, step: Any, progress: Any) -> list[tuple[int, float, float, float, float]]:
    """Local steps of a fixed compute time (a sleep: forward + backward on an accelerator) until `progress()` (the
    collaborative or the outer step) reaches spec["epochs"]; a mark (progress, time, compute so far, time in `step()`
    so far, of it in the `step()` calls that moved the progress) whenever it moves."""
    import torch

    # two sets, in turn: a backward leaves each step's gradients in new tensors (the Trainer's model.zero_grad()
    # released the last ones), which the swarm may still read while the next batch computes
    grads = [[torch.randn_like(p) * 1e-3 for p in params] for _ in range(2)]
    marks: list[tuple[int, float, float, float, float]] = []
    compute = in_step = in_transitions = 0.0
    local_steps = 0
    deadline = time.monotonic() + spec["run_timeout"]
    while progress() < spec["epochs"] and time.monotonic() < deadline:
        time.sleep(spec["compute_s"])
        compute += spec["compute_s"]
        local_steps += 1
        for param, grad in zip(params, grads[local_steps % 2], strict=True):
            param.grad = grad.clone() if spec["copy_grads"] else grad  # (nothing in the swarm writes into .grad)
        started = time.perf_counter()
        before = progress()
        step()
        took = time.perf_counter() - started
        for param in params:
            param.grad = None  # the Trainer's model.zero_grad()
        in_step += took
        if progress() != before:
            in_transitions += took
            marks.append((progress(), time.perf_counter(), compute, in_step, in_transitions))
    return marks


def diloco_worker(spec: dict) -> None:
    import torch

    from trahiv.config import HivemindConfig
    from trahiv.diloco import DiLoCoOptimizer
    from trahiv.swarm import Swarm, join_addresses, model_fingerprint

    peers, batch = spec["peers"], 1
    config = HivemindConfig.model_validate({
        "dht": {"host_maddrs": [f"/ip4/{spec['host']}/tcp/0"], "initial_peers": spec["initial_peers"],
                "nat_port_map": False},
        "opt": {"run_id": "utilization_diloco", "target_batch_size": 1, "matchmaking_time": spec["matchmaking_time"],
                "min_peers": peers},
        "diloco": {"inner_steps": spec["diloco"], "overlap": spec["overlap"], "compression": spec["compression"]},
    })  # fmt: skip
    swarm = Swarm(config, announce=lambda _: None)
    print(json.dumps({"maddrs": join_addresses(swarm.dht)}), flush=True)
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in lora_shapes(spec["params"])]
    swarm.check_model(model_fingerprint([(f"p{i}", p) for i, p in enumerate(params)]))
    optimizer = DiLoCoOptimizer(swarm, [{"params": params}], lambda groups: torch.optim.SGD(groups, lr=1e-3), batch)
    swarm.mark_ready()
    swarm.wait_for_peers()
    optimizer.wait_for_records(peers - 1, timeout=60.0)
    optimizer.join()
    marks = compute_loop(spec, params, optimizer.step, lambda: optimizer.outer_step)
    optimizer.finish_pending_sync()
    metrics = optimizer.metrics()
    swarm.shutdown()  # (its DiLoCo optimizer too)
    print(json.dumps({"rank": spec["rank"], "marks": marks, "metrics": metrics}), flush=True)


def run(args: argparse.Namespace) -> dict:
    namespaces = Namespaces(args.peers) if args.bandwidth > 0 else None
    procs: list[subprocess.Popen] = []
    with namespaces or contextlib.nullcontext():
        if namespaces is not None:
            namespaces.shape(args.bandwidth)
        try:
            initial: list[str] = []
            for rank in range(args.peers):
                spec = {
                    "rank": rank, "peers": args.peers, "params": args.params, "compression": args.compression,
                    "steps_per_epoch": args.steps_per_epoch, "compute_s": args.compute_s, "epochs": args.epochs,
                    "matchmaking_time": args.matchmaking_time, "average_state_every": args.average_state_every,
                    "run_timeout": args.run_timeout, "initial_peers": initial, "diloco": args.diloco,
                    "overlap": args.overlap, "debug": args.debug, "copy_grads": args.copy_grads,
                    "host": namespaces.ip(rank) if namespaces else "127.0.0.1",
                }  # fmt: skip
                cmd = [sys.executable, __file__, "--worker", json.dumps(spec)]
                prefix = namespaces.wrap(rank) if namespaces else []
                procs.append(
                    subprocess.Popen(prefix + cmd, stdout=subprocess.PIPE, text=True, start_new_session=True, cwd=ROOT)
                )
                if rank == 0:
                    initial = json.loads(procs[0].stdout.readline() if procs[0].stdout else "")["maddrs"]
            outputs = [read_result(proc, args.run_timeout + 120) for proc in procs]
        finally:
            for proc in procs:
                stop(proc)
    return summarize(outputs, args)


def summarize(outputs: list[dict], args: argparse.Namespace) -> dict:
    peers = []
    for out in outputs:
        # from the end of collaborative step 2 to that of the step before the last: the last one ends as the others
        # leave (a peer still finishing it when they had left computed the rest of it alone: 48 samples, 26 s)
        marks = [m for m in out["marks"] if 2 <= m[0] <= args.epochs - 1]
        if len(marks) < 2:
            peers.append({"rank": out["rank"], "utilization": None, "marks": len(out["marks"]), **out["metrics"]})
            continue
        (_, t0, c0, s0, x0), (_, t1, c1, s1, x1) = marks[0], marks[-1]
        peers.append({
            "rank": out["rank"], "collaborative_steps_measured": marks[-1][0] - marks[0][0],
            "utilization": round((c1 - c0) / (t1 - t0), 4), "time_in_step_s": round(s1 - s0, 2),
            "of_it_in_transitions_s": round(x1 - x0, 2), "wall_s": round(t1 - t0, 2), **out["metrics"],
        })  # fmt: skip
    values = [p["utilization"] for p in peers if p["utilization"] is not None]
    return {"min_utilization": min(values, default=None), "peers": peers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--bandwidth", type=float, default=100.0, help="Mbit/s per link; 0 = loopback")
    parser.add_argument("--params", type=int, default=8 * 2**20)
    parser.add_argument("--compression", default="size_adaptive")
    parser.add_argument("--compute-s", type=float, default=0.5)
    parser.add_argument("--steps-per-epoch", type=int, default=16, help="local steps per peer per collaborative step")
    parser.add_argument("--epochs", type=int, default=7)
    parser.add_argument("--matchmaking-time", type=float, default=3.0)
    parser.add_argument("--average-state-every", type=int, default=1000)
    parser.add_argument("--run-timeout", type=float, default=400.0)
    parser.add_argument("--diloco", type=int, default=0, help="DiLoCo mode with this many inner steps (H)")
    parser.add_argument("--overlap", action="store_true", help="DiLoCo: sync in the background (`overlap`)")
    parser.add_argument("--debug", action="store_true", help="peers print trahiv's debug lines on stderr")
    parser.add_argument("--copy-grads", action="store_true", help="copy each local step's gradients into .grad")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    if args.bandwidth > 0 and os.geteuid() != 0:
        parser.error("shaped links need network namespaces: run as root, or use --bandwidth 0 (loopback)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    load_before, started = os.getloadavg(), time.time()
    result: dict[str, Any] = run(args)
    print(json.dumps({
        "benchmark": "compute_utilization", **{k: v for k, v in vars(args).items() if k != "worker"},
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()], "wall_s": round(time.time() - started, 1),
        "command": " ".join([Path(sys.executable).name, *sys.argv]), **result,
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
