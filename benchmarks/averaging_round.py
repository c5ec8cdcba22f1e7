"""Benchmark 1, one averaging round: N peers average P parameters (LoRA-shaped), each peer its own process.

Prints JSON. Run (as root, for shaped links):
    .venv/bin/python benchmarks/averaging_round.py --peers 4 --bandwidths 100 --engines tcp swarm --rounds 8
    .venv/bin/python benchmarks/averaging_round.py --peers 4 --bandwidths 100 50 --rounds 4     # bare averagers
    .venv/bin/python benchmarks/averaging_round.py --peers 2 4 --bandwidths 0     # 0 = loopback, no shaping

With a bandwidth B > 0 (root only) every peer runs in its own network namespace, linked by a veth pair to a bridge in
a hub namespace; `tc ... tbf` shapes each link to B Mbit/s in both directions (no netem). The namespaces are deleted
on exit, Ctrl+C included. Without root, B > 0 is refused.

Engines (`--engines`), each against the bound 2 x (N-1)/N x S / B, S = compressed payload:
- `swarm`: peers as trahiv.Trainer builds them (trahiv.swarm.Swarm from a HivemindConfig with the Trainer's defaults:
  DHT, progress tracker, metrics records, a state averager whose parameter rounds come every 5 steps, the gradient
  averager), training --rounds + 1 collaborative steps of one local batch each with fixed gradients. Gradient and
  parameter rounds are reported apart: the slowest peer's all-reduce per round (from its own start: the start skew,
  how far apart the peers began, is in it and reported too), the CPU each role of the peers' process trees used
  during it (main, this averager, DHT, p2pd, other), and the DHT messages and requests by key. Each step's update is
  checked: the sample-weighted mean of the peers' gradients up to the compression's error, no value left local.
  Since stop 50 the defaults' gradient rounds are trahiv's ring all-reduce (`opt.allreduce = "auto"`,
  trahiv.engine.ring); parameter rounds stay on the butterfly. A ring round's time is split too: each peer's time
  before its ring began (`before_ring_s_median`) and after it ended (`after_ring_s_median`: the results copied in),
  how far apart the peers' rings began (`ring_start_skew_s`), and the ring from the last peer's start to the last end
  (`ring_from_last_start_s`).
- `swarm-butterfly` / `swarm-ring`: the same peers with `opt.allreduce` set to "butterfly" (hivemind's all-reduce) or
  "ring" (the default's choice here, named).
- `tcp`: the same bytes over plain TCP between the same namespaces, each peer exchanging 2 x S / N with each other
  peer at once from a common start: what the links allow, without libp2p or Python per part.
- `tcp-ring`: the same bytes over plain TCP, each peer's 2 (N - 1) / N x S all to the next peer: one flow per link
  and direction (a ring all-reduce's traffic, without its dependencies).
- `tcp-shifted`: the same bytes as `tcp`, each peer's 2 x S / N to each other peer in turn (the next peer first):
  one flow per link and direction at a time, as a butterfly whose senders take their peers in a shifted order.
- `tcp-ring-allreduce`: a ring all-reduce's dependencies over plain TCP: S in N segments of `--trahiv-part-bytes`
  parts, 2 (N - 1) steps, each peer sending the next peer one segment a step and a part of it only once it has
  received that part from the previous peer (its own segment first); no compute, one connection each way.
  `p2p-ring-allreduce`: the same over libp2p streams (each peer's DHT and p2pd, as `p2p-butterfly`). With
  `--ring-compute` (fp16, uniform8bit: trahiv's codec, as its ring runs it) each part received in the reduce-scatter
  is decoded, added to the peer's own values and encoded before it goes on, and one received in the all-gather
  decoded.
- `tcp-butterfly`: the same bytes over plain TCP with the butterfly all-reduce's dependencies: each peer sends each
  other peer that peer's span (S / N) in parts of `--trahiv-part-bytes`, and a reducer returns a part once every
  sender's copy of it arrived; no compute, no libp2p: what the pattern costs on these links.
- `p2p-butterfly`: the same pattern over libp2p streams (each peer's DHT and p2pd, as the averagers use them), raw
  bytes: no protobuf, no compute. A round it cannot finish within --step-timeout is reported in the JSON ("errors"):
  with parts under 512 KiB streams hung or lost their ends in most loopback runs (not explained; see README).
`--tensors N` averages N equal tensors instead of LoRA's 65,536-value ones (parts are cut within each tensor).
- `hivemind` / `trahiv`: bare averagers, alternating round by round in the same peers: plain DecentralizedAverager
  (as shipped apart from trahiv's numpy-2 decoders) and trahiv.engine.averagers.ReportingAverager (robust reducer,
  payload-based deadlines, round reports, `--trahiv-part-bytes`); every value checked against the exact mean.
The machine's load average before and after is in the JSON: a run on a busy machine is not a measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LORA_RANK, HIDDEN = 16, 4096  # LoRA of a 7B model: A (16 x 4096) and B (4096 x 16), 65,536 values each
HUB, PREFIX, SUBNET = "h5hub", "h5p", "10.213.0"
NOT_AVERAGERS = (
    "swarm",
    "swarm-ring",
    "swarm-butterfly",
    "tcp",
    "tcp-ring",
    "tcp-shifted",
    "tcp-ring-allreduce",
    "p2p-ring-allreduce",
    "tcp-butterfly",
    "p2p-butterfly",
)


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


def lora_shapes(params: int, tensors: int | None = None) -> list[tuple[int, int]]:
    """LoRA's A and B of a 7B model, 65,536 values each, or `tensors` equal ones (`--tensors`)."""
    if tensors:
        return [(2 * LORA_RANK, params // tensors // (2 * LORA_RANK))] * tensors
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

    shapes = lora_shapes(spec["params"], spec.get("tensors"))
    gen = torch.Generator().manual_seed(1234)
    mean = [torch.randn(shape, generator=gen) for shape in shapes]  # the exact average of all peers' tensors
    spread = [torch.randn(shape, generator=gen) for shape in shapes]
    offset = rank - (peers - 1) / 2  # offsets sum to zero over the peers
    local = [m + offset * s for m, s in zip(mean, spread, strict=True)]
    mean_flat, local_flat = torch.cat([t.view(-1) for t in mean]), torch.cat([t.view(-1) for t in local])

    class Timed:
        async def _aggregate_with_group(self, group_info, min_vector_size, **kwargs):
            started, cpu, roles = time.perf_counter(), time.process_time(), cpu_by_role()
            await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)  # type: ignore[misc]
            after = cpu_by_role()
            by_role = {role: round(after.get(role, 0.0) - roles.get(role, 0.0), 3) for role in after}
            return {"seconds": time.perf_counter() - started, "cpu_s": time.process_time() - cpu, "by_role": by_role}

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


def swarm_worker(spec: dict) -> None:
    """A peer as trahiv.Trainer builds it (trahiv.swarm.Swarm from a HivemindConfig with the Trainer's defaults: DHT,
    progress tracker, metrics records, state averager averaging parameters every 5 steps, the gradient averager),
    training --rounds + 1 collaborative steps of one local batch per peer with these gradients. SGD with lr 1 from
    zeros: each step moves the parameters by minus the averaged gradients, checked against the exact mean."""
    import torch
    from hivemind.compression import CompressionInfo, deserialize_torch_tensor

    from trahiv.compression import make_compression
    from trahiv.config import HivemindConfig
    from trahiv.engine import dht_stats
    from trahiv.engine.averagers import ReportingMixin
    from trahiv.engine.ring import RingRoundRunner
    from trahiv.swarm import Swarm, join_addresses, model_fingerprint

    dht_stats.install()  # DHT messages and requests by key, per round (before the Swarm forks its DHT)

    torch.set_num_threads(1)
    rank, peers, name = spec["rank"], spec["peers"], spec["compressions"][0]
    rounds_file = Path(spec["rounds_file"])
    original = ReportingMixin._run_allreduce_inplace_
    original_ring, ring_walls = RingRoundRunner._ring, {}

    async def ring_timed(self: Any) -> Any:  # a ring round's own span, within the averager's (wall clock)
        began = time.time()
        try:
            return await original_ring(self)
        finally:
            ring_walls[self.group_id] = (began, time.time())

    RingRoundRunner._ring = ring_timed  # type: ignore[method-assign]

    def dht_counts(dht: Any) -> Counter:
        return Counter({**dht_stats.dht_message_counts(dht), **dht_stats.dht_request_counts(dht)})

    async def timed(self: Any, tensors: Any, group_info: Any, **kwargs: Any) -> None:  # in an averager process
        # The probes stay off the round's path (until stop 64 they ran before it, blocking this process for up to
        # 49 ms while its groupmates waited): the CPU by role is read from a process list walked once (a few /proc
        # reads), and the DHT's counts, a request to the DHT's process, come back in a thread while the round begins
        # (so the DHT messages of the round's first milliseconds may count in the round before).
        probe = time.perf_counter()
        roles = cpu_by_role()
        counts = asyncio.get_running_loop().run_in_executor(None, dht_counts, self.dht)
        started, wall = time.perf_counter(), time.time()
        try:
            await original(self, tensors, group_info, **kwargs)
        finally:
            seconds, end = time.perf_counter() - started, time.time()
            after = cpu_by_role()
            dht = {k: v for k, v in (dht_counts(self.dht) - await counts).items() if k not in ("sent", "received")}
            row = {"averager": self.prefix, "group": group_info.group_id.hex(), "size": len(group_info.peer_ids),
                   "key": self._matchmaking.group_key_manager.current_key, "peer": str(self.peer_id)[-6:],
                   "seconds": seconds, "start": wall, "end": end, "dht": dht, "probe_s": started - probe,
                   "ring": ring_walls.pop(group_info.group_id, None),
                   "by_role": {k: round(after.get(k, 0.0) - roles.get(k, 0.0), 3) for k in after}}  # fmt: skip
            with rounds_file.open("a") as f:
                f.write(json.dumps(row) + "\n")

    ReportingMixin._run_allreduce_inplace_ = timed  # type: ignore[method-assign]  (before the averagers fork)
    if os.environ.get("HIVEMIND_LOGLEVEL") == "DEBUG":  # trahiv's DEBUG lines too (its averagers fork below)
        from trahiv.swarm import show_swarm_events

        show_swarm_events()
        logging.getLogger("trahiv").setLevel(logging.DEBUG)
    config = HivemindConfig.model_validate({
        "dht": {"host_maddrs": [f"/ip4/{spec['host']}/tcp/0"], "initial_peers": spec["initial_peers"],
                "nat_port_map": False},
        "opt": {"run_id": "averaging_round", "target_batch_size": peers, "batch_size_per_step": 1, "min_peers": peers,
                "matchmaking_time": spec["matchmaking_time"], "grad_compression": name,
                "state_averaging_compression": name, "averager_opts": {"part_size_bytes": spec["part_bytes"]},
                "average_state_every": spec["average_state_every"],
                **({"allreduce": spec["allreduce"]} if spec.get("allreduce") else {})},
    })  # fmt: skip
    swarm = Swarm(config, announce=lambda _: None)
    print(json.dumps({"maddrs": join_addresses(swarm.dht)}), flush=True)
    shapes = lora_shapes(spec["params"], spec.get("tensors"))
    gen = torch.Generator().manual_seed(1234)
    mean = [torch.randn(shape, generator=gen) for shape in shapes]
    spread = [torch.randn(shape, generator=gen) for shape in shapes]
    local = [m + (rank - (peers - 1) / 2) * s for m, s in zip(mean, spread, strict=True)]
    mean_flat, local_flat = torch.cat([t.view(-1) for t in mean]), torch.cat([t.view(-1) for t in local])
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
    swarm.check_model(model_fingerprint([(f"p{i}", p) for i, p in enumerate(params)], params))
    optimizer = swarm.make_optimizer([{"params": params}], lambda g: torch.optim.SGD(g, lr=1.0), None, 1)
    swarm.mark_ready()
    swarm.wait_for_peers()
    swarm.catch_up()
    offset, spread_flat = rank - (peers - 1) / 2, torch.cat([t.view(-1) for t in spread])
    checks, batches, deadline = [], 0, time.monotonic() + spec["step_timeout"] * (spec["rounds"] + 2)
    while optimizer.local_epoch < spec["rounds"] + 1 and time.monotonic() < deadline:
        time.sleep(spec["compute_s"])  # forward + backward on an accelerator
        before = torch.cat([p.detach().view(-1) for p in params])
        for param, grad in zip(params, local, strict=True):
            param.grad = grad.clone()
        epoch, called = optimizer.local_epoch, time.time()
        optimizer.step(batch_size=1)
        returned = time.time()
        batches += 1
        swarm.publish_model()  # the Trainer's on_step_end: the model record...
        if optimizer.local_epoch > epoch:
            swarm.publish_metrics(loss=1.0)  # ... and the metrics record at each collaborative step
            # moved = the averaged gradients = mean + alpha x spread, alpha = the peers' offsets weighted by their
            # samples (checked by the driver); the rest is the compression's error
            moved = before - torch.cat([p.detach().view(-1) for p in params])
            alpha = float((moved - mean_flat) @ spread_flat / (spread_flat @ spread_flat))
            checks.append({
                "step": epoch, "time": round(time.time(), 3), "called": round(called, 3),
                "returned": round(returned, 3), "samples": batches, "offset": offset, "alpha": alpha,
                "unchanged_fraction": float((moved == local_flat).float().mean()),
                "relative_error": float((moved - mean_flat - alpha * spread_flat).norm() / mean_flat.norm()),
            })  # fmt: skip
            batches = 0
    reports = {"grad": optimizer.grad_averager, "state": optimizer.state_averager}
    statuses = {}
    for kind, averager in reports.items():
        averager.round_reports()
        statuses[kind] = [r.status for r in averager.reports]
    payload = profile_compression(make_compression(name), local, CompressionInfo, deserialize_torch_tensor)
    print(json.dumps({"rank": rank, "checks": checks, "statuses": statuses, **payload}), flush=True)
    sys.stdin.readline()  # the others may still be in their last round: leave when the driver says all are done
    swarm.shutdown()


def tcp_worker(spec: dict) -> None:
    """The network alone: each peer exchanges the bytes of a butterfly all-reduce (2 (N - 1) / N x S each way) over
    plain TCP, S / N x 2 with each other peer at once, starting at a common time; no libp2p, no Python per part."""
    import socket

    import numpy as np

    rank, peers, hosts, payload = spec["rank"], spec["peers"], spec["hosts"], spec["payload_bytes"]
    ring = spec.get("ring", False)  # `tcp-ring`: all of it to the next peer (one flow per link and direction)
    shifted = spec.get("shifted", False)  # `tcp-shifted`: to each other peer in turn, the next peer first
    ring_allreduce = spec.get("ring_allreduce", False)
    per_pair = 2 * (peers - 1) * payload // peers if ring else 2 * payload // peers
    senders = 1 if ring else peers - 1
    chunk = b"\0" * 2**20
    times = []

    async def serve() -> Any:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            left = per_pair
            while left > 0:
                data = await reader.read(min(left, 2**20))
                if not data:
                    break
                left -= len(data)
            received.set_result(None) if all_in(1) else None
            writer.close()

        return await asyncio.start_server(handle, *hosts[rank])

    count = [0]

    def all_in(n: int) -> bool:
        count[0] += n
        return count[0] == senders

    async def connect(host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        for _ in range(50):  # the others' servers may not be up yet
            try:
                reader, writer = await asyncio.open_connection(host, port)
                break
            except OSError:
                await asyncio.sleep(0.1)
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return reader, writer

    async def send(host: str, port: int) -> None:
        _, writer = await connect(host, port)
        await asyncio.sleep(max(0.0, start_at[0] - time.time()))
        left = per_pair
        while left > 0:
            writer.write(chunk[: min(left, len(chunk))])
            left -= min(left, len(chunk))
            await writer.drain()
        writer.close()
        await writer.wait_closed()

    part_bytes = b"\0" * min(spec["part_bytes"], payload // peers)

    # --- `tcp-ring-allreduce`: a ring all-reduce's dependencies over plain TCP ---------------------------------
    # S in N segments of parts; 2 (N - 1) steps: at step t a peer sends the next peer segment (rank - t) mod N, a part
    # of it once it has received that part from the previous peer at step t - 1 (its own segment at step 0): the
    # reduce-scatter's N - 1 steps, then the all-gather's; no compute, one connection each way.
    segment = payload // peers
    ring_parts = [min(spec["part_bytes"], segment - at) for at in range(0, segment, spec["part_bytes"])]
    ring_steps = 2 * (peers - 1)
    ring_rounds: dict[int, list[list[asyncio.Event]]] = {}

    def ring_ready(index: int) -> list[list[asyncio.Event]]:
        if index not in ring_rounds:
            ring_rounds[index] = [[asyncio.Event() for _ in ring_parts] for _ in range(ring_steps)]
            for event in ring_rounds[index][0]:
                event.set()
        return ring_rounds[index]

    # `--ring-compute` (fp16): what a reducer computes per part: a part received in the reduce-scatter is decoded,
    # added to this peer's own values and encoded again before it goes on; one received in the all-gather is decoded
    # into the result and forwarded as it came
    compute = spec.get("ring_compute", False) and spec["compression"] == "fp16"
    own = np.zeros(max(ring_parts) // 2, np.float32) if compute else None
    outgoing: dict[tuple[int, int, int], bytes] = {}  # (round, step, part) -> the bytes to send, once computed
    # `--ring-compute` (uniform8bit): the same with the 8-bit codec trahiv's ring runs (trahiv's encoder in hivemind's
    # wire format; until stop 59 hivemind's encoder, which takes 1.3-2.2x its time: this smallest version did more
    # work than trahiv): a part of k values is k bytes and its 256 buckets' values; decoded, added to this peer's values
    # and encoded again in the reduce-scatter, decoded and forwarded as it came in the all-gather
    codec = None
    if spec.get("ring_compute", False) and spec["compression"] == "uniform8bit":  # (torch and hivemind only then)
        import torch
        from hivemind.compression import CompressionInfo
        from hivemind.proto import runtime_pb2

        from trahiv.compression import make_compression
        from trahiv.engine import fixes

        fixes.apply()  # (hivemind's 8-bit decoders fail under numpy 2: trahiv's)
        codec = make_compression("uniform8bit")
        torch.set_num_threads(1)
        values8 = torch.from_numpy(np.random.default_rng(rank).standard_normal(max(ring_parts)).astype(np.float32))
        info8 = {size: CompressionInfo.from_tensor(values8[:size]) for size in set(ring_parts)}
        encoded8 = {size: codec.compress(values8[:size], info8[size]).SerializeToString() for size in set(ring_parts)}

        def add_own_8bit(data: bytes, size: int, reduce: bool) -> bytes:
            values = codec.extract(runtime_pb2.Tensor.FromString(data))
            if not reduce:
                return data
            encoded = codec.compress(values + values8[:size], info8[size]).SerializeToString()
            assert len(encoded) == len(encoded8[size])  # (the framing: a part's size on the wire is fixed)
            return encoded

    async def handle_ring(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        index = (await reader.readexactly(1))[0]
        ready = ring_ready(index)
        for step in range(ring_steps):
            for part, size in enumerate(ring_parts):
                data = await reader.readexactly(len(encoded8[size]) if codec is not None else size)
                if codec is not None:
                    data = add_own_8bit(data, size, reduce=step < peers - 1)
                    if step + 1 < ring_steps:
                        outgoing[index, step + 1, part] = data
                if own is not None:
                    values = np.frombuffer(data, np.float16).astype(np.float32)
                    if step < peers - 1:  # reduce-scatter: add this peer's values, send the sum on
                        data = (values + own[: values.size]).astype(np.float16).tobytes()
                if step + 1 < ring_steps:
                    if own is not None:
                        outgoing[index, step + 1, part] = data
                    ready[step + 1][part].set()
        received.set_result(None)
        writer.write(b"\1")  # all in: the sender may close (a libp2p stream closed with data in flight may lose it)
        await writer.drain()
        await reader.read()
        writer.close()

    async def send_ring(index: int, host: str, port: int) -> None:
        if p2p is not None:  # `p2p-ring-allreduce`: a libp2p stream through this peer's p2pd
            _, reader, writer = await p2p.call_binary_stream_handler(peer_ids[port - 7000], "bench_butterfly")
        else:
            reader, writer = await connect(host, port)
        writer.write(bytes([index]))
        await asyncio.sleep(max(0.0, start_at[0] - time.time()))
        ready = ring_ready(index)
        for step in range(ring_steps):
            for part, size in enumerate(ring_parts):
                await ready[step][part].wait()
                own_part = encoded8[size] if codec is not None else part_bytes[:size]
                writer.write(outgoing.pop((index, step, part), None) or own_part)
                await writer.drain()
        await reader.readexactly(1)
        writer.close()

    # --- `tcp-butterfly`: the butterfly's dependencies over plain TCP -------------------------------------------
    # Each peer reduces a span of S / N; each other peer sends it that span in parts and gets the part back once every
    # sender's copy of it arrived (as an all-reduce's reducer returns the averaged part), no compute, no libp2p.
    span = payload // peers
    part_sizes = [min(spec["part_bytes"], span - at) for at in range(0, span, spec["part_bytes"])]
    reducing: dict[int, dict] = {}

    def reducer(index: int) -> dict:
        if index not in reducing:
            state = {"writers": [], "count": [0] * len(part_sizes), "ready": asyncio.Queue()}
            state["done"] = asyncio.ensure_future(respond(state))
            reducing[index] = state
        return reducing[index]

    async def respond(state: dict) -> None:
        for _ in part_sizes:
            part = await state["ready"].get()
            for writer in state["writers"]:
                writer.write(part_bytes[: part_sizes[part]])
            await asyncio.gather(*(writer.drain() for writer in state["writers"]))

    async def handle_butterfly(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        index = (await reader.readexactly(1))[0]
        state = reducer(index)
        state["writers"].append(writer)
        for part, size in enumerate(part_sizes):
            await reader.readexactly(size)
            state["count"][part] += 1
            if state["count"][part] == peers - 1:
                state["ready"].put_nowait(part)
        await state["done"]
        await reader.read()  # the sender closes first: a libp2p stream closed with data in flight may lose it
        writer.close()

    async def send_butterfly(index: int, host: str, port: int) -> None:
        if p2p is not None:  # `p2p-butterfly`: a libp2p stream through this peer's p2pd, as the averagers' are
            _, reader, writer = await p2p.call_binary_stream_handler(peer_ids[port - 7000], "bench_butterfly")
        else:
            reader, writer = await connect(host, port)
        writer.write(bytes([index]))
        await asyncio.sleep(max(0.0, start_at[0] - time.time()))

        async def push() -> None:
            for size in part_sizes:
                writer.write(part_bytes[:size])
                await writer.drain()

        async def pull() -> None:
            await reader.readexactly(span)

        await asyncio.gather(push(), pull())
        writer.close()

    async def run() -> None:
        nonlocal received, p2p
        butterfly = spec.get("butterfly", False)
        if spec.get("p2p"):
            import hivemind
            from hivemind.p2p import PeerID
            from hivemind.utils import get_dht_time

            dht = hivemind.DHT(start=True, host_maddrs=[f"/ip4/{hosts[rank][0]}/tcp/0"],
                               initial_peers=spec["initial_peers"], nat_port_map=False)  # fmt: skip
            if rank == 0:
                print(json.dumps({"maddrs": [str(m) for m in dht.get_visible_maddrs()]}), flush=True)
            p2p = await dht.replicate_p2p()
            handle = handle_ring if ring_allreduce else handle_butterfly
            await p2p.add_binary_stream_handler("bench_butterfly", lambda _, r, w: handle(r, w))
            dht.store(f"bench_peer_{rank}", p2p.peer_id.to_base58(), get_dht_time() + 600)
            for other in range(peers):
                for _ in range(100):  # bounded: the others store theirs within seconds
                    found = dht.get(f"bench_peer_{other}", latest=True)
                    if found is not None:
                        peer_ids[other] = PeerID.from_base58(found.value)
                        break
                    await asyncio.sleep(0.2)
            server: Any = None
        else:
            handler = handle_ring if ring_allreduce else handle_butterfly if butterfly else None
            server = await asyncio.start_server(handler, *hosts[rank]) if handler else await serve()
            if rank == 0:  # (the driver reads the first peer's addresses)
                print(json.dumps({"maddrs": []}), flush=True)

        async def one_round(index: int) -> None:
            if ring_allreduce:
                await send_ring(index, *hosts[(rank + 1) % peers])
            elif butterfly:
                await asyncio.gather(*(send_butterfly(index, *h) for i, h in enumerate(hosts) if i != rank))
                await reducer(index)["done"]  # this peer's own span returned to every sender
                received.set_result(None)
            elif ring:
                await send(*hosts[(rank + 1) % peers])
            elif shifted:
                for k in range(1, peers):
                    await send(*hosts[(rank + k) % peers])
            else:
                await asyncio.gather(*(send(*h) for i, h in enumerate(hosts) if i != rank))
            await received

        for index in range(spec["rounds"] + 1):
            received = asyncio.get_running_loop().create_future()
            count[0] = 0
            start_at[0] = float(sys.stdin.readline())  # a common start, from the driver
            try:
                await asyncio.wait_for(one_round(index), spec["step_timeout"])
            except (TimeoutError, asyncio.IncompleteReadError, OSError) as e:  # reported, not waited for
                print(json.dumps({"done": index, "error": f"peer {rank}: {e!r}"}), flush=True)
                os._exit(1)
            if index > 0:
                times.append(time.time() - start_at[0])
            print(json.dumps({"done": index}), flush=True)
        server.close() if server is not None else None

    received: Any = None
    p2p: Any = None
    peer_ids: dict[int, Any] = {}
    start_at = [0.0]
    asyncio.run(run())
    print(json.dumps({"rank": rank, "seconds": times}), flush=True)


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


def cpu_by_role() -> dict[str, float]:
    """CPU seconds so far of this peer's processes by role (called in an averager process: its parent is the peer):
    main, this averager, the DHT (p2pd's parent), p2pd, other (the peer's other averagers, torch's shm manager)."""
    import psutil

    tree = _TREES.get(os.getpid())
    if tree is None:  # walked once per process: a walk reads every process's /proc entries (tens of ms when busy)
        me = psutil.Process()
        root = me.parent()
        procs = [root, *root.children(recursive=True)]
        daemons = {p.pid: p.ppid() for p in procs if p.name().startswith("p2pd")}
        tree = _TREES[os.getpid()] = [
            (
                "this_averager" if proc.pid == me.pid
                else "main" if proc.pid == root.pid
                else "p2pd" if proc.pid in daemons
                else "dht" if proc.pid in daemons.values()
                else "other",
                proc,
            )
            for proc in procs
        ]  # fmt: skip
    totals: dict[str, float] = {}
    for role, proc in tree:
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            totals[role] = totals.get(role, 0.0) + times.user + times.system
    return totals


_TREES: dict[int, list] = {}  # cpu_by_role's walk of the peer's processes, by the pid of the process that walked it


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
        "cpu_s": out["cpu_s"] if out else None,
        "by_role": out.get("by_role") if out else None,  # CPU time of this peer's averager process (all its threads)
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
    """The engines' bare averagers (alternating), then trahiv's swarm peers (one compression after the other)."""
    rows = []
    if [e for e in args.engines if e not in NOT_AVERAGERS]:
        rows += run_averagers(args, peers, mbit)
    for name in args.compressions:
        if "tcp" in args.engines:
            rows += run_tcp(args, peers, mbit, name)
        if "tcp-ring" in args.engines:
            rows += run_tcp(args, peers, mbit, name, ring=True)
        if "tcp-shifted" in args.engines:
            rows += run_tcp(args, peers, mbit, name, shifted=True)
        if "tcp-ring-allreduce" in args.engines:
            rows += run_tcp(args, peers, mbit, name, ring_allreduce=True)
        if "p2p-ring-allreduce" in args.engines:
            rows += run_tcp(args, peers, mbit, name, p2p=True, ring_allreduce=True)
        if "tcp-butterfly" in args.engines:
            rows += run_tcp(args, peers, mbit, name, butterfly=True)
        if "p2p-butterfly" in args.engines:
            rows += run_tcp(args, peers, mbit, name, butterfly=True, p2p=True)
        if "swarm" in args.engines:
            rows += run_swarm_peers(args, peers, mbit, name)
        if "swarm-butterfly" in args.engines:
            rows += run_swarm_peers(args, peers, mbit, name, allreduce="butterfly")
        if "swarm-ring" in args.engines:
            rows += run_swarm_peers(args, peers, mbit, name, allreduce="ring")
    return rows


def launch(args: argparse.Namespace, namespaces: Namespaces | None, peers: int, spec: dict) -> list[subprocess.Popen]:
    """Start the peers, each with `spec` + its rank, host and the first peer's addresses as initial peers."""
    procs: list[subprocess.Popen] = []
    initial: list[str] = []
    for rank in range(peers):
        host = namespaces.ip(rank) if namespaces else "127.0.0.1"
        cmd = [sys.executable, __file__, "--worker", json.dumps({**spec, "rank": rank, "host": host,
                                                                  "initial_peers": initial})]  # fmt: skip
        prefix = namespaces.wrap(rank) if namespaces else []
        procs.append(subprocess.Popen(prefix + cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                      start_new_session=True, cwd=ROOT))  # fmt: skip
        if rank == 0:
            initial = json.loads(procs[0].stdout.readline() if procs[0].stdout else "")["maddrs"]
    return procs


def run_tcp(
    args: argparse.Namespace,
    peers: int,
    mbit: float,
    name: str,
    butterfly: bool = False,
    p2p: bool = False,
    ring: bool = False,
    shifted: bool = False,
    ring_allreduce: bool = False,
) -> list[dict]:
    """The same bytes over plain TCP between the same namespaces: what the links allow (see tcp_worker); with
    `butterfly`, in parts that a reducer returns once every sender's copy arrived; with `p2p`, over libp2p streams;
    with `ring`, each peer's bytes all to the next peer; with `shifted`, to each other peer in turn; with
    `ring_allreduce`, to the next peer in a ring all-reduce's steps (a part forwarded once received)."""
    namespaces = Namespaces(peers) if mbit > 0 else None
    payload = sum(a * b for a, b in lora_shapes(args.params, args.tensors)) * {"none": 4, "fp16": 2}.get(name, 1)
    procs: list[subprocess.Popen] = []
    with namespaces or contextlib.nullcontext():
        if namespaces is not None:
            namespaces.shape(mbit, args.queue_ms)
        hosts = [[namespaces.ip(i) if namespaces else "127.0.0.1", 7000 + i] for i in range(peers)]
        spec = {"tcp": True, "peers": peers, "hosts": hosts, "payload_bytes": payload, "rounds": args.rounds,
                "butterfly": butterfly, "p2p": p2p, "ring": ring, "shifted": shifted, "ring_allreduce": ring_allreduce,
                "part_bytes": args.trahiv_part_bytes, "step_timeout": args.step_timeout, "compression": name,
                "ring_compute": args.ring_compute}  # fmt: skip
        try:
            procs = launch(args, namespaces, peers, spec)
            failed = []
            for index in range(args.rounds + 1):
                start_at = f"{time.time() + 1.0}\n"
                for proc in procs:
                    proc.stdin.write(start_at) if proc.stdin else None
                    proc.stdin.flush() if proc.stdin else None
                for proc in procs:  # each worker answers within --step-timeout: done, or why not
                    reply = json.loads((proc.stdout.readline() if proc.stdout else "") or '{"error": "exited"}')
                    failed += [f"round {index}: {reply['error']}"] if "error" in reply else []
                if failed:
                    break
            outputs = [] if failed else [read_result(proc, args.step_timeout) for proc in procs]
        finally:
            for proc in procs:
                stop(proc)
    computing = (
        f", {name} decode, add, encode per part"
        if ring_allreduce and args.ring_compute and name in ("fp16", "uniform8bit")
        else ""
    )
    engine = (
        f"p2p-ring-allreduce (libp2p streams{computing})"
        if p2p and ring_allreduce
        else "p2p-butterfly (libp2p streams)"
        if p2p
        else "tcp-butterfly (parts returned once all senders' arrived)"
        if butterfly
        else f"tcp-ring-allreduce (a ring all-reduce's steps, parts forwarded once received{computing})"
        if ring_allreduce
        else "tcp-ring (the bytes alone, each peer's to the next)"
        if ring
        else "tcp-shifted (the bytes alone, to each other peer in turn)"
        if shifted
        else "tcp (the bytes alone)"
    )
    if failed:
        return [{"peers": peers, "bandwidth_mbit": mbit or None, "compression": name, "engine": engine,
                 "errors": failed}]  # fmt: skip
    times = [max(group) for group in zip(*(out["seconds"] for out in outputs), strict=True)]
    bound = 2 * (peers - 1) / peers * payload * 8 / (mbit * 1e6) if mbit > 0 else None
    median = statistics.median(times)
    return [{
        "peers": peers, "bandwidth_mbit": mbit or None, "compression": name, "engine": engine,
        "payload_bytes": payload, "bound_s": round(bound, 3) if bound else None, "median_s": round(median, 3),
        "ratio_to_bound": round(median / bound, 3) if bound else None, "round_s": [round(t, 3) for t in times],
    }]  # fmt: skip


def run_swarm_peers(
    args: argparse.Namespace, peers: int, mbit: float, name: str, allreduce: str | None = None
) -> list[dict]:
    namespaces = Namespaces(peers) if mbit > 0 else None
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as tmp, namespaces or contextlib.nullcontext():
        if namespaces is not None:
            namespaces.shape(mbit, args.queue_ms)
        spec = {"swarm": True, "peers": peers, "params": args.params, "tensors": args.tensors, "compressions": [name],
                "rounds": args.rounds, "matchmaking_time": args.swarm_matchmaking_time,
                "step_timeout": args.step_timeout, "compute_s": args.compute_s, "part_bytes": args.trahiv_part_bytes,
                "average_state_every": args.average_state_every, "allreduce": allreduce}  # fmt: skip
        try:
            procs = launch(args, namespaces, peers, {**spec, "rounds_file": f"{tmp}/rounds.jsonl"})
            outputs = [read_result(proc, args.step_timeout * (args.rounds + 2) * 2) for proc in procs]
            for proc in procs:  # every peer is done: they may leave
                with contextlib.suppress(OSError):
                    proc.stdin.close() if proc.stdin else None
            for proc in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(30)
        finally:
            for proc in procs:
                stop(proc)
        rows = [json.loads(line) for line in Path(f"{tmp}/rounds.jsonl").read_text().splitlines() if line.strip()]
    engine = f"swarm-{allreduce}" if allreduce else "swarm"
    return summarize_swarm(outputs, rows, peers, mbit, name, engine, args.average_state_every)


def summarize_swarm(
    outputs: list[dict],
    rows: list[dict],
    peers: int,
    mbit: float,
    name: str,
    engine: str = "swarm",
    average_state_every: int = 5,
) -> list[dict]:
    """One row per kind of round (gradients, parameters): the slowest peer's all-reduce per round, rounds matched by
    group; the first gradient round (connections, allocations) is left out as warm-up. Gradient rounds also get the
    steps as a user waits for them (`step_from_last_batch_s`): from the moment the step's last batch reached its
    peer's optimizer to the moment the last peer's `step()` returned with the update applied (the waits for the
    others' reports and the matchmaking that came after that batch included, the benchmark's own checks left out),
    over the steps without a parameter round (and the first)."""
    result = []
    for kind in ("grad", "state"):
        groups: dict[str, list[dict]] = {}
        for row in rows:
            if row["averager"].endswith(f"_{kind}_averager"):
                groups.setdefault(row["group"], []).append(row)
        by_round = list(groups.values())[1 if kind == "grad" else 0 :]
        if not by_round:
            continue
        times = [max(r["seconds"] for r in group) for group in by_round]
        payload = max(out["payload_bytes"] for out in outputs)
        bound = 2 * (peers - 1) / peers * payload * 8 / (mbit * 1e6) if mbit > 0 else None
        median = statistics.median(times)
        statuses = [s for out in outputs for s in out["statuses"][kind]]
        checks = [c for out in outputs for c in out["checks"]]
        by_step: dict[int, list[dict]] = {}
        for check in checks:
            by_step.setdefault(check["step"], []).append(check)
        weighting_errors = [  # |alpha - the offsets weighted by samples|: 0 for the exact sample-weighted mean
            max(abs(c["alpha"] - sum(x["samples"] * x["offset"] for x in cs) / sum(x["samples"] for x in cs))
                for c in cs)
            for cs in by_step.values() if len(cs) == peers
        ]  # fmt: skip
        complete = all(s == "complete" for s in statuses) and all(len(g) == peers for g in by_round)
        whole_steps = [  # (the steps every peer checked; a parameter round ends step s when s + 1 is a multiple)
            max(c["returned"] for c in cs) - max(c["called"] for c in cs)
            for step, cs in sorted(by_step.items())
            if len(cs) == peers and step >= 1 and (step + 1) % average_state_every != 0
        ] if kind == "grad" else []  # fmt: skip
        if kind == "grad":
            complete = complete and all(c["unchanged_fraction"] < 1e-4 for c in checks)
        roles = sorted({role for group in by_round for r in group for role in r["by_role"]})
        spans = [max(r["end"] for r in g) - min(r["start"] for r in g) for g in by_round]
        skews = [max(r["start"] for r in g) - min(r["start"] for r in g) for g in by_round]
        rings = [g for g in by_round if all(r.get("ring") for r in g)]  # ring rounds: where each peer's time went
        ring_split = {
            "ring_start_skew_s": [round(max(r["ring"][0] for r in g) - min(r["ring"][0] for r in g), 3) for g in rings],
            "before_ring_s_median": [round(statistics.median(r["ring"][0] - r["start"] for r in g), 3) for g in rings],
            "after_ring_s_median": [round(statistics.median(r["end"] - r["ring"][1] for r in g), 3) for g in rings],
            "ring_from_last_start_s": [round(max(r["ring"][1] for r in g) - max(r["ring"][0] for r in g), 3)
                                       for g in rings],
        } if rings else {}  # fmt: skip
        result.append({
            "peers": peers, "bandwidth_mbit": mbit or None, "compression": name, "engine": f"{engine} ({kind} rounds)",
            "span_s": [round(t, 3) for t in spans], "start_skew_s": [round(t, 3) for t in skews], **ring_split,
            "probe_s_max": round(max(r.get("probe_s", 0.0) for g in by_round for r in g), 3),
            "payload_bytes": payload, "bound_s": round(bound, 3) if bound else None, "median_s": round(median, 3),
            "group_sizes": [max(r["size"] for r in group) for group in by_round],
            "ratio_to_bound": round(median / bound, 3) if bound else None, "round_s": [round(t, 3) for t in times],
            "all_complete": complete, "statuses": {s: statuses.count(s) for s in set(statuses)},
            "max_relative_error": round(max((c["relative_error"] for c in checks), default=0.0), 5)
            if kind == "grad" else None,
            "max_weighting_error": round(max(weighting_errors, default=0.0), 5) if kind == "grad" else None,
            **({
                "step_from_last_batch_s": [round(t, 3) for t in whole_steps],
                "step_from_last_batch_ratio_to_bound":
                    round(statistics.median(whole_steps) / bound, 3) if bound else None,
            } if whole_steps else {}),
            "samples_per_step": sorted({sum(c["samples"] for c in cs) for cs in by_step.values()})
            if kind == "grad" else None,
            "compress_s": outputs[0]["compress_s"], "decompress_s": outputs[0]["decompress_s"],
            "allreduce_cpu_s_by_role": {
                role: round(statistics.median(sum(r["by_role"].get(role, 0.0) for r in g) for g in by_round), 3)
                for role in roles
            },
            "allreduce_dht_all_peers": {
                key: statistics.median(sum(r["dht"].get(key, 0) for r in g) for g in by_round)
                for key in sorted({k for g in by_round for r in g for k in r["dht"]})
            },
        })  # fmt: skip
    return result


def run_averagers(args: argparse.Namespace, peers: int, mbit: float) -> list[dict]:
    namespaces = Namespaces(peers) if mbit > 0 else None
    procs: list[subprocess.Popen] = []
    with namespaces or contextlib.nullcontext():
        if namespaces is not None:
            namespaces.shape(mbit, args.queue_ms)
        spec = {
            "peers": peers, "params": args.params, "tensors": args.tensors, "compressions": args.compressions,
            "engines": [e for e in args.engines if e not in NOT_AVERAGERS], "rounds": args.rounds,
            "matchmaking_time": args.matchmaking_time, "step_timeout": args.step_timeout,
            "trahiv_part_bytes": args.trahiv_part_bytes,
        }  # fmt: skip
        try:
            procs = launch(args, namespaces, peers, spec)
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
    # the worker's own children (its DHT process, p2pd) are in its session's group and outlive a worker that failed
    # and exited: three DHT processes of a failed p2p-ring-allreduce run were left running for an hour (stop 51)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def cpu_median(by_round: list, key: str) -> float:
    """Median over rounds of the CPU seconds all peers together spent (the machine's cores are shared by all)."""
    return round(statistics.median(sum(r[key] or 0 for r in group) for group in by_round), 3)


def roles_median(by_round: list) -> dict[str, float]:
    """Median over rounds of the CPU seconds all peers' processes spent during the all-reduce, by role."""
    roles = sorted({role for group in by_round for r in group for role in (r.get("by_role") or {})})
    return {
        role: round(
            statistics.median(sum((r.get("by_role") or {}).get(role, 0.0) for r in group) for group in by_round), 3
        )
        for role in roles
    }


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
            "allreduce_cpu_s_by_role": roles_median(by_round),
            "errors": sorted({r["error"] for r in rounds if r["error"]}),
        })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peers", type=int, nargs="+", default=[4])
    parser.add_argument("--bandwidths", type=float, nargs="+", default=[100.0], help="Mbit/s per link; 0 = loopback")
    parser.add_argument("--params", type=int, default=8 * 2**20)
    parser.add_argument("--tensors", type=int, help="that many equal tensors instead of LoRA's (65,536 values each)")
    parser.add_argument("--compressions", nargs="+", default=["fp16", "uniform8bit", "size_adaptive"])
    parser.add_argument(
        "--engines", nargs="+", default=["hivemind", "trahiv"],
        choices=["hivemind", "hivemind-timeouts", "trahiv", "swarm", "swarm-butterfly", "swarm-ring", "tcp", "tcp-ring",
                 "tcp-shifted",
                 "tcp-ring-allreduce", "p2p-ring-allreduce", "tcp-butterfly", "p2p-butterfly"],
        help="bare averagers of the engine alone / of trahiv (alternating round by round), or `swarm`: trahiv peers "
             "as the Trainer builds them (gradient and parameter rounds reported separately)",
    )  # fmt: skip
    parser.add_argument("--compute-s", type=float, default=0.5, help="swarm: seconds of 'compute' per local step")
    parser.add_argument("--average-state-every", type=int, default=5, help="swarm: opt.average_state_every")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--queue-ms", type=float, default=200.0, help="tbf queue (latency) on each shaped link")
    parser.add_argument("--matchmaking-time", type=float, default=2.0, help="bare averagers' matchmaking window")
    parser.add_argument("--swarm-matchmaking-time", type=float, default=15.0,
                        help="swarm peers' opt.matchmaking_time (the Trainer's default: 15)")  # fmt: skip
    parser.add_argument("--step-timeout", type=float, default=90.0)
    parser.add_argument("--trahiv-part-bytes", type=int, default=2**19)
    parser.add_argument(
        "--ring-compute",
        action="store_true",
        help="[tcp|p2p]-ring-allreduce with fp16 or uniform8bit: decode, add and encode each part as a reducer would",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        spec = json.loads(args.worker)
        return swarm_worker(spec) if spec.get("swarm") else tcp_worker(spec) if spec.get("tcp") else worker(spec)
    if any(b > 0 for b in args.bandwidths) and os.geteuid() != 0:
        parser.error("shaped links need network namespaces: run as root, or use --bandwidths 0 (loopback)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # SystemExit unwinds: workers stopped, namespaces deleted
    load_before = os.getloadavg()
    started = time.time()
    rows = [row for peers in args.peers for mbit in args.bandwidths for row in run_swarm(args, peers, mbit)]
    print(json.dumps({
        "benchmark": "averaging_round", "params": sum(a * b for a, b in lora_shapes(args.params, args.tensors)),
        "tensors": len(lora_shapes(args.params, args.tensors)), "rounds": args.rounds, "queue_ms": args.queue_ms,
        "cpu_count": os.cpu_count(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()], "wall_s": round(time.time() - started, 1),
        "command": " ".join([Path(sys.executable).name, *sys.argv]), "results": rows,
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
