"""Swarm cost: how one peer's CPU and DHT messages grow with the swarm's size (2, 4, 8, 16 peers on 127.0.0.1).

Run:
    .venv/bin/python benchmarks/swarm_cost.py --peers 2 4 8 16 --output benchmarks/results/swarm_cost.json

For each swarm size N, N peers start, each its own OS process built the way a Trainer builds its peer (trahiv.swarm.
Swarm from a HivemindConfig with the Trainer's defaults: DHT, progress tracker, metrics publishing, state and gradient
averagers), joined through the first peer; P float32 parameters (default 262,144) so that 16 peers fit in memory. Then:

- idle: every peer joined and ready to train (the Trainer's start: mark_ready, wait_for_peers), not training, for
  --idle-s seconds: CPU seconds per second of each peer's process tree (its Python process, its DHT process and p2pd,
  its averager processes), measured from outside with psutil, and the DHT messages (RPCs its DHT node sent and
  answered: ping, store, find; trahiv.engine.dht_stats) per second;
- rounds: training begins (catch_up, as the Trainer's once the peers are ready), the peers train --steps
  collaborative steps (target_batch_size = N x the local batch: one local batch per peer and step; "compute" is a
  --compute-s sleep, a GPU's forward and backward) and publish their model record and metrics as the Trainer does
  after each step: CPU seconds and DHT messages per peer and collaborative step, the step's wall time, the averaging
  rounds' reports (complete / partial / failed) and the swarm's samples over the steps' targets.

CPU is broken down by process (main, dht, p2pd, averagers, other), and the DHT requests that cause the messages by
key (the progress record, the averagers' matchmaking keys, ...), and each peer's reads of the progress by the code
that made them (a peer waiting at its share, hivemind's periodic fetch, a local step), so that what grows with N
shows. 16 peers that join
one after another here wait minutes for each other: the first run of this benchmark found that a waiting peer's
progress record expired after 60 s (hivemind renews it only once the peer has samples) and the peers never all
counted each other as ready; trahiv's Swarm.wait_for_peers now renews it (--keepalive-s adds renewals). The machine's
1-minute load average and the CPU that other processes (not this benchmark's) used are recorded at the start and in
every window: on a 2-core machine 16 peers share two cores, and a busy machine shows in every figure.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
MARK = "@swarm_cost "  # prefix of the worker's protocol lines on stdout (everything else there is ignored)
ROLES = ("main", "dht", "p2pd", "averagers", "other")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
       "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}  # fmt: skip


# --- process trees ------------------------------------------------------------------------------------------------


def tree_cpu(main_pid: int, pids: dict[str, list[int]]) -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) so far of `main_pid` and each of its descendants, with the process's role:
    `pids` names the peer's DHT and averager processes; p2pd is found by name."""
    try:
        root = psutil.Process(main_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    roles = {pid: role for role, group in pids.items() for pid in group}
    found: dict[int, tuple[str, float]] = {}
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            if proc.pid == main_pid:
                role = "main"
            elif proc.name().startswith("p2pd"):
                role = "p2pd"
            else:
                role = roles.get(proc.pid, "other")
            found[proc.pid] = (role, times.user + times.system)
    return found


def cpu_between(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds by role between two `tree_cpu` snapshots (a process started in between counts from zero; one that
    ended in between is lost: none should)."""
    by_role = dict.fromkeys(ROLES, 0.0)
    for pid, (role, seconds) in after.items():
        by_role[role] += seconds - before.get(pid, (role, 0.0))[1]
    return by_role


def machine_busy_cpu() -> float:
    """CPU seconds all cores of the machine spent busy so far."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0) + getattr(t, "steal", 0.0)


def own_cpu() -> float:
    """CPU seconds so far of this benchmark's own process (the coordinator, not a peer)."""
    t = psutil.Process().cpu_times()
    return t.user + t.system


def pss_mb(main_pid: int) -> float:
    """Proportional set size of a process tree (shared pages split among the processes sharing them), MB."""
    total = 0.0
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(main_pid)
        for proc in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                total += proc.memory_full_info().pss
    return total / 2**20


# --- one peer -----------------------------------------------------------------------------------------------------


def emit(kind: str, **fields: Any) -> None:
    print(MARK + json.dumps({"kind": kind, **fields}), flush=True)


def worker(spec: dict) -> None:
    import torch

    from trahiv.config import HivemindConfig
    from trahiv.engine import dht_stats

    dht_stats.install()  # before the Swarm forks its DHT process
    count_progress_reads()
    from trahiv.swarm import Swarm, join_addresses, model_fingerprint

    torch.set_num_threads(1)
    peers, batch = spec["peers"], spec["batch"]
    config = HivemindConfig.model_validate({
        "dht": {"host_maddrs": ["/ip4/127.0.0.1/tcp/0"], "initial_peers": spec["initial_peers"],
                "nat_port_map": False, **spec["dht"]},
        "opt": {"run_id": "swarm_cost", "target_batch_size": peers * batch, "batch_size_per_step": batch,
                "min_peers": peers, "min_peers_timeout": spec["ready_timeout"]},
    })  # fmt: skip  # everything else: the Trainer's defaults (metrics published, state averaged every 5 steps)
    swarm = Swarm(config, announce=lambda _: None)
    try:
        emit("maddrs", maddrs=join_addresses(swarm.dht))
        shapes = [(256, min(256, (spec["params"] - i) // 256)) for i in range(0, spec["params"], 65536)]
        params = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes if shape[1] > 0]
        named = [(f"p{i}", p) for i, p in enumerate(params)]
        swarm.check_model(model_fingerprint(named, params))
        optimizer = swarm.make_optimizer(
            [{"params": params}], lambda groups: torch.optim.AdamW(groups, lr=1e-3), None, batch
        )
        swarm.mark_ready()  # what trahiv.Trainer does when training begins (CollaborativeFlowCallback)
        keepalive = threading.Event()
        if spec["keepalive_s"] > 0:  # see --keepalive-s
            threading.Thread(target=announce_until, args=(swarm, keepalive, spec["keepalive_s"]), daemon=True).start()
        swarm.wait_for_peers()
        engine = {"dht": [swarm.dht.pid], "averagers": [p.pid for p in swarm.engine_processes() if p is not swarm.dht]}
        emit("ready", pids=engine, step=optimizer.local_epoch, client_mode=swarm.dht.client_mode,
             parameters=sum(p.numel() for p in params))  # fmt: skip
        grads = [torch.randn_like(p) * 1e-3 for p in params]
        for line in sys.stdin:  # commands from the coordinator; EOF (it is gone): leave
            command = json.loads(line)
            if command["cmd"] == "counts":
                emit("counts", counts=dht_stats.dht_message_counts(swarm.dht),
                     requests=dht_stats.dht_request_counts(swarm.dht))  # fmt: skip
            elif command["cmd"] == "train":
                swarm.catch_up()  # training begins, as the Trainer's begins once min_peers are ready (not before idle)
                keepalive.set()  # from the first local step on, hivemind's reporter refreshes the record
                marks = train(swarm, optimizer, params, grads, spec, engine)
                emit("trained", marks=marks, metrics=swarm.metrics(), samples=optimizer.samples_contributed)
            elif command["cmd"] == "exit":
                break
    finally:
        swarm.shutdown()
    emit("done")


PROGRESS_READS: collections.Counter = collections.Counter()  # (in a worker) the code that read the progress -> reads


def count_progress_reads() -> None:
    """Count this peer's reads of the swarm's progress by the code that made them: hivemind's periodic fetch
    (`_progress_fetcher`), or the trahiv function that called `refresh_now` (`_hold_at_share`: a peer waiting at its
    share; `_update_global_epoch`, `_refresh_progress_if_due`: local steps; `_catch_up`)."""
    from trahiv.engine.optimizer import SwarmProgressTracker

    parse = SwarmProgressTracker._parse_swarm_progress_data

    def counted(self: Any, metadata: Any) -> Any:
        frame = sys._getframe(1)
        if frame.f_code.co_name in ("refresh_now", "refresh_if_older"):
            while frame.f_back is not None and frame.f_code.co_name in ("refresh_now", "refresh_if_older"):
                frame = frame.f_back
        PROGRESS_READS[frame.f_code.co_name] += 1
        return parse(self, metadata)

    SwarmProgressTracker._parse_swarm_progress_data = counted  # type: ignore[method-assign]


def announce_until(swarm: Any, stop: threading.Event, period: float) -> None:
    """Publish this peer's progress record every `period` s until `stop`: hivemind's reporter refreshes it only once
    the peer has accumulated samples, so a peer that waits more than the record's 60 s expiration for the others
    drops out of their count (16 peers joining one after another on 2 cores take longer than that)."""
    while not stop.wait(period):
        with contextlib.suppress(Exception):
            swarm.optimizer.tracker.announce()


def train(swarm: Any, optimizer: Any, params: list, grads: list, spec: dict, engine: dict) -> list[dict]:
    """--steps collaborative steps; a mark (time, this peer's CPU by role, DHT counts) at the start and after each."""
    from trahiv.engine import dht_stats

    def mark() -> dict:
        cpu = tree_cpu(os.getpid(), engine)
        return {"step": optimizer.local_epoch, "time": time.monotonic(), "cpu": {str(k): v for k, v in cpu.items()},
                "counts": dht_stats.dht_message_counts(swarm.dht),
                "requests": dht_stats.dht_request_counts(swarm.dht), "reads": dict(PROGRESS_READS)}  # fmt: skip

    marks, batch = [mark()], spec["batch"]
    target = optimizer.local_epoch + spec["steps"]
    deadline = time.monotonic() + spec["run_timeout"]
    while optimizer.local_epoch < target and time.monotonic() < deadline:
        time.sleep(spec["compute_s"])  # forward + backward on an accelerator
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad.clone()
        before = optimizer.local_epoch
        optimizer.step(batch_size=batch)
        swarm.publish_model()  # the Trainer's on_step_end: the model record (refreshed every TTL / 4)...
        if optimizer.local_epoch > before:
            swarm.publish_metrics(loss=1.0)  # ... and the metrics record at each collaborative step
            marks.append(mark())
    return marks


# --- the coordinator ----------------------------------------------------------------------------------------------


class Peer:
    """One peer process: its own session (process group), protocol lines read by a thread into a queue."""

    def __init__(self, rank: int, spec: dict, logdir: Path):
        self.rank, self.log = rank, logdir / f"peer{rank}.log"
        cmd = [sys.executable, __file__, "--worker", json.dumps(spec)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(self.log, "w"),
                                     text=True, start_new_session=True, cwd=ROOT, env=ENV)  # fmt: skip
        self.lines: queue.Queue[dict | None] = queue.Queue()
        self.ready: dict = {}
        self.descendants: set[int] = set()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self.lines.put(json.loads(line[len(MARK) :]))
        self.lines.put(None)  # EOF

    def expect(self, kind: str, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                message = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if message is None:
                raise RuntimeError(f"peer {self.rank} exited ({self.proc.poll()}) before '{kind}':\n{self.tail()}")
            if message["kind"] == kind:
                return message
        raise RuntimeError(f"peer {self.rank}: no '{kind}' within {timeout:.0f} s:\n{self.tail()}")

    def send(self, **command: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def remember_descendants(self) -> None:
        with contextlib.suppress(psutil.NoSuchProcess):
            self.descendants |= {p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)}

    def stop(self, grace: float) -> None:
        """Ask to leave; after `grace` s, SIGTERM then SIGKILL the process group, then any descendant seen before."""
        self.remember_descendants()
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                self.send(cmd="exit")
                self.proc.stdin.close()  # type: ignore[union-attr]
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if self.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(10)
        for pid in self.descendants:  # children that left the group, or outlived their parent
            with contextlib.suppress(psutil.Error):
                child = psutil.Process(pid)
                if child.status() != psutil.STATUS_ZOMBIE:
                    child.kill()


def everyone(peers: list[Peer], kind: str, timeout: float, **command: Any) -> list[dict]:
    """Send `command` to every peer (if any), then collect each one's `kind` message."""
    if command:
        for peer in peers:
            peer.send(**command)
    deadline = time.monotonic() + timeout
    return [peer.expect(kind, max(1.0, deadline - time.monotonic())) for peer in peers]


def stats(values: Iterable[float], digits: int = 3) -> dict[str, float]:
    values = list(values)
    return {"mean": round(statistics.fmean(values), digits), "max": round(max(values), digits)}


def request_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {key: after[key] - before.get(key, 0) for key in after if after[key] > before.get(key, 0)}


def mean_by_key(rows: list[dict[str, int]], scale: float, digits: int = 2) -> dict[str, float]:
    """Mean over peers (a peer without a key counts 0), largest first."""
    keys = {key for row in rows for key in row}
    means = {key: round(sum(row.get(key, 0) for row in rows) / len(rows) * scale, digits) for key in keys}
    return dict(sorted(means.items(), key=lambda item: -item[1]))


def by_role_mean(rows: list[dict[str, float]], scale: float, digits: int = 3) -> dict[str, float]:
    return {role: round(statistics.fmean(r[role] for r in rows) * scale, digits) for role in ROLES}


def run_swarm(n: int, args: argparse.Namespace, logdir: Path) -> dict:
    peers: list[Peer] = []
    started = time.monotonic()
    spec = {"peers": n, "params": args.params, "batch": args.batch, "steps": args.steps, "compute_s": args.compute_s,
            "run_timeout": args.run_timeout, "ready_timeout": args.ready_timeout, "keepalive_s": args.keepalive_s,
            "initial_peers": [], "dht": json.loads(args.dht)}  # fmt: skip
    try:
        for rank in range(n):  # one at a time until its DHT runs: 16 imports of torch at once time out on 2 cores
            peers.append(Peer(rank, {**spec, "rank": rank}, logdir))
            maddrs = peers[-1].expect("maddrs", args.ready_timeout)["maddrs"]
            if rank == 0:
                spec["initial_peers"] = maddrs
        readies = everyone(peers, "ready", args.ready_timeout)
        joined_s = time.monotonic() - started
        for peer, ready in zip(peers, readies, strict=True):
            peer.ready = ready
            peer.remember_descendants()
        memory = [pss_mb(peer.proc.pid) for peer in peers]
        time.sleep(args.settle_s)
        idle = measure_idle(peers, args.idle_s)
        cpu0, busy0, own0 = [tree_cpu(p.proc.pid, p.ready["pids"]) for p in peers], machine_busy_cpu(), own_cpu()
        t0 = time.monotonic()
        trained = everyone(peers, "trained", args.run_timeout + 60, cmd="train")
        elapsed = time.monotonic() - t0
        cpu1, busy1, own1 = [tree_cpu(p.proc.pid, p.ready["pids"]) for p in peers], machine_busy_cpu(), own_cpu()
        ours = sum(sum(cpu_between(a, b).values()) for a, b in zip(cpu0, cpu1, strict=True)) + own1 - own0
        result = summarize(n, peers, idle, trained, args)
        result["rounds_detail"]["phase_s"] = round(elapsed, 1)
        result["rounds_detail"]["all_peers_cpu_per_s"] = round((ours - (own1 - own0)) / elapsed, 3)
        result["rounds_detail"]["other_processes_cpu_per_s"] = round(max(0.0, busy1 - busy0 - ours) / elapsed, 3)
        result["rounds_detail"]["load_average_1min_end"] = round(os.getloadavg()[0], 2)
        result["join"] = {"all_ready_s": round(joined_s, 1), "pss_mb_per_peer": stats(memory, 1),
                          "client_mode_peers": sum(bool(r["client_mode"]) for r in readies),
                          "parameters": readies[0]["parameters"]}  # fmt: skip
        return result
    finally:
        for peer in peers:
            peer.remember_descendants()
        threads = [threading.Thread(target=peer.stop, args=(args.exit_grace_s,)) for peer in peers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(args.exit_grace_s + 40)


def measure_idle(peers: list[Peer], window: float) -> dict:
    roles = [peer.ready["pids"] for peer in peers]
    counts0 = everyone(peers, "counts", 60, cmd="counts")
    cpu0 = [tree_cpu(peer.proc.pid, r) for peer, r in zip(peers, roles, strict=True)]
    busy0, own0, load = machine_busy_cpu(), own_cpu(), os.getloadavg()[0]
    t0 = time.monotonic()
    time.sleep(window)
    elapsed = time.monotonic() - t0
    cpu1 = [tree_cpu(peer.proc.pid, r) for peer, r in zip(peers, roles, strict=True)]
    busy1, own1 = machine_busy_cpu(), own_cpu()
    counts1 = everyone(peers, "counts", 60, cmd="counts")
    cpu = [cpu_between(a, b) for a, b in zip(cpu0, cpu1, strict=True)]
    msgs = [{k: b["counts"][k] - a["counts"][k] for k in a["counts"]} for a, b in zip(counts0, counts1, strict=True)]
    requests = [request_delta(a["requests"], b["requests"]) for a, b in zip(counts0, counts1, strict=True)]
    ours = sum(sum(c.values()) for c in cpu) + (own1 - own0)
    return {"elapsed_s": elapsed, "cpu": cpu, "msgs": msgs, "requests": requests, "machine_busy": busy1 - busy0,
            "ours": ours, "load_1min": load}  # fmt: skip


def summarize(n: int, peers: list[Peer], idle: dict, trained: list[dict], args: argparse.Namespace) -> dict:
    window = idle["elapsed_s"]
    idle_cpu = [sum(c.values()) / window for c in idle["cpu"]]
    idle_msgs = [m["total"] / window for m in idle["msgs"]]
    per_peer, round_cpu, round_msgs, round_roles, step_times, kinds, requests = [], [], [], [], [], [], []
    reads: list[dict] = []  # progress reads per step, by the code that made them (count_progress_reads)
    rounds = {"complete": 0, "partial": 0, "failed": 0}
    ring_rounds = 0  # of the complete ones, those run as a ring (the default's gradient rounds since stop 50)
    reached = 0
    for rank, out in enumerate(trained):
        marks = out["marks"]
        first, last = marks[0], marks[-1]
        steps = last["step"] - first["step"]
        reached += steps >= args.steps
        cpu = cpu_between(
            {int(k): tuple(v) for k, v in first["cpu"].items()}, {int(k): tuple(v) for k, v in last["cpu"].items()}
        )
        msgs = {k: last["counts"][k] - first["counts"][k] for k in first["counts"]}
        for status in rounds:
            rounds[status] += out["metrics"].get(f"averaging_rounds_{status}", 0)
        ring_rounds += out["metrics"].get("averaging_rounds_ring", 0)
        step_times += [b["time"] - a["time"] for a, b in zip(marks, marks[1:], strict=False)]
        if steps > 0:
            round_cpu.append(sum(cpu.values()) / steps)
            round_msgs.append(msgs["total"] / steps)
            round_roles.append({role: cpu[role] / steps for role in ROLES})
            kinds.append({k: v / steps for k, v in msgs.items()})
            requests.append({k: v / steps for k, v in request_delta(first["requests"], last["requests"]).items()})
            reads.append({k: (v - first["reads"].get(k, 0)) / steps for k, v in last["reads"].items()
                          if v > first["reads"].get(k, 0)})  # fmt: skip
        per_peer.append({
            "rank": rank, "idle_cpu_per_s": round(idle_cpu[rank], 4), "idle_dht_msgs_per_s": round(idle_msgs[rank], 2),
            "idle_cpu_by_process_per_s": {k: round(v / window, 4) for k, v in idle["cpu"][rank].items()},
            "collaborative_steps": steps, "round_cpu_s": round(sum(cpu.values()) / max(steps, 1), 3),
            "round_dht_msgs": round(msgs["total"] / max(steps, 1), 1), "samples": out["samples"],
            "averaging_rounds": {s: out["metrics"].get(f"averaging_rounds_{s}", 0) for s in rounds},
        })  # fmt: skip
    idle_kinds = {k: round(statistics.fmean(m[k] for m in idle["msgs"]) / window, 3) for k in idle["msgs"][0]}
    others_idle = max(0.0, idle["machine_busy"] - idle["ours"]) / window
    return {
        "peers": n,
        "idle_cpu_per_s": stats(idle_cpu, 4),
        "idle_dht_msgs_per_s": stats(idle_msgs, 2),
        "round_cpu_s": stats(round_cpu) if round_cpu else None,
        "round_dht_msgs": stats(round_msgs, 1) if round_msgs else None,
        "step_s_median": round(statistics.median(step_times), 2) if step_times else None,
        "rounds_complete": rounds["complete"],
        "rounds": rounds,
        "rounds_ring": ring_rounds,
        # the swarm's samples over the --steps steps' targets (N x --batch each): 1.0 is no sample computed past them
        "samples_over_target": round(sum(out["samples"] for out in trained) / (args.steps * n * args.batch), 3),
        "all_peers_reached_steps": reached == n,
        "all_rounds_complete": reached == n and rounds["partial"] == rounds["failed"] == 0,
        "idle": {
            "window_s": round(window, 1),
            "cpu_by_process_per_s_mean": by_role_mean(idle["cpu"], 1 / window, 4),
            "dht_msgs_by_kind_per_s_mean": idle_kinds,
            "dht_requests_by_key_per_s_mean": mean_by_key(idle["requests"], 1 / window, 3),
            "all_peers_cpu_per_s": round(sum(idle_cpu), 3),
            "other_processes_cpu_per_s": round(others_idle, 3),
            "load_average_1min": round(idle["load_1min"], 2),
        },
        "rounds_detail": {
            "cpu_by_process_s_mean": by_role_mean(round_roles, 1.0) if round_roles else None,
            "dht_msgs_by_kind_mean": {k: round(statistics.fmean(r[k] for r in kinds), 1) for k in kinds[0]}
            if kinds
            else None,
            "dht_requests_by_key_mean": mean_by_key(requests, 1.0) if requests else None,
            "progress_reads_by_caller_mean": mean_by_key(reads, 1.0) if reads else None,
            "step_s": {"min": round(min(step_times), 2), "max": round(max(step_times), 2)} if step_times else None,
        },
        "per_peer": per_peer,
    }


def other_cpu_now(seconds: float = 3.0) -> float:
    """CPU seconds per second the machine spends busy outside this process (nothing of ours runs yet)."""
    busy, own = machine_busy_cpu(), own_cpu()
    time.sleep(seconds)
    return round((machine_busy_cpu() - busy - (own_cpu() - own)) / seconds, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peers", type=int, nargs="+", default=[2, 4, 8, 16], help="swarm sizes, one run each")
    parser.add_argument("--params", type=int, default=2**18, help="float32 parameters per peer")
    parser.add_argument("--batch", type=int, default=4, help="samples per local step")
    parser.add_argument("--steps", type=int, default=5, help="collaborative steps in the 'rounds' phase")
    parser.add_argument("--compute-s", type=float, default=0.5, help="sleep standing for a local step's compute")
    parser.add_argument("--idle-s", type=float, default=20.0, help="idle window")
    parser.add_argument("--settle-s", type=float, default=5.0, help="wait after every peer is ready, before idle")
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    parser.add_argument("--keepalive-s", type=float, default=0.0,
                        help="also re-publish a waiting peer's progress record this often until it trains (0: only "
                        "what trahiv does, in Swarm.wait_for_peers)")  # fmt: skip
    parser.add_argument("--run-timeout", type=float, default=600.0, help="bound on the 'rounds' phase")
    parser.add_argument("--exit-grace-s", type=float, default=20.0, help="wait for a peer to leave before killing it")
    parser.add_argument("--min-free-gb", type=float, default=3.0, help="memory to leave free on the machine")
    parser.add_argument("--dht", default="{}", help='extra hivemind_config["dht"] entries (JSON), e.g. bucket_size')
    parser.add_argument("--output", type=Path, help="also write the JSON here")
    parser.add_argument("--logdir", type=Path, help="keep the peers' logs here (default: a temporary directory)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # runs the `finally` blocks: every peer is stopped
    load_before, started = os.getloadavg(), time.time()
    others_before = other_cpu_now()
    results: list[dict] = []
    stopped = None
    peer_mb = 1000.0  # a guess for the first size; then what the last size measured (PSS of a peer's tree)
    with tempfile.TemporaryDirectory(prefix="swarm_cost_") as tmp:
        logdir = args.logdir or Path(tmp)
        logdir.mkdir(parents=True, exist_ok=True)
        for n in args.peers:
            available_gb = psutil.virtual_memory().available / 2**30
            need_gb = n * peer_mb * 1.5 / 1024 + args.min_free_gb
            if available_gb < need_gb:
                stopped = f"{n} peers not run: {available_gb:.1f} GB available, about {need_gb:.1f} GB needed"
                break
            print(f"swarm_cost: {n} peers ...", file=sys.stderr, flush=True)
            (logdir / str(n)).mkdir(exist_ok=True)
            result = run_swarm(n, args, logdir / str(n))
            result["memory_available_gb_before"] = round(available_gb, 1)
            peer_mb = result["join"]["pss_mb_per_peer"]["max"]  # (the first size replaces the guess)
            results.append(result)
            print(json.dumps({k: result[k] for k in list(result)[:9]}), file=sys.stderr, flush=True)
    report = {
        "benchmark": "swarm_cost", **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                                      if k != "worker"},
        "cpu_cores": psutil.cpu_count(), "memory_total_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "load_average_before": [round(x, 2) for x in load_before],
        "other_processes_cpu_per_s_before": others_before,
        "load_average_after": [round(x, 2) for x in os.getloadavg()], "wall_s": round(time.time() - started, 1),
        "command": " ".join([Path(sys.executable).name, *sys.argv]), "stopped": stopped, "swarms": results,
    }  # fmt: skip
    text = json.dumps(report, indent=1)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")


if __name__ == "__main__":
    main()
