"""Home routers on one machine: network namespaces for the NAT tests and benchmarks/nat.py (root only).

    public hosts  10.213.0.10, .11, ...      on the "internet" (a bridge in its own namespace, no IP of its own)
    routers       10.213.0.100, .101, ...    WAN side on the bridge; nftables masquerade, no port forwarding,
                                             new connections from the WAN dropped
    home hosts    10.213.N.2 behind router N (LAN 10.213.N.0/24, default route through the router)

Every link is shaped with tbf (`rate`, 50 Mbit/s by default) in both directions. No namespace has a route outside
10.213.0.0/16: nothing sent in here can leave the machine. `Topology.close()` deletes the namespaces by the names it
created (their veths go with them). `unavailable()` says why the topology cannot be built here (None if it can).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Host", "Topology", "build", "start_bootstrap_in", "start_peer_in", "unavailable"]

PREFIX = "10.213"

NFT_RULES = """
table ip trahiv_nat {
    chain postrouting { type nat hook postrouting priority 100; oifname "wan0" masquerade; }
}
table inet trahiv_filter {
    chain forward {
        type filter hook forward priority 0; policy drop;
        ct state established,related accept
        iifname "lan0" oifname "wan0" accept
    }
}
"""


def unavailable() -> str | None:
    """Why the namespace topology cannot be built here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, nftables)"
    for tool in ("ip", "nft", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt-get install -y iproute2 nftables)"
    name = f"trh-probe-{os.getpid()}"
    try:
        _run("ip", "netns", "add", name)
        _run("ip", "netns", "exec", name, "nft", "list", "ruleset")
    except subprocess.CalledProcessError as e:
        return f"network namespaces or nftables unavailable: {e.stderr.strip() or e}"
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def _run(*command: str, stdin: str | None = None) -> None:
    subprocess.run(command, check=True, capture_output=True, text=True, input=stdin, timeout=30)


@dataclass
class Host:
    namespace: str
    ip: str

    def prefix(self) -> list[str]:
        """Prepend to a command to run it on this host."""
        return ["ip", "netns", "exec", self.namespace]


@dataclass
class Topology:
    name: str
    rate: str
    public: list[Host] = field(default_factory=list)
    homes: list[Host] = field(default_factory=list)
    routers: list[Host] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)

    @property
    def inet(self) -> str:
        return f"{self.name}-inet"

    def _namespace(self, suffix: str) -> str:
        ns = f"{self.name}-{suffix}"
        _run("ip", "netns", "add", ns)
        self.namespaces.append(ns)
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        return ns

    def _shape(self, ns: str, dev: str) -> None:
        _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate,
             "burst", "64kb", "latency", "200ms")  # fmt: skip

    def _wire(self, ns: str, ip: str) -> None:
        """A veth from `ns` (wan0, `ip`/24) to the internet bridge."""
        port = f"p{len(self.public) + len(self.routers)}"
        _run("ip", "-n", self.inet, "link", "add", port, "type", "veth", "peer", "name", "wan0", "netns", ns)
        _run("ip", "-n", self.inet, "link", "set", port, "master", "br0", "up")
        _run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "wan0")
        _run("ip", "-n", ns, "link", "set", "wan0", "up")
        self._shape(self.inet, port)
        self._shape(ns, "wan0")

    def add_public(self) -> Host:
        index = len(self.public)
        ns, ip = self._namespace(f"pub{index}"), f"{PREFIX}.0.{10 + index}"
        self._wire(ns, ip)
        host = Host(ns, ip)
        self.public.append(host)
        return host

    def add_home(self) -> Host:
        """A host behind its own router (masquerade, no port forwarding)."""
        index = len(self.homes) + 1
        router, home = self._namespace(f"rt{index}"), self._namespace(f"home{index}")
        self._wire(router, f"{PREFIX}.0.{99 + index}")
        lan = f"{PREFIX}.{index}"
        _run("ip", "-n", router, "link", "add", "lan0", "type", "veth", "peer", "name", "eth0", "netns", home)
        _run("ip", "-n", router, "addr", "add", f"{lan}.1/24", "dev", "lan0")
        _run("ip", "-n", router, "link", "set", "lan0", "up")
        _run("ip", "-n", home, "addr", "add", f"{lan}.2/24", "dev", "eth0")
        _run("ip", "-n", home, "link", "set", "eth0", "up")
        _run("ip", "-n", home, "route", "add", "default", "via", f"{lan}.1")
        self._shape(router, "lan0")
        self._shape(home, "eth0")
        _run("ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        _run("ip", "netns", "exec", router, "nft", "-f", "-", stdin=NFT_RULES)
        self.routers.append(Host(router, f"{PREFIX}.0.{99 + index}"))
        host = Host(home, f"{lan}.2")
        self.homes.append(host)
        return host

    def close(self) -> None:
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.namespaces.clear()


def build(name: str | None = None, *, public: int = 1, homes: int = 1, rate: str = "50mbit") -> Topology:
    """The internet bridge, `public` public hosts and `homes` home hosts behind routers. Close it when done."""
    topology = Topology(name or f"trh{os.getpid()}", rate)
    try:
        topology._namespace("inet")
        _run("ip", "-n", topology.inet, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", topology.inet, "link", "set", "br0", "up")
        for _ in range(public):
            topology.add_public()
        for _ in range(homes):
            topology.add_home()
    except BaseException:
        topology.close()
        raise
    return topology


def start_bootstrap_in(host: Host, tmp: Path) -> tuple[subprocess.Popen, list[str]]:
    """`trahiv dht` on `host`, listening on all its addresses; returns it and its join addresses on the internet."""
    from swarm_helpers import ENV, wait_for

    addresses = tmp / "bootstrap.json"
    addresses.unlink(missing_ok=True)  # a run again in the same directory: not the last bootstrap's address
    command = [*host.prefix(), sys.executable, "-m", "trahiv.cli.main", "dht", "--no-nat-port-map",
               "--host-maddrs", "/ip4/0.0.0.0/tcp/0", "--addresses-file", str(addresses)]  # fmt: skip
    log = open(tmp / "bootstrap.log", "w")
    process = subprocess.Popen(command, env=ENV, stdout=subprocess.DEVNULL, stderr=log)
    peers = wait_for(
        lambda: addresses.exists() and addresses.stat().st_size and json.loads(addresses.read_text()),
        60,
        "the bootstrap peer",
    )
    return process, [p for p in peers if p.startswith(f"/ip4/{host.ip}/")]


def start_peer_in(host: Host, tmp: Path, name: str, **spec: Any) -> Any:
    """tests/peer_worker.py on `host` (swarm_helpers.start_peer, in a namespace)."""
    from swarm_helpers import start_peer

    # the README recipe leaves client_mode unset ("auto": a dial-back decides); peer_worker's loopback default is False
    dht = {"client_mode": "auto", **spec.pop("dht", {})}
    return start_peer(tmp, name, prefix=tuple(host.prefix()), dht=dht, **spec)


TESTS = Path(__file__).parent
