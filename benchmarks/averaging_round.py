"""Benchmark 1, one averaging round: N peers average P parameters (LoRA-shaped), each peer its own process.

Prints JSON. Run (as root, for shaped links):
    .venv/bin/python benchmarks/averaging_round.py --peers 4 --bandwidths 100 50 --rounds 4
    .venv/bin/python benchmarks/averaging_round.py --peers 2 4 --bandwidths 0     # 0 = loopback, no shaping

With a bandwidth B > 0 (root only) every peer runs in its own network namespace, linked by a veth pair to a bridge in
a hub namespace; `tc ... tbf` shapes each link to B Mbit/s in both directions (no netem). The namespaces are deleted
on exit, Ctrl+C included. Without root, B > 0 is refused.

For each compression both engines run in the same peers, alternating: `hivemind` (plain DecentralizedAverager, as
shipped apart from trahiv's numpy-2 decoders) and `trahiv` (trahiv.engine.averagers.ReportingAverager: robust
reducer, payload-based deadlines, round reports, `--trahiv-part-bytes`). Reported per configuration: median all-reduce
time (group formed -> tensors updated; matchmaking excluded) against the bound 2 x (N-1)/N x S / B, S = compressed
payload; whether every round was complete, checked on the values (no value left at its local value) and, for trahiv,
by its own round reports; the load average.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LORA_RANK, HIDDEN = 16, 4096  # LoRA of a 7B model: A (16 x 4096) and B (4096 x 16), 65,536 values each
HUB, PREFIX, SUBNET = "h5hub", "h5p", "10.213.0"


# --- network namespaces -------------------------------------------------------------------------------------------


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=20)


class Namespaces:
    """A hub namespace with a bridge and one namespace per peer, each linked by a shaped veth pair."""

    def __init__(self, peers: int):
        self.peers, self.names = peers, [f"{PREFIX}{i}" for i in range(peers)]

    def __enter__(self) -> Namespaces:
        self.cleanup()
        sh("ip", "netns", "add", HUB)
        self.hub("ip", "link", "add", "br0", "type", "bridge")
        self.hub("ip", "link", "set", "br0", "up")
        for i, name in enumerate(self.names):
            sh("ip", "netns", "add", name)
            sh("ip", "link", "add", f"h5v{i}", "netns", HUB, "type", "veth", "peer", "name", "eth0", "netns", name)
            self.hub("ip", "link", "set", f"h5v{i}", "master", "br0")
            self.hub("ip", "link", "set", f"h5v{i}", "up")
            self.exec(i, "ip", "addr", "add", f"{self.ip(i)}/24", "dev", "eth0")
            self.exec(i, "ip", "link", "set", "eth0", "up")
            self.exec(i, "ip", "link", "set", "lo", "up")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cleanup()

    def cleanup(self) -> None:
        for name in [*self.names, HUB]:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)

    def shape(self, mbit: float, queue_ms: float = 200.0) -> None:
        """tbf on both ends of every link: B Mbit/s up and down for each peer, queueing at most `queue_ms`."""
        burst = str(max(int(mbit * 1e6 / 8 / 250), 64 * 1024))  # at least one timer tick of data, >= 64 KiB (GSO)
        tbf = ["root", "tbf", "rate", f"{mbit}mbit", "burst", burst, "latency", f"{queue_ms}ms"]
        for i in range(self.peers):
            self.exec(i, "tc", "qdisc", "replace", "dev", "eth0", *tbf)
            self.hub("tc", "qdisc", "replace", "dev", f"h5v{i}", *tbf)

    @staticmethod
    def ip(i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def hub(self, *cmd: str) -> None:
        sh("ip", "netns", "exec", HUB, *cmd)

    def exec(self, i: int, *cmd: str) -> None:
        sh("ip", "netns", "exec", self.names[i], *cmd)

    def wrap(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.names[i]]


# --- one peer -----------------------------------------------------------------------------------------------------


def lora_shapes(params: int) -> list[tuple[int, int]]:
    pairs = max(1, params // (2 * LORA_RANK * HIDDEN))
    return [shape for _ in range(pairs) for shape in ((LORA_RANK, HIDDEN), (HIDDEN, LORA_RANK))]


def worker(spec: dict) -> None:
    import hivemind
    import torch
    from hivemind.averaging import DecentralizedAverager
    from hivemind.compression import CompressionInfo, deserialize_torch_tensor

    from trahiv import engine
    from trahiv.averaging.partial import Deadlines
    from trahiv.compression import make_compression
    from trahiv.engine.averagers import ReportingAverager

    engine.apply()
    torch.set_num_threads(1)
    rank, peers = spec["rank"], spec["peers"]
    dht = hivemind.DHT(
        start=True, host_maddrs=[f"/ip4/{spec['host']}/tcp/0"], initial_peers=spec["initial_peers"], nat_port_map=False
    )
    print(json.dumps({"maddrs": [str(m) for m in dht.get_visible_maddrs()]}), flush=True)

    shapes = lora_shapes(spec["params"])
    gen = torch.Generator().manual_seed(1234)
    mean = [torch.randn(shape, generator=gen) for shape in shapes]  # the exact average of all peers' tensors
    spread = [torch.randn(shape, generator=gen) for shape in shapes]
    offset = rank - (peers - 1) / 2  # offsets sum to zero over the peers
    local = [m + offset * s for m, s in zip(mean, spread, strict=True)]
    mean_flat, local_flat = torch.cat([t.view(-1) for t in mean]), torch.cat([t.view(-1) for t in local])

    class Timed:
        async def _aggregate_with_group(self, group_info, min_vector_size, **kwargs):
            started, cpu = time.perf_counter(), time.process_time()
            await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)  # type: ignore[misc]
            return {"seconds": time.perf_counter() - started, "cpu_s": time.process_time() - cpu}

    class HivemindAverager(Timed, DecentralizedAverager):
        @classmethod
        def _get_handle_name(cls, namespace, method_name):
            return DecentralizedAverager._get_handle_name(namespace, method_name)

    class TrahivAverager(Timed, ReportingAverager):
        pass

    # every averager is created before the first round and shut down after the last: in hivemind 1.1.12 an averager
    # shut down with DHT requests in flight can leave its DHT process blocked (seen with 4 peers under load)
    averagers, payloads = {}, {}
    for name in spec["compressions"]:
        payloads[name] = profile_compression(make_compression(name), local, CompressionInfo, deserialize_torch_tensor)
        for engine_name in spec["engines"]:
            compression = make_compression(name) if engine_name == "trahiv" else hivemind_compression(name)
            kwargs: dict[str, Any] = dict(
                dht=dht, prefix=f"bench_{engine_name}_{name}", target_group_size=peers, min_group_size=peers,
                min_matchmaking_time=spec["matchmaking_time"], request_timeout=1.0, compression=compression,
                start=True,
            )  # fmt: skip
            if engine_name == "trahiv":
                kwargs.update(part_size_bytes=spec["trahiv_part_bytes"], deadlines=Deadlines())
                cls: type = TrahivAverager
            else:
                cls = HivemindAverager
            if engine_name == "hivemind-timeouts":  # the engine alone with fixed chunk timeouts like trahiv's
                kwargs.update(sender_timeout=5.0, reducer_timeout=10.0)
            averagers[name, engine_name] = cls([t.clone() for t in local], **kwargs)
    results = []
    rounds: dict[tuple[str, str], list[dict]] = {key: [] for key in averagers}
    for name in spec["compressions"]:
        for index in range(spec["rounds"] + 1):  # round 0 warms up (connections, allocations)
            for engine_name in spec["engines"]:  # engines alternate round by round: both see the same load
                round_ = run_round(averagers[name, engine_name], local, local_flat, mean_flat, spec["step_timeout"])
                if index > 0:
                    rounds[name, engine_name].append(round_)
    results = [{"compression": n, "engine": e, **payloads[n], "rounds": r} for (n, e), r in rounds.items()]
    for averager in averagers.values():
        averager.shutdown()
    print(json.dumps({"rank": rank, "results": results}), flush=True)
    dht.shutdown()


def hivemind_compression(name: str) -> Any:
    """hivemind's own codecs (decoded with trahiv's numpy-2 decoders, without which 8-bit fails under numpy 2)."""
    from hivemind import compression as hc

    from trahiv.compression import SIZE_ADAPTIVE_THRESHOLD

    return {
        "none": hc.NoCompression, "fp16": hc.Float16Compression, "scaled_fp16": hc.ScaledFloat16Compression,
        "uniform8bit": hc.Uniform8BitQuantization, "quantile8bit": hc.Quantile8BitQuantization,
        "blockwise8bit": hc.BlockwiseQuantization,
        "size_adaptive": lambda: hc.SizeAdaptiveCompression(
            SIZE_ADAPTIVE_THRESHOLD, less=hc.Float16Compression(), greater_equal=hc.Uniform8BitQuantization()
        ),
    }[name]()  # fmt: skip


def peer_cpu_seconds() -> float:
    """CPU seconds used so far by this process's children (averagers, the DHT and its p2pd)."""
    import psutil

    total = 0.0
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            times = child.cpu_times()
            total += times.user + times.system
    return total


