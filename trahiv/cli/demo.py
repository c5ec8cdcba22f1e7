"""`trahiv demo`: a whole swarm on this machine. A bootstrap peer and N trainer peers (separate processes on
127.0.0.1) fine-tune a small GPT-2 built from a config on text shipped with trahiv, then print a summary."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PEER_START_TIMEOUT = 90.0


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("demo", help="train a small GPT-2 with a local swarm of peers on 127.0.0.1")
    parser.add_argument("--peers", type=int, default=2, help="number of trainer peers (>= 1)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 4], help="per-peer batch sizes (cycled)")
    parser.add_argument("--max-steps", type=int, default=10, help="collaborative steps to train")
    parser.add_argument("--target-batch-size", type=int, default=192, help="global samples per collaborative step")
    parser.add_argument("--matchmaking-time", type=float, default=2.0, help="seconds to form an averaging group")
    parser.add_argument("--run-id", default="trahiv_demo", help="swarm name")
    parser.add_argument("--workdir", default=None, help="where to write data, logs and outputs (default: a temp dir)")
    parser.add_argument("--timeout", type=float, default=600.0, help="stop everything after this many seconds")
    parser.add_argument("--dashboard-port", type=int, default=0, help="dashboard port (0: any free one)")
    parser.add_argument("--no-dashboard", action="store_true", help="run no auxiliary peer (and so no dashboard)")
    parser.add_argument(
        "--diloco", type=int, default=0, metavar="H",
        help="DiLoCo mode: each peer trains alone and the swarm syncs every H local steps (--max-steps counts local "
        "steps; the dashboard shows each peer's outer step and bytes, its loss curve one point per outer step)",
    )  # fmt: skip
    parser.add_argument("--role", choices=["swarm", "trainer"], default="swarm", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--batch-size", type=int, default=8, help=argparse.SUPPRESS)
    parser.add_argument("--initial-peers", nargs="*", default=[], help=argparse.SUPPRESS)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.peers < 1 or args.max_steps < 1 or args.target_batch_size < 1 or min(args.batch_sizes) < 1:
        raise ValueError("--peers, --batch-sizes, --max-steps and --target-batch-size must be positive")
    return run_trainer(args) if args.role == "trainer" else run_swarm(args)


# --- the orchestrator ---------------------------------------------------------------------------------------------


def run_swarm(args: argparse.Namespace) -> int:
    from trahiv.demo import prepare_workdir

    threads = _threads_from_env() or trainer_threads(args.peers)  # a bad OMP_NUM_THREADS fails before any work
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="trahiv-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    aux_peer = "" if args.no_dashboard else " + 1 auxiliary peer (dashboard)"
    print(f"trahiv demo: {args.peers} trainer peers + 1 bootstrap peer{aux_peer} on 127.0.0.1, working in {workdir}",
          flush=True)  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    trainer_env = {**env, "OMP_NUM_THREADS": str(threads)}
    command = [sys.executable, "-m", "trahiv.cli.main"]
    addresses_file = workdir / "initial_peers.json"
    addresses_file.unlink(missing_ok=True)  # a re-run in the same workdir: never join the last run's stopped peer
    processes: list[subprocess.Popen] = []
    deadline = time.monotonic() + args.timeout
    try:
        # the bootstrap peer starts (imports, p2p daemon: ~3 s) while this process makes the tokenizer, weights and
        # data: one after the other, the demo waited for both
        processes.append(
            subprocess.Popen(
                [*command, "dht", "--no-nat-port-map", "--addresses-file", str(addresses_file)],
                env=env,
                stdout=subprocess.DEVNULL,
            )
        )
        prepare_workdir(workdir)
        print(f"Each trainer computes with {trainer_env['OMP_NUM_THREADS']} thread(s) (OMP_NUM_THREADS)", flush=True)
        initial_peers = _wait_for_addresses(addresses_file, processes[0])
        print(f"Bootstrap peer is up. To join the training, use initial_peers = {initial_peers}", flush=True)
        aux = None if args.no_dashboard else _start_aux(command, env, workdir, args, initial_peers)
        processes += [aux] if aux else []
        trainers = []
        for index in range(args.peers):
            batch_size = args.batch_sizes[index % len(args.batch_sizes)]
            log = open(workdir / f"peer{index}.log", "w")
            trainer_args = [
                *command, "demo", "--role", "trainer", "--workdir", str(workdir), "--index", str(index),
                "--batch-size", str(batch_size), "--max-steps", str(args.max_steps),
                "--target-batch-size", str(args.target_batch_size), "--matchmaking-time", str(args.matchmaking_time),
                "--run-id", args.run_id, "--peers", str(args.peers), "--diloco", str(args.diloco),
                "--initial-peers", *initial_peers,
            ]  # fmt: skip
            trainers.append(subprocess.Popen(trainer_args, env=trainer_env, stderr=log))
            processes.append(trainers[-1])
        if aux is not None:
            url = _wait_for_dashboard(workdir / "auxiliary.log", aux)
            print(f"Dashboard (live while the demo runs): {url}", flush=True)
        codes = [_wait(p, deadline) for p in trainers]
    finally:
        for process in reversed(processes):
            _stop(process)
    return _summarize(workdir, args, codes)


def trainer_threads(peers: int) -> int:
    """Compute threads for each of `peers` trainers sharing this machine: its cores split between them. Each torch
    process otherwise starts a thread per core; on 2 cores two trainers' 4 threads took turns so unevenly that one
    trainer made 65% of the samples whichever its batch size, and the swarm made 159 samples/s where one thread each
    made 234 (`trahiv demo --max-steps 4 --target-batch-size 96`, nothing else running)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, peers))


