"""Launch and inspect real peer processes on 127.0.0.1 (shared by the swarm tests)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from peer_spec import spec_model
from zygote import Forked, spawn

TESTS = Path(__file__).parent
# One compute thread per peer: the tests' peers stand for machines of their own but share this machine's 2 cores, where
# torch's default (a thread per core in each peer) had peers' threads take turns unevenly (see trahiv.cli.demo)
PEER_ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
ENV = {**os.environ, **PEER_ENV}


def wait_for(condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    """Poll `condition` until it returns something truthy; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


@dataclass
class Bootstrap:
    process: subprocess.Popen | Forked
    initial_peers: list[str]

    def stop(self) -> None:
        stop(self.process)


def start_trahiv(argv: list[str], log: Path, cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen | Forked:
    """`trahiv ARGV`, its output in `log`: forked from the fork server as the peers are (tests/zygote.py; a fresh
    interpreter spent 4-6 s importing), or a subprocess with TRAHIV_TEST_NO_FORK or an environment of its own, `env`
    (what the fork server imported read the environment then: huggingface_hub's endpoint)."""
    if env is not None or os.environ.get("TRAHIV_TEST_NO_FORK"):
        command = [sys.executable, "-m", "trahiv.cli.main", *argv]
        return subprocess.Popen(command, env=env or ENV, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=cwd)
    return spawn(TESTS / "cli_worker.py", argv, log=log, cwd=cwd, env=PEER_ENV)


def start_bootstrap(tmp: Path) -> Bootstrap:
    """`trahiv dht` (`start_trahiv`), once it wrote its addresses."""
    addresses = tmp / "bootstrap.json"
    addresses.unlink(missing_ok=True)  # a run again in the same directory: not the last bootstrap's address
    process = start_trahiv(["dht", "--no-nat-port-map", "--addresses-file", str(addresses)], tmp / "bootstrap.log", tmp)
    peers = wait_for(
        lambda: addresses.exists() and addresses.stat().st_size and json.loads(addresses.read_text()),
        60,
        "the bootstrap peer",
    )
    return Bootstrap(process, peers)


@dataclass
class Peer:
    name: str
    out: Path
    process: subprocess.Popen | Forked
    spec: dict = field(default_factory=dict)

    def ready(self, timeout: float = 90) -> dict:
        path = self.out / "ready.json"
        return wait_for(
            lambda: self._check_alive() and path.exists() and json.loads(path.read_text()),
            timeout,
            f"peer {self.name} to start training",
        )

    def _check_alive(self) -> bool:
        if self.process.poll() is not None and not (self.out / "done.json").exists():
            raise AssertionError(f"peer {self.name} exited with {self.process.returncode}:\n{self.log()[-4000:]}")
        return True

    def records(self, kind: str | None = None) -> list[dict]:
        path = self.out / "records.jsonl"
        if not path.exists():
            return []
        # only whole lines: a record longer than the writer's buffer (a DiLoCo sync record with its sha256s is over
        # 4 KB) reaches the file in pieces, and a read between two of them sees the first piece without its newline
        lines = path.read_text().split("\n")[:-1]
        rows = [json.loads(line) for line in lines if line.strip()]
        return [r for r in rows if kind is None or r["kind"] == kind]

    def step(self) -> int:
        steps = [r["epoch_after"] for r in self.records("local")]
        return max(steps, default=0)

    def wait_step(self, step: int, timeout: float = 120) -> None:
        wait_for(lambda: self._check_alive() and self.step() >= step, timeout, f"peer {self.name} to reach {step}")

    def finish(self, timeout: float = 240) -> dict:
        try:
            code = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"peer {self.name} did not finish in {timeout} s:\n{self.log()[-4000:]}") from None
        assert code == 0, f"peer {self.name} exited with {code}:\n{self.log()[-4000:]}"
        return json.loads((self.out / "done.json").read_text())

    def log(self) -> str:
        return (self.out / "log.txt").read_text(errors="replace")

    def params_at(self) -> dict[int, dict]:
        return {r["step"]: r for r in self.records("step")}

    def wait_params(self, step: int, timeout: float = 120) -> dict:
        """This peer's parameter record at collaborative `step` (written at the end of that step, after its "local"
        record: wait_step alone can return before it)."""
        return wait_for(lambda: self._check_alive() and self.params_at().get(step), timeout, f"{self.name} step {step}")