def run_round(averager: Any, local: list, local_flat: Any, mean_flat: Any, timeout: float) -> dict:
    """One averaging round from the local values; checks the result against the exact mean."""
    import torch

    with averager.get_tensors() as tensors:
        for tensor, value in zip(tensors, local, strict=True):
            tensor.copy_(value)
    cpu = peer_cpu_seconds()
    try:
        out, error = averager.step(timeout=timeout), None
    except Exception as e:
        out, error = None, repr(e)
    cpu = peer_cpu_seconds() - cpu
    with averager.get_tensors() as tensors:
        flat = torch.cat([t.view(-1) for t in tensors])
    round_ = {
        "seconds": out["seconds"] if out else None,
        "cpu_s": out["cpu_s"] if out else None,  # CPU time of this peer's averager process (all its threads)
        "peer_cpu_s": cpu,  # CPU time of every process of this peer (averagers, DHT, p2pd), matchmaking included
        "error": error,
        "unchanged_fraction": float((flat == local_flat).float().mean()),
        "relative_error": float((flat - mean_flat).norm() / mean_flat.norm()),
    }
    if hasattr(averager, "round_reports"):
        time.sleep(0.1)  # reports cross from the averager process
        round_["reports"] = [r.status for r in averager.round_reports()]
    return round_