def _threads_from_env() -> int | None:
    """OMP_NUM_THREADS as the user set it (None if unset); a value that is not a positive whole number is an error."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(
            f"OMP_NUM_THREADS={value!r} is not a positive whole number: set it to the threads each trainer should "
            "compute with, or unset it (the demo then splits this machine's cores between its trainers)"
        )
    return int(value)


def _wait_for_addresses(path: Path, process: subprocess.Popen) -> list[str]:
    deadline = time.monotonic() + PEER_START_TIMEOUT
    while time.monotonic() < deadline:
        if path.exists() and path.stat().st_size > 0:
            return json.loads(path.read_text())
        if process.poll() is not None:
            raise RuntimeError(f"the bootstrap peer exited with code {process.returncode}")
        time.sleep(0.2)
    raise RuntimeError(f"the bootstrap peer did not start within {PEER_START_TIMEOUT:.0f} s")


def _start_aux(
    command: list[str], env: dict[str, str], workdir: Path, args: argparse.Namespace, initial_peers: list[str]
) -> subprocess.Popen:
    """An auxiliary peer with the dashboard: trainers' metrics go to workdir/auxiliary (SQLite, TensorBoard). With
    --diloco it follows the DiLoCo swarm from the start (the trainers' `diloco` section): its steps are outer steps."""
    config = {"opt": {"run_id": args.run_id, "target_batch_size": args.target_batch_size},
              "dht": {"initial_peers": initial_peers, "nat_port_map": False},
              **({"diloco": {"inner_steps": args.diloco}} if args.diloco else {})}  # fmt: skip
    steps = max(1, args.max_steps // args.diloco) if args.diloco else args.max_steps
    aux_args = [*command, "aux", "--config", json.dumps(config), "--output-dir", str(workdir / "auxiliary"),
                "--max-steps", str(steps), "--dashboard-port", str(args.dashboard_port),
                "--dashboard-refresh", "2"]  # fmt: skip
    log = open(workdir / "auxiliary.log", "w")
    return subprocess.Popen(aux_args, env=env, stdout=log, stderr=subprocess.STDOUT)


def _wait_for_dashboard(log: Path, process: subprocess.Popen) -> str:
    """The URL the auxiliary peer prints once its dashboard serves (`Dashboard: http://...`)."""
    deadline = time.monotonic() + PEER_START_TIMEOUT
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if line.startswith("Dashboard: "):
                return line.removeprefix("Dashboard: ").strip()
        if process.poll() is not None:
            raise RuntimeError(f"the auxiliary peer exited with code {process.returncode}; see {log}")
        time.sleep(0.2)
    raise RuntimeError(f"the auxiliary peer's dashboard did not start within {PEER_START_TIMEOUT:.0f} s; see {log}")


def _wait(process: subprocess.Popen, deadline: float) -> int:
    try:
        return process.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return -1


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()  # SIGTERM: peers leave the swarm cleanly
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _summarize(workdir: Path, args: argparse.Namespace, codes: list[int]) -> int:
    rows = []
    for index, code in enumerate(codes):
        path = workdir / f"peer{index}.json"
        summary = json.loads(path.read_text()) if path.exists() else None
        if code != 0 or summary is None:
            print(f"peer {index} failed (exit code {code}); see {workdir / f'peer{index}.log'}", file=sys.stderr)
            return 1
        rows.append(summary)
    total = sum(row["samples_contributed"] for row in rows) or 1
    print("\n=== trahiv demo summary ===")
    if args.diloco:
        print(f"DiLoCo: local steps: {max(row['collaborative_steps'] for row in rows)} (target {args.max_steps}), "
              f"outer steps (syncs every {args.diloco} local steps): {max(row['outer_steps'] for row in rows)}, "
              f"bytes sent per peer: {max(row['bytes_sent'] for row in rows):,}")  # fmt: skip
    else:
        print(f"collaborative steps: {max(row['collaborative_steps'] for row in rows)} (target {args.max_steps}), "
              f"{args.target_batch_size} samples each")  # fmt: skip
    print(f"{'peer':<6}{'peer id':<20}{'batch':>6}{'samples':>9}{'share':>8}{'loss start':>12}{'loss end':>10}")
    for index, row in enumerate(rows):
        print(
            f"{index:<6}{row['peer_id'][-16:]:<20}{row['batch_size']:>6}{row['samples_contributed']:>9}"
            f"{row['samples_contributed'] / total:>8.0%}{row['first_loss']:>12.3f}{row['last_loss']:>10.3f}"
        )
    print(f"outputs and logs: {workdir}")
    return 0


# --- one trainer peer ---------------------------------------------------------------------------------------------


def run_trainer(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback

    from trahiv import Trainer, TrainingArguments
    from trahiv.data import stream_dataset
    from trahiv.demo import BLOCK_SIZE

    workdir, index = Path(args.workdir), args.index
    losses: list[float] = []

    class Report(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            logs = kwargs.get("logs") or {}
            if "loss" in logs:
                losses.append(float(logs["loss"]))
                step = logs.get("collaborative_step", state.global_step)
                outer = f" outer step {logs['outer_step']}" if "outer_step" in logs else ""
                # (a DiLoCo peer knows the others' inner steps, not their samples: the dashboard sums their records)
                rate = logs.get("swarm_samples_per_second")
                swarm = "" if rate is None else f" swarm {rate:.0f} samples/s"
                line = (
                    f"[peer {index}] step {step}/{args.max_steps}{outer} loss {logs['loss']:.3f} "
                    f"peers {logs.get('swarm_peers')}{swarm} contributed {logs.get('samples_contributed')}\n"
                )
                # one write: the trainers share the demo's stdout unbuffered (PYTHONUNBUFFERED), where print() writes
                # the line and its newline apart and two peers' lines came out as one (a clean-clone run, stop 60)
                sys.stdout.write(line)
                sys.stdout.flush()

    training_args = TrainingArguments(
        output_dir=str(workdir / f"peer{index}"), per_device_train_batch_size=args.batch_size,
        max_steps=args.max_steps, learning_rate=3e-3, warmup_steps=2, lr_scheduler_type="linear",
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, use_cpu=True,
        hivemind_config={
            "dht": {"initial_peers": args.initial_peers, "nat_port_map": False},
            "metrics": {"name": f"demo peer {index}"},  # on the dashboard's leaderboard
            "opt": {"run_id": args.run_id, "target_batch_size": args.target_batch_size,
                    "matchmaking_time": args.matchmaking_time, "averaging_timeout": 30.0,
                    "min_peers": args.peers, "min_peers_timeout": 120.0},  # the demo's peers start together
            **({"diloco": {"inner_steps": args.diloco}} if args.diloco else {}),
        },
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(workdir / "model")
    tokenizer = AutoTokenizer.from_pretrained(workdir / "tokenizer")
    # streamed like a large dataset would be: shuffled by this peer's identity (no seed given: the Trainer sets it)
    data = stream_dataset(str(workdir / "shards"), tokenizer=tokenizer, block_size=BLOCK_SIZE, shuffle_buffer=64,
                          max_start_skip=16, prefetch=16)  # fmt: skip
    trainer = Trainer(model=model, args=training_args, train_dataset=data)
    trainer.remove_callback(PrinterCallback)  # the Report line replaces the raw log dicts
    trainer.add_callback(Report())
    swarm = trainer.swarm
    if swarm is None:
        raise RuntimeError("the demo trainer must run in a swarm")
    trainer.train()
    summary = {
        "peer_id": swarm.peer_id,
        "batch_size": args.batch_size,
        "threads": torch.get_num_threads(),
        "collaborative_steps": trainer.state.global_step,
        "samples_contributed": _samples(swarm),
        "outer_steps": swarm.diloco.outer_step if swarm.diloco else 0,
        "bytes_sent": int(swarm.metrics().get("averaging_bytes_sent", 0)),
        "first_loss": losses[0] if losses else float("nan"),
        "last_loss": losses[-1] if losses else float("nan"),
    }
    (workdir / f"peer{index}.json").write_text(json.dumps(summary))
    return 0


def _samples(swarm: Any) -> int:
    if swarm.diloco is not None:
        return int(swarm.diloco.samples_total)
    return int(swarm.optimizer.samples_contributed) if swarm.optimizer is not None else 0
