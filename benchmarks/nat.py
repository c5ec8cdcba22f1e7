"""A volunteer behind a home router: time from its start to its first averaged step (as root; tests/netns.py).

Topology: a public bootstrap, a public trainer (`--public-trainers`, default 1) and `--homes` trainers each behind its
own NAT router (masquerade, no port forwarding), every link shaped to `--rate` (tbf). The volunteers follow the README
recipe (initial_peers only; client_mode unset, so 'auto'). Measured for each volunteer: seconds from its launch to its
first collaborative step with a complete averaging round (read from tests/peer_worker.py's records), and the median
duration of its collaborative steps after that; plus whether it switched to client mode on its own.

Prints JSON. Run: .venv/bin/python benchmarks/nat.py [--homes 1] [--public-trainers 1] [--rate 50mbit] [--steps 5]
With --aux (and --public-trainers 0 --homes 2): no public trainer; the volunteers average through `trahiv aux --average`
on the public host, the one peer that accepts connections.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

__all__ = ["main"]


def first_averaged_step(peer, launched: float) -> dict:
    """Seconds from launch to the first collaborative step, and the median step duration after it."""
    steps = [(r["t"], r["epoch_before"], r["epoch_after"]) for r in peer.records("local")]
    moved = [t for t, before, after in steps if after > before]  # (the step that saw the swarm's step advance)
    durations = [b - a for a, b in zip(moved, moved[1:], strict=False)]
    return {
        "first_averaged_step_s": round(moved[0] - launched, 2) if moved else None,
        "median_step_s": round(statistics.median(durations), 2) if durations else None,
    }


def start_aux_in(host, tmp: Path):
    """`trahiv aux --average` on `host` (as tests/test_nat.py starts it); returns it and its internet addresses."""
    import subprocess

    from swarm_helpers import ENV, wait_for

    out = tmp / "aux"
    out.mkdir(exist_ok=True)
    config = {"dht": {"host_maddrs": ["/ip4/0.0.0.0/tcp/0"], "nat_port_map": False},
              "opt": {"run_id": "nat_bench", "target_batch_size": 32, "matchmaking_time": 2.0}}  # fmt: skip
    command = [*host.prefix(), sys.executable, "-m", "trahiv.cli.main", "aux", "--config", json.dumps(config),
               "--output-dir", str(out / "output"), "--period", "0.5", "--addresses-file", str(out / "addresses.json"),
               "--average"]  # fmt: skip
    process = subprocess.Popen(command, env=ENV, stdout=open(out / "log.txt", "w"), stderr=subprocess.STDOUT)
    addresses = wait_for(
        lambda: process.poll() is None and (out / "addresses.json").exists() and (out / "addresses.json").read_text(),
        90,
        "trahiv aux to start",
    )
    return process, [a for a in json.loads(addresses) if a.startswith(f"/ip4/{host.ip}/")]


def main(argv: list[str] | None = None) -> dict:
    import netns
    from swarm_helpers import stop

    from trahiv.demo import prepare_workdir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--homes", type=int, default=1, help="trainers behind NAT routers")
    parser.add_argument("--public-trainers", type=int, default=1, help="trainers on public hosts")
    parser.add_argument("--rate", default="50mbit", help="tbf rate of every link")
    parser.add_argument("--steps", type=int, default=5, help="collaborative steps")
    parser.add_argument("--aux", action="store_true",
                        help="the entry point is `trahiv aux --average` (averages with client-mode volunteers), not a "
                             "bootstrap `trahiv dht`; use with --public-trainers 0 --homes 2")  # fmt: skip
    args = parser.parse_args(argv)
    reason = netns.unavailable()
    if reason is not None:
        raise SystemExit(f"benchmarks/nat.py: {reason}")
    tmp = Path(tempfile.mkdtemp(prefix="trahiv-nat-"))
    workdir = prepare_workdir(tmp / "data")
    topology = netns.build(public=1 + args.public_trainers, homes=args.homes, rate=args.rate)
    processes = []
    try:
        entry, initial_peers = (start_aux_in if args.aux else netns.start_bootstrap_in)(topology.public[0], tmp)
        processes.append(entry)
        common = dict(workdir=str(workdir), run_id="nat_bench", target=32, batch_size=8, scheduler="constant",
                      initial_peers=initial_peers, opt={"min_peers": args.homes + args.public_trainers})  # fmt: skip
        peers, launched = [], {}
        for i, host in enumerate(topology.public[1:]):
            peer = netns.start_peer_in(host, tmp, f"public{i}", dht={"host_maddrs": ["/ip4/0.0.0.0/tcp/0"]},
                                       max_steps=args.steps + 1, **common)  # fmt: skip
            peers.append(peer)
        for i, host in enumerate(topology.homes):
            launched[f"home{i}"] = time.time()
            peers.append(netns.start_peer_in(host, tmp, f"home{i}", max_steps=args.steps, **common))
        processes += [p.process for p in peers]
        done = {p.name: p.finish(timeout=600) for p in peers}
        volunteers = {
            p.name: {
                **first_averaged_step(p, launched[p.name]),
                "switched_to_client_mode": "Switching to client mode" in p.log(),
                "averaging_rounds": done[p.name].get("averaging_rounds"),
            }
            for p in peers
            if p.name in launched
        }
    finally:
        for process in processes:
            stop(process)
        topology.close()
    result = {
        "benchmark": "nat",
        "rate": args.rate,
        "homes": args.homes,
        "public_trainers": args.public_trainers,
        "steps": args.steps,
        "entry_point": "trahiv aux --average" if args.aux else "trahiv dht",
        "volunteers": volunteers,
        "load_average_1min": os.getloadavg()[0],
    }
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