def profile_compression(compression: Any, tensors: list, info_cls: Any, extract: Any) -> dict:
    """Compressed payload S and the time to compress / decompress all of it on one core."""
    started = time.perf_counter()
    messages = [compression.compress(t, info_cls.from_tensor(t, key=i)) for i, t in enumerate(tensors)]
    compress_s = time.perf_counter() - started
    started = time.perf_counter()
    for message in messages:
        extract(message)
    return {
        "payload_bytes": sum(m.ByteSize() for m in messages),
        "compress_s": round(compress_s, 3),
        "decompress_s": round(time.perf_counter() - started, 3),
    }


# --- the driver ---------------------------------------------------------------------------------------------------


def run_swarm(args: argparse.Namespace, peers: int, mbit: float) -> list[dict]:
    namespaces = Namespaces(peers) if mbit > 0 else None
    procs: list[subprocess.Popen] = []
    with namespaces or contextlib.nullcontext():
        if namespaces is not None:
            namespaces.shape(mbit, args.queue_ms)
        try:
            initial: list[str] = []
            for rank in range(peers):
                spec = {
                    "rank": rank, "peers": peers, "params": args.params, "compressions": args.compressions,
                    "engines": args.engines, "rounds": args.rounds, "matchmaking_time": args.matchmaking_time,
                    "step_timeout": args.step_timeout, "trahiv_part_bytes": args.trahiv_part_bytes,
                    "host": namespaces.ip(rank) if namespaces else "127.0.0.1", "initial_peers": initial,
                }  # fmt: skip
                cmd = [sys.executable, __file__, "--worker", json.dumps(spec)]
                procs.append(
                    subprocess.Popen(
                        (namespaces.wrap(rank) if namespaces else []) + cmd,
                        stdout=subprocess.PIPE,
                        text=True,
                        start_new_session=True,
                        cwd=ROOT,
                    )  # fmt: skip
                )
                if rank == 0:
                    line = procs[0].stdout.readline() if procs[0].stdout else ""
                    initial = json.loads(line)["maddrs"]
            outputs = [read_result(proc, args.step_timeout * (args.rounds + 2) * 6) for proc in procs]
        finally:
            for proc in procs:
                stop(proc)
    return summarize(outputs, peers, mbit)