def start_peer(tmp: Path, name: str, *, worker: str = "peer_worker.py", prefix: tuple = (), **spec: Any) -> Peer:
    """Run `worker` (a script in tests/) with `spec` as a peer named `name`; `prefix` runs it elsewhere (`ip netns`)."""
    out = tmp / name
    model = spec_model(worker)  # typed specs: a misspelt key or a wrong value fails here, naming the field
    spec = {"out": str(out), **spec}
    text = model.model_validate(spec).model_dump_json(exclude_unset=True) if model else json.dumps(spec)
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(text)
    if not prefix and not os.environ.get("TRAHIV_TEST_NO_FORK"):  # forked from a warm process (tests/zygote.py)
        process: subprocess.Popen | Forked = spawn(
            TESTS / worker, [str(out / "spec.json")], log=out / "log.txt", cwd=tmp, env=PEER_ENV
        )
        return Peer(name, out, process, spec)
    log = open(out / "log.txt", "w")
    command = [*prefix, sys.executable, str(TESTS / worker), str(out / "spec.json")]
    process = subprocess.Popen(command, env=ENV, stdout=log, stderr=subprocess.STDOUT, cwd=tmp)
    return Peer(name, out, process, spec)


def stop(process: subprocess.Popen | Forked, timeout: float = 15) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def alive(pids: list[int]) -> list[int]:
    """The pids among `pids` that still run (zombies count as gone)."""
    result = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                result.append(pid)
        except psutil.NoSuchProcess:
            pass
    return result


def wait_exited(pids: list[int], timeout: float, what: str) -> None:
    """Wait until none of `pids` runs (each exits with its parent, or is killed); fail naming those left."""
    deadline = time.monotonic() + timeout
    while (left := alive(pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    names = []
    for pid in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            names.append(f"{pid} {psutil.Process(pid).name()} (parent {psutil.Process(pid).ppid()})")
    assert not names, f"{what}: still running after {timeout:.0f} s: {names}"


def process_tree(pid: int) -> list[int]:
    try:
        proc = psutil.Process(pid)
        return [pid] + [child.pid for child in proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def samples_per_epoch(peers: list[Peer]) -> dict[int, int]:
    """Samples each collaborative step received, summed over peers, from the peers' per-step records."""
    totals: dict[int, int] = {}
    for peer in peers:
        for row in peer.records("local"):
            totals[row["epoch_before"]] = totals.get(row["epoch_before"], 0) + row["batch"]
    return totals


@contextlib.contextmanager
def local_dht(initial_peers: Sequence[Any] = ()) -> Any:
    """A DHT on 127.0.0.1 (no NAT port mapping), shut down on exit: averagers' tests build their peers on these."""
    import hivemind

    dht = hivemind.DHT(start=True, initial_peers=list(initial_peers), nat_port_map=False)
    try:
        yield dht
    finally:
        dht.shutdown()


def step_together(
    averagers: Sequence[Any],
    timeouts: Sequence[float],
    *,
    join_s: float = 60.0,
    after: Callable[[int], None] | None = None,
    unjoined: Collection[int] = (),
) -> tuple[list[Any], list[float]]:
    """One averaging round of `averagers` (peers of one group): each one's `step(timeout=timeouts[rank],
    allow_retries=False)` in a thread of its own, all started at once. Returns each step's result (or the exception
    it raised) and its duration in seconds. `after(rank)` runs in a step's thread once the step ended; the threads of
    `unjoined` are not waited for (a stalled peer's step ends when its averager is shut down); the others for up to
    `join_s` seconds each."""
    results: list[Any] = [None] * len(averagers)
    seconds = [0.0] * len(averagers)

    def step(rank: int) -> None:
        started = time.monotonic()
        try:
            results[rank] = averagers[rank].step(timeout=timeouts[rank], allow_retries=False)
        except Exception as e:
            results[rank] = e
        seconds[rank] = time.monotonic() - started
        if after is not None:
            after(rank)

    threads = [threading.Thread(target=step, args=(rank,), daemon=True) for rank in range(len(averagers))]
    for thread in threads:
        thread.start()
    for rank, thread in enumerate(threads):
        if rank not in unjoined:
            thread.join(join_s)
    return results, seconds
