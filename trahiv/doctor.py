"""`trahiv doctor`: is this machine ready to join the swarm? Each check returns a `Check`; nothing here prints.

Checks, in order (each one a few seconds at most): p2pd starts with the configured addresses; each initial peer
answers a dial; a trahiv initial peer can dial this peer back at the addresses it announces (trahiv.connectivity's
dial-back: a fresh connection from a fresh identity, the one honest test of "reachable from the Internet"); the
announced addresses make sense for the swarm (loopback, 0.0.0.0 or private addresses announced to a swarm whose
initial peers are public are useless to it); relays; and, with `auth` configured, that the auth server answers and
that this machine's clock agrees with the server's Date header (access tokens and DHT records expire by the clock).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any

from trahiv.config import HivemindConfig
from trahiv.connectivity import DialBack, address_kind, dialable, request_dialback

__all__ = [
    "MAX_CLOCK_SKEW",
    "Check",
    "Diagnosis",
    "check_addresses",
    "check_auth_server",
    "check_clock",
    "diagnose",
    "exit_code",
]

MAX_CLOCK_SKEW = 30.0  # seconds: DHT records and access tokens expire by the clock; beyond this peers disagree
DIAL_TIMEOUT = 5.0  # seconds for one initial peer to answer


@dataclass
class Check:
    name: str
    status: str  # "ok", "warn", "fail" or "skip"
    detail: str
    fix: str = ""

    def line(self) -> str:
        tag = {"ok": " ok ", "warn": "warn", "fail": "FAIL", "skip": "skip"}[self.status]
        return f"[{tag}] {self.name}: {self.detail}" + (f" -> fix: {self.fix}" if self.fix else "")


@dataclass
class Diagnosis:
    """What the network checks found, for the decisions that follow them (client_mode 'auto')."""

    checks: list[Check]
    reachable: bool | None = None  # None: no trahiv initial peer could tell


def exit_code(checks: list[Check]) -> int:
    return 1 if any(c.status == "fail" for c in checks) else 0


# --- pure checks (no network) ------------------------------------------------------------------------------------


def check_addresses(announced: list[str], initial_peers: list[str], *, client_mode: bool) -> Check:
    """Do the addresses this peer announces make sense for a swarm with these initial peers?"""
    public_swarm = any(address_kind(p) in ("public", "dns") for p in initial_peers)
    usable = dialable(announced, swarm_public=public_swarm)
    if client_mode:
        return Check("announced addresses", "ok", "client mode: this peer accepts no connections, announces none")
    if usable:
        return Check("announced addresses", "ok", f"others can dial {', '.join(usable)}")
    kinds = sorted({address_kind(a) for a in announced}) or ["none"]
    if public_swarm:
        return Check(
            "announced addresses",
            "fail",
            f"this peer announces only {'/'.join(kinds)} addresses ({', '.join(announced) or 'none'}) to a swarm whose "
            "initial peers are public: nobody there can dial it",
            "listen on dht.host_maddrs ['/ip4/0.0.0.0/tcp/31337'] and announce your public address with "
            "dht.announce_maddrs ['/ip4/<public IP>/tcp/31337'] (port forwarded), or set dht.client_mode: true",
        )
    if all(address_kind(a) in ("loopback", "unspecified") for a in announced):
        return Check(
            "announced addresses",
            "warn",
            f"this peer listens on this machine only ({', '.join(announced) or 'none'}): peers on other machines "
            "cannot join through it",
            "set dht.host_maddrs ['/ip4/0.0.0.0/tcp/31337'] and dht.announce_maddrs with an address others can reach",
        )
    return Check("announced addresses", "ok", f"others on this network can dial {', '.join(announced)}")


def check_clock(server_date: str | None, local_time: float) -> Check:
    """Compare this machine's clock with the auth server's HTTP Date header (1 s resolution)."""
    if not server_date:
        return Check("clock", "warn", "the auth server sent no Date header: clock not checked")
    try:
        skew = local_time - parsedate_to_datetime(server_date).timestamp()
    except (TypeError, ValueError):
        return Check("clock", "warn", f"unreadable Date header {server_date!r}: clock not checked")
    if abs(skew) > MAX_CLOCK_SKEW:
        return Check(
            "clock",
            "fail",
            f"this machine's clock is {int(abs(skew))} s {'ahead of' if skew > 0 else 'behind'} the auth server's: "
            "access tokens and DHT records would look expired or not yet valid",
            "synchronise the clock (e.g. `sudo timedatectl set-ntp true`, or chrony/ntpd)",
        )
    return Check("clock", "ok", f"within {max(abs(skew), 1):.0f} s of the auth server's")


# --- network checks ----------------------------------------------------------------------------------------------


def diagnose(config: HivemindConfig, *, timeout: float = DIAL_TIMEOUT) -> Diagnosis:
    """Run every check; each bounded by `timeout` (p2pd's start by dht.startup_timeout)."""
    diagnosis = asyncio.run(_network_checks(config, timeout))
    if config.auth is not None:
        diagnosis.checks += check_auth_server(config)
    return diagnosis


async def _network_checks(config: HivemindConfig, timeout: float) -> Diagnosis:
    from hivemind.p2p import P2P

    dht, started = config.dht, time.monotonic()
    try:
        p2p = await P2P.create(
            host_maddrs=dht.host_maddrs,
            announce_maddrs=dht.announce_maddrs,
            nat_port_map=dht.nat_port_map,
            use_relay=dht.use_relay,
            use_auto_relay=dht.use_auto_relay,
            tls=dht.tls,
            startup_timeout=dht.startup_timeout,
            dht_mode="client" if dht.client_mode is True else "server",
        )
    except Exception as e:
        fix = (
            "check that host_maddrs are addresses of this machine and their ports are free; on a slow machine "
            "raise dht.startup_timeout"
        )
        return Diagnosis([Check("p2pd", "fail", f"the p2p daemon did not start: {e}", fix)])
    checks = [Check("p2pd", "ok", f"started in {time.monotonic() - started:.1f} s")]
    try:
        return await _with_daemon(p2p, config, checks, timeout)
    finally:
        await p2p.shutdown()


async def _with_daemon(p2p: Any, config: HivemindConfig, checks: list[Check], timeout: float) -> Diagnosis:
    dht = config.dht
    reached = []
    for maddr in dht.initial_peers:
        check, peer = await _dial_initial_peer(p2p, maddr, timeout)
        checks.append(check)
        if peer is not None:
            reached.append(peer)
    if not dht.initial_peers:
        checks.append(Check("initial peers", "skip", "none configured: this peer starts a new swarm"))
    announced = [str(m) for m in await p2p.get_visible_maddrs(latest=True)]
    own = f"/p2p/{p2p.peer_id.to_base58()}"
    announced = [a.removesuffix(own) for a in announced]
    checks.append(check_addresses(announced, dht.initial_peers, client_mode=dht.client_mode is True))
    dialback: DialBack | None = None
    if reached:
        dialback, check = await _check_dialback(p2p, reached, announced, config, timeout)
        checks.append(check)
    checks.append(_check_relays(announced, dht.use_relay, dialback))
    return Diagnosis(checks, None if dialback is None else dialback.ok)


async def _dial_initial_peer(p2p: Any, maddr: str, timeout: float) -> tuple[Check, Any]:
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    address = Multiaddr(maddr)
    peer_id = PeerID.from_base58(address.value_for_protocol("p2p"))
    started = time.monotonic()
    try:
        transport = address.decapsulate(Multiaddr(f"/p2p/{peer_id.to_base58()}"))  # p2pd wants it without /p2p/
        await asyncio.wait_for(p2p._client.connect(peer_id, [transport]), timeout)
    except Exception as e:
        reason = "no answer" if isinstance(e, asyncio.TimeoutError) else str(e).strip().splitlines()[0][:160]
        kind = address_kind(maddr)
        fix = "check that the peer runs, that the address and /p2p/ ID were copied whole, and that its port is open"
        fix += (
            " (127.0.0.1 is this machine: for a peer on another machine use an address it printed there)"
            if kind == "loopback"
            else " in its firewall (and forwarded if it is behind a router)"
        )
        return Check(f"initial peer {maddr}", "fail", f"{reason} (within {timeout:.0f} s)", fix), None
    return Check(f"initial peer {maddr}", "ok", f"connected in {time.monotonic() - started:.2f} s"), peer_id


async def _check_dialback(
    p2p: Any, peers: list[Any], announced: list[str], config: HivemindConfig, timeout: float
) -> tuple[DialBack | None, Check]:
    name = "reachable from the swarm"
    refused: list[tuple[Any, float]] = []  # (peer, retry_after): rate-limited, another peer may answer
    for peer in peers:
        try:
            answer = await request_dialback(p2p, peer, announced, timeout=2 * timeout + 5)
        except Exception as e:
            return None, Check(name, "warn", f"dial-back request to {peer} failed: {e}", "run `trahiv doctor` again")
        if answer is None:
            continue
        if answer.refused:
            refused.append((peer, answer.retry_after))
            continue
        seen = f" (it sees this peer connect from {', '.join(answer.observed)})" if answer.observed else ""
        if answer.ok:
            return answer, Check(name, "ok", f"{peer} dialled this peer back at {', '.join(answer.dialled)}")
        if config.dht.client_mode is True:
            return answer, Check(name, "ok", f"not reachable{seen}, and dht.client_mode is true: as it should be")
        return answer, Check(
            name,
            "fail",
            f"{peer} could not dial this peer back at {', '.join(announced) or 'any address'}{seen}: "
            "it is behind a NAT or firewall",
            "set dht.client_mode: true (or 'auto'); or forward a port on your router and set dht.host_maddrs "
            "['/ip4/0.0.0.0/tcp/<port>'] and dht.announce_maddrs ['/ip4/<public IP>/tcp/<port>']",
        )
    if refused:
        busy = f"{', '.join(str(peer) for peer, _ in refused)} answered other dial-backs first (rate limit)"
        return None, Check(name, "warn", busy, f"run `trahiv doctor` again in {min(w for _, w in refused):.0f} s")
    return None, Check(name, "skip", "no initial peer runs trahiv's dial-back service (an older version?): not checked")


# The data a relay of hivemind 1.1.12's p2pd carries per relayed connection before it resets it: libp2p's default
# circuit limit (its daemon also starts a relay with the defaults, next to the one its -relayDataLimit configures).
# Measured in a namespace topology like tests/netns.py's, with a public relay given as a static relay: averaging
# 4,000 and 80,000 bytes through it worked, 400,000 bytes ended in "Connection reset by peer".
RELAY_DATA_LIMIT = 128 * 1024


def _check_relays(announced: list[str], use_relay: bool, dialback: DialBack | None) -> Check:
    relayed = [a for a in announced if address_kind(a) == "relay"]
    if relayed:  # p2pd's relays: hivemind's daemon serves circuits with libp2p's default limit per connection
        return Check(
            "relays",
            "warn",
            f"reachable only through {len(relayed)} relay address(es): a relayed connection carries at most "
            f"{RELAY_DATA_LIMIT // 1024} KiB, too little for averaging",
            "run in client mode (dht.client_mode: true or 'auto'): it averages through reachable peers or "
            "`trahiv aux --average`",
        )
    if dialback is not None and dialback.ok:
        return Check("relays", "ok", "not needed: this peer is reachable directly")
    if not use_relay:
        return Check("relays", "warn", "dht.use_relay is false: peers behind NAT cannot be relayed to this one")
    return Check(
        "relays",
        "warn",
        "no relay address announced (and hivemind's p2pd relays carry at most "
        f"{RELAY_DATA_LIMIT // 1024} KiB per connection: too little for averaging)",
        "run in client mode (dht.client_mode: true or 'auto'): it averages through reachable peers or "
        "`trahiv aux --average`",
    )


def check_auth_server(config: HivemindConfig) -> list[Check]:
    """The auth server answers for this run, and the clock agrees with its Date header."""
    import urllib.error
    import urllib.request
    from urllib.parse import quote

    assert config.auth is not None
    server, run_id = config.auth.server, config.opt.run_id
    url = f"{server}/api/experiments/{quote(run_id)}"
    try:
        with urllib.request.urlopen(url, timeout=config.auth.timeout) as response:
            status, date = response.status, response.headers.get("Date")
    except urllib.error.HTTPError as e:  # the server answered, with an error status
        status, date = e.code, e.headers.get("Date")
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        fix = "check auth.server (scheme, host, port) and that `trahiv auth_server` runs there"
        return [Check("auth server", "fail", f"{server} does not answer: {reason}", fix)]
    local = time.time()
    if status == 404:
        fix = "check opt.run_id against the experiment the moderator created"
        check = Check("auth server", "fail", f"{server} knows no experiment {run_id!r}", fix)
    elif 200 <= status < 300:
        check = Check("auth server", "ok", f"{server} answers for run {run_id!r}")
    else:
        check = Check("auth server", "fail", f"{url} answered HTTP {status}", "ask the swarm's moderator")
    return [check, check_clock(date, local)]