def read_result(proc: subprocess.Popen, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith('{"rank"'):
            return json.loads(line)
        if time.monotonic() > deadline:
            break
    raise RuntimeError(f"peer {proc.pid} ended without a result (exit code {proc.poll()})")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def cpu_median(by_round: list, key: str) -> float:
    """Median over rounds of the CPU seconds all peers together spent (the machine's cores are shared by all)."""
    return round(statistics.median(sum(r[key] or 0 for r in group) for group in by_round), 3)


def summarize(outputs: list[dict], peers: int, mbit: float) -> list[dict]:
    rows = []
    for index, first in enumerate(outputs[0]["results"]):
        per_peer = [out["results"][index] for out in outputs]
        rounds = [r for entry in per_peer for r in entry["rounds"]]
        by_round = list(zip(*(entry["rounds"] for entry in per_peer), strict=True))
        times = [max(r["seconds"] or float("inf") for r in group) for group in by_round]  # slowest peer per round
        payload = max(entry["payload_bytes"] for entry in per_peer)
        bound = 2 * (peers - 1) / peers * payload * 8 / (mbit * 1e6) if mbit > 0 else None
        median = statistics.median(times)
        complete = all(r["error"] is None and r["unchanged_fraction"] < 1e-4 for r in rounds)
        if first["engine"] == "trahiv":
            complete = complete and all(r.get("reports") == ["complete"] for r in rounds)
        rows.append({
            "peers": peers, "bandwidth_mbit": mbit or None, "compression": first["compression"],
            "engine": first["engine"], "payload_bytes": payload, "bound_s": round(bound, 3) if bound else None,
            "median_s": round(median, 3), "ratio_to_bound": round(median / bound, 3) if bound else None,
            "round_s": [round(t, 3) for t in times], "all_complete": complete,
            "max_unchanged_fraction": max(r["unchanged_fraction"] for r in rounds),
            "max_relative_error": round(max(r["relative_error"] for r in rounds), 5),
            "compress_s": first["compress_s"], "decompress_s": first["decompress_s"],
            "median_cpu_s_all_peers": cpu_median(by_round, "cpu_s"),
            "median_peer_cpu_s_all_peers": cpu_median(by_round, "peer_cpu_s"),
            "errors": sorted({r["error"] for r in rounds if r["error"]}),
        })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peers", type=int, nargs="+", default=[4])
    parser.add_argument("--bandwidths", type=float, nargs="+", default=[100.0], help="Mbit/s per link; 0 = loopback")
    parser.add_argument("--params", type=int, default=8 * 2**20)
    parser.add_argument("--compressions", nargs="+", default=["fp16", "uniform8bit", "size_adaptive"])
    parser.add_argument(
        "--engines", nargs="+", default=["hivemind", "trahiv"], choices=["hivemind", "hivemind-timeouts", "trahiv"]
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--queue-ms", type=float, default=200.0, help="tbf queue (latency) on each shaped link")
    parser.add_argument("--matchmaking-time", type=float, default=2.0)
    parser.add_argument("--step-timeout", type=float, default=90.0)
    parser.add_argument("--trahiv-part-bytes", type=int, default=2**19)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    if any(b > 0 for b in args.bandwidths) and os.geteuid() != 0:
        parser.error("shaped links need network namespaces: run as root, or use --bandwidths 0 (loopback)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # SystemExit unwinds: workers stopped, namespaces deleted
    load_before = os.getloadavg()
    started = time.time()
    rows = [row for peers in args.peers for mbit in args.bandwidths for row in run_swarm(args, peers, mbit)]
    print(json.dumps({
        "benchmark": "averaging_round", "params": len(lora_shapes(args.params)) * LORA_RANK * HIDDEN,
        "tensors": len(lora_shapes(args.params)), "rounds": args.rounds, "queue_ms": args.queue_ms,
        "cpu_count": os.cpu_count(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()], "wall_s": round(time.time() - started, 1),
        "command": " ".join([Path(sys.executable).name, *sys.argv]), "results": rows,
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
