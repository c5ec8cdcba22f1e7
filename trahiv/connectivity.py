"""Can peers reach each other? The dial-back service every trahiv peer runs, and the watch that never lets a peer
train alone in silence.

Dial-back (hivemind 1.1.12's p2pd runs AutoNAT, but its client exposes no reachability status): a trahiv peer
registers the unary handler `DIALBACK_PROTOCOL`. A caller sends the addresses it announces; the peer dials the
*caller's* peer ID at those addresses from a second p2pd with a fresh identity (the connection the caller opened to
it would otherwise be reused, and prove nothing), and answers whether that worked and at which address it sees the
caller connect from. Only the caller's own peer ID is dialled, at most `MAX_DIAL_ADDRS` addresses, one dial at a
time, each bounded by `DIAL_TIMEOUT`. Each dial starts a p2pd, so requests are rate-limited (`DialBackLimiter`): one
per caller every `DIAL_INTERVAL_PER_CALLER` seconds, `MAX_DIALS_PER_MINUTE` in all, `MAX_QUEUED` waiting; a refused
caller is told when to ask again (`DialBack.retry_after`) and asks another initial peer, or the same one once more.
`trahiv doctor` and `client_mode: auto` (trahiv.swarm) use it.

SilenceWatch: hivemind logs a failed averaging round at INFO (`Averaging gradients failed with TimeoutError()`) and
trains on local gradients; two volunteers behind NAT trained that way for ever (30.8 s a step, parameters unchanged).
The watch is fed each collaborative step's outcome and warns once, at WARNING, after `rounds` steps in a row without
averaging while other peers are in the swarm, with the likely cause and the fix.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DIALBACK_PROTOCOL",
    "DialBack",
    "DialBackLimiter",
    "PeerView",
    "SilenceWatch",
    "PARAMETER_HELPER_TTL",
    "address_kind",
    "announce_parameter_helper",
    "dialable",
    "join_lines",
    "parameter_helpers",
    "parameter_helpers_key",
    "probe_reachability",
    "request_dialback",
    "serve_dialback",
    "serve_dialback_in_dht",
    "settle_client_mode",
    "unreachable_peers",
    "unreachable_peers_future",
]

logger = logging.getLogger("trahiv.connectivity")

DIALBACK_PROTOCOL = "/trahiv/dialback/1.0.0"
MAX_DIAL_ADDRS = 8
DIAL_TIMEOUT = 5.0  # seconds for the dial-back connection (a reachable peer answers in well under a second)
MAX_REQUEST_BYTES = 4096
DIAL_INTERVAL_PER_CALLER = 10.0  # seconds between two dial-backs for one peer ID
MAX_DIALS_PER_MINUTE = 30  # dial-backs for all callers together (each starts a p2pd)
MAX_QUEUED = 4  # requests waiting while one dial runs
MAX_RETRY_WAIT = 15.0  # a refused prober waits at most this long to ask again (else it cannot tell)


# --- addresses ---------------------------------------------------------------------------------------------------


def address_kind(maddr: str) -> str:
    """'loopback', 'unspecified', 'private' (RFC 1918, CGNAT, link-local, ULA), 'public', 'relay' or 'dns'."""
    if "/p2p-circuit" in maddr:
        return "relay"
    parts = maddr.split("/")
    for proto, value in zip(parts[1::2], parts[2::2], strict=False):
        if proto in ("dns", "dns4", "dns6", "dnsaddr"):
            return "loopback" if value == "localhost" else "dns"
        if proto in ("ip4", "ip6"):
            ip = ipaddress.ip_address(value)
            if ip.is_loopback:
                return "loopback"
            if ip.is_unspecified:
                return "unspecified"
            cgnat = ip.version == 4 and ip in ipaddress.ip_network("100.64.0.0/10")
            return "private" if ip.is_private or ip.is_link_local or cgnat else "public"
    return "unknown"


def dialable(maddrs: Sequence[str], *, swarm_public: bool) -> list[str]:
    """The addresses others can dial: loopback/unspecified never leave this machine, private ones leave it only
    within the local network (fine for a swarm on a LAN, useless to a swarm whose initial peers are public)."""
    usable = {"public", "dns", "relay", "unknown"} | (set() if swarm_public else {"private"})
    return [m for m in maddrs if address_kind(m) in usable]


# --- dial-back ---------------------------------------------------------------------------------------------------


@dataclass
class DialBack:
    """The answer to a dial-back request: `ok` if the peer could open a fresh connection to the caller."""

    ok: bool
    dialled: list[str] = field(default_factory=list)
    observed: list[str] = field(default_factory=list)  # where the peer sees the caller's existing connection from
    error: str = ""
    retry_after: float = 0.0  # > 0: the peer did not dial (rate limit): ask again after this many seconds

    @property
    def refused(self) -> bool:
        return self.retry_after > 0


class DialBackLimiter:
    """Who may have a dial-back now. `admit(caller)` returns 0.0 (go: call `done()` after the dial) or the seconds
    after which to ask again."""

    def __init__(self, per_caller: float = DIAL_INTERVAL_PER_CALLER, per_minute: int = MAX_DIALS_PER_MINUTE,
                 max_queued: int = MAX_QUEUED, clock: Callable[[], float] = time.monotonic):  # fmt: skip
        self.per_caller, self.per_minute, self.max_queued, self.clock = per_caller, per_minute, max_queued, clock
        self.last: dict[str, float] = {}  # caller -> when it was last admitted
        self.recent: deque[float] = deque()  # when the dials of the last minute were admitted
        self.queued = 0  # admitted and not done (waiting for the one dial in progress, or dialling)

    def admit(self, caller: str) -> float:
        now = self.clock()
        while self.recent and now - self.recent[0] >= 60.0:
            self.recent.popleft()
        self.last = {peer: at for peer, at in self.last.items() if now - at < self.per_caller}
        waits = []
        if caller in self.last:
            waits.append(self.last[caller] + self.per_caller - now)
        if len(self.recent) >= self.per_minute:
            waits.append(self.recent[0] + 60.0 - now)
        if self.queued > self.max_queued:  # (one dialling + max_queued waiting)
            waits.append(DIAL_TIMEOUT)
        if waits:
            return max(max(waits), 0.1)
        self.last[caller] = now
        self.recent.append(now)
        self.queued += 1
        return 0.0

    def done(self) -> None:
        self.queued = max(self.queued - 1, 0)


class _DialBackService:
    """The dial-back handler, in the process that owns the peer's p2pd."""

    def __init__(self, p2p: Any, limiter: DialBackLimiter | None = None):
        self.p2p, self.lock = p2p, asyncio.Lock()
        self.limiter = limiter or DialBackLimiter()

    async def handle(self, request: bytes, remote_id: Any) -> bytes:
        try:
            maddrs = _parse_request(request)
        except ValueError as e:
            return _dump(DialBack(False, error=str(e)))
        wait = self.limiter.admit(str(remote_id))
        if wait > 0:
            return _dump(DialBack(False, error=f"busy: ask again in {wait:.0f} s", retry_after=round(wait, 1)))
        try:
            observed = await self._observed(remote_id)
            async with self.lock:  # one dial at a time: the service cannot be used to open many connections at once
                answer = await self._dial(remote_id, maddrs)
        finally:
            self.limiter.done()
        answer.observed = observed
        return _dump(answer)

    async def _observed(self, remote_id: Any) -> list[str]:
        try:
            peers = await self.p2p.list_peers()
        except Exception:
            return []
        return [str(a) for info in peers if info.peer_id == remote_id for a in info.addrs][:MAX_DIAL_ADDRS]

    async def _dial(self, remote_id: Any, maddrs: list[Any]) -> DialBack:
        """Dial from a new p2pd each time: a prober that knew other peers would find the caller through them
        (libp2p's routed host looks the peer up when the given addresses fail) and report it reachable."""
        from hivemind.p2p import P2P

        if not maddrs:
            return DialBack(False, error="no address to dial")
        dialled, prober = [str(m) for m in maddrs], None
        try:
            prober = await P2P.create(
                host_maddrs=["/ip4/127.0.0.1/tcp/0"], dht_mode="client", nat_port_map=False, use_relay=False,
                auto_nat=False, conn_manager=False,
            )  # fmt: skip
            await asyncio.wait_for(prober._client.connect(remote_id, maddrs), DIAL_TIMEOUT)
            return DialBack(True, dialled=dialled)
        except Exception as e:  # timeouts, refused connections, a wrong peer ID at that address
            return DialBack(False, dialled=dialled, error=_short(e) or "no answer")
        finally:
            if prober is not None:
                await prober.shutdown()


def _parse_request(request: bytes) -> list[Any]:
    from hivemind.utils.multiaddr import Multiaddr

    if len(request) > MAX_REQUEST_BYTES:
        raise ValueError("request too large")
    try:
        values = json.loads(request)["maddrs"]
        maddrs = [Multiaddr(v) for v in values if isinstance(v, str)][:MAX_DIAL_ADDRS]
    except Exception as e:
        raise ValueError(f"malformed request: {_short(e)}") from None
    return [m.decapsulate(Multiaddr("/p2p/" + m.value_for_protocol("p2p"))) if "/p2p/" in str(m) else m for m in maddrs]


def _dump(answer: DialBack) -> bytes:
    return json.dumps(answer.__dict__).encode()


def _short(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return (text[0] if text else type(error).__name__)[:200]


async def serve_dialback(p2p: Any) -> None:
    """Register the dial-back handler on `p2p` (hivemind.P2P), in the process that owns it."""
    service = _DialBackService(p2p)
    if p2p._listen_task is None:  # the daemon delivers handler calls only while the client listens
        p2p._start_listening()
    await p2p._client.add_unary_handler(DIALBACK_PROTOCOL, service.handle)


def serve_dialback_in_dht(_dht: Any, node: Any) -> None:
    """For `hivemind.DHT.run_coroutine`: register the dial-back handler in the DHT's process."""
    return serve_dialback(node.p2p)  # type: ignore[return-value]  # run_coroutine awaits the coroutine


async def request_dialback(p2p: Any, peer_id: Any, maddrs: Sequence[Any], timeout: float = 10.0) -> DialBack | None:
    """Ask `peer_id` to dial this peer back at `maddrs`; None if that peer does not offer the service."""
    data = json.dumps({"maddrs": [str(m) for m in maddrs][:MAX_DIAL_ADDRS]}).encode()
    try:
        raw = await asyncio.wait_for(p2p._client.call_unary_handler(peer_id, DIALBACK_PROTOCOL, data), timeout)
    except Exception as e:
        if "protocol" in str(e).lower() or "not supported" in str(e).lower():
            return None
        raise
    fields = json.loads(raw)
    return DialBack(
        ok=bool(fields.get("ok")),
        dialled=list(fields.get("dialled", [])),
        observed=list(fields.get("observed", [])),
        error=str(fields.get("error", "")),
        retry_after=_retry_after(fields.get("retry_after", 0.0)),
    )


def _retry_after(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < 3600 else 0.0


async def _probe_in_dht(initial_peers: list[str], timeout: float, _dht: Any, node: Any) -> DialBack | None:
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    p2p = node.p2p
    own = f"/p2p/{p2p.peer_id.to_base58()}"
    announced = [str(m).removesuffix(own) for m in await p2p.get_visible_maddrs(latest=True)]
    for attempt in range(2):  # a second pass only if every peer that offers the service was busy
        busy: list[float] = []
        for maddr in initial_peers:
            peer_id = PeerID.from_base58(Multiaddr(maddr).value_for_protocol("p2p"))
            try:
                answer = await request_dialback(p2p, peer_id, announced, timeout=timeout)
            except Exception as e:  # that initial peer is gone, or slow: ask the next one
                logger.debug(f"Dial-back request to {peer_id} failed: {e!r}")
                continue
            if answer is not None and answer.refused:  # rate-limited: another initial peer may answer now
                busy.append(answer.retry_after)
            elif answer is not None:
                return answer
        if not busy or min(busy) > MAX_RETRY_WAIT or attempt == 1:
            return None
        await asyncio.sleep(min(busy))
    return None


def probe_reachability(dht: Any, initial_peers: Sequence[str], timeout: float = 2 * DIAL_TIMEOUT) -> DialBack | None:
    """Ask the initial peers (trahiv peers) to dial this running DHT peer back; None if none could tell."""
    from functools import partial

    if not initial_peers:
        return None
    return dht.run_coroutine(partial(_probe_in_dht, list(initial_peers), timeout))


def settle_client_mode(dht: Any, initial_peers: Sequence[str], restart_in_client_mode: Callable[[], Any]) -> Any:
    """client_mode 'auto': keep `dht` if an initial peer can dial it back (or none can tell); otherwise stop it and
    return `restart_in_client_mode()`, saying so in one line."""
    try:
        answer = probe_reachability(dht, initial_peers)
    except Exception as e:  # the probe must never stop a peer from joining
        logger.debug(f"Reachability probe failed: {e!r}")
        return dht
    if answer is None or answer.ok:
        return dht
    seen = f"; it sees this peer connect from {', '.join(answer.observed)}" if answer.observed else ""
    logger.info(
        f"Switching to client mode: an initial peer could not dial this peer back at {', '.join(answer.dialled)}"
        f"{seen} (behind a NAT or firewall). It connects out only and averages with peers that accept connections."
    )
    dht.shutdown()
    return restart_in_client_mode()


def join_lines(addresses: Sequence[str], initial_peers: Sequence[str], *, client_mode: bool) -> list[str]:
    """What a peer prints for others to join through it: only addresses they can dial, or why there are none.
    Loopback-only peers (one machine) keep the usual line, followed by a note."""
    public_swarm = any(address_kind(p) in ("public", "dns") for p in initial_peers)
    usable = dialable(addresses, swarm_public=public_swarm)
    local = [a for a in addresses if address_kind(a) == "loopback"]
    if client_mode:
        return [
            "This peer is in client mode (it accepts no incoming connections): others cannot join through it; "
            f"they can use the same initial_peers as this one: {list(initial_peers)}"
        ]
    if usable:
        return [f"To join the training, use initial_peers = {usable}"]
    if local and not public_swarm:
        return [
            f"To join the training, use initial_peers = {local}",
            "(this peer listens on 127.0.0.1 only: peers on other machines cannot join through it; set "
            "dht.host_maddrs=['/ip4/0.0.0.0/tcp/31337'] and dht.announce_maddrs=['/ip4/<public IP>/tcp/31337'])",
        ]
    return [
        f"This peer has no address peers on other machines can dial (it announces {list(addresses)}, and the "
        "swarm's initial peers are public): others cannot join through it. Forward a port and set "
        "dht.announce_maddrs=['/ip4/<public IP>/tcp/<port>'] to let them."
    ]


# --- never silent ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PeerView:
    """What this peer knows of another trainer from its progress record."""

    peer_id: str
    client_mode: bool


class SilenceWatch:
    """Warns once (per silent stretch) when `rounds` collaborative steps in a row ended without averaging while
    other peers were in the swarm. Feed it with `observe()` after each collaborative step."""

    def __init__(self, rounds: int = 3, *, client_mode: bool, log: logging.Logger = logger):
        self.rounds, self.client_mode, self.log = rounds, client_mode, log
        self.silent_rounds, self.warned, self.last_warning = 0, False, ""

    def observe(self, averaged: bool, others: Sequence[PeerView], unreachable: Sequence[str] = ()) -> str | None:
        """Record one step; return the warning if it was logged now. `unreachable`: peers this one failed to dial."""
        if averaged or not others:
            self.silent_rounds, self.warned = 0, False
            return None
        self.silent_rounds += 1
        if self.silent_rounds < self.rounds or self.warned:
            return None
        self.warned, self.last_warning = True, self.diagnose(others, unreachable)
        self.log.warning(self.last_warning)
        return self.last_warning

    def due(self, averaged: bool, others: Sequence[PeerView]) -> bool:
        """Whether `observe(averaged, others)` would warn now (time to look for unreachable peers)."""
        return not averaged and bool(others) and not self.warned and self.silent_rounds + 1 >= self.rounds

    def diagnose(self, others: Sequence[PeerView], unreachable: Sequence[str] = ()) -> str:
        head = (
            f"This peer has not averaged with anyone for {self.silent_rounds} steps although {len(others)} other "
            "peer(s) are in the swarm: it trains on its own gradients only."
        )
        if unreachable:
            shown = ", ".join(unreachable[:3]) + (" ..." if len(unreachable) > 3 else "")
            cause = (
                f"Likely cause: this peer cannot connect to {len(unreachable)} of them ({shown}), whose progress "
                "records it reads from the DHT: the swarm may be split (peers on networks that cannot reach each "
                "other). Fix: run `trahiv doctor --config <your config>` here and on those peers; every peer that "
                "accepts connections must announce addresses all others can dial (dht.announce_maddrs), the others "
                "must run in client mode."
            )
        elif self.client_mode and all(peer.client_mode for peer in others):
            cause = (
                "Likely cause: every trainer is in client mode, and a group forms only around a peer that accepts "
                "connections. Fix: run `trahiv aux --average` on a host all peers can reach (or make one trainer "
                "reachable: public address, dht.client_mode: false); if one runs, check it with `trahiv doctor`."
            )
        elif self.client_mode:
            cause = (
                "Likely cause: the reachable peers do not accept this client-mode peer (unreachable from here, "
                "or a different trahiv/hivemind version). Fix: run `trahiv doctor --config <your config>` and use "
                "the same trahiv version as the swarm."
            )
        else:
            cause = (
                "Likely cause: other peers cannot connect to this one (behind a NAT or firewall) or run a different "
                "trahiv/hivemind version. Fix: run `trahiv doctor --config <your config>`; if it says this peer "
                "cannot be dialled back, set dht.client_mode: true (or 'auto'), or forward the port and set "
                "dht.announce_maddrs."
            )
        return f"{head} {cause}"


async def _ping_in_dht(peers: list[str], _dht: Any, node: Any) -> list[str]:
    from hivemind.p2p import PeerID

    answers = await asyncio.gather(*(node.protocol.call_ping(PeerID.from_base58(p)) for p in peers))
    return [peer for peer, answer in zip(peers, answers, strict=True) if answer is None]


def unreachable_peers(dht: Any, peers: Sequence[str]) -> list[str]:
    """Peers (DHT servers: not in client mode) that do not answer a DHT ping from here (dht.wait_timeout each)."""
    from functools import partial

    if not peers:
        return []
    try:
        return list(dht.run_coroutine(partial(_ping_in_dht, list(peers))))
    except Exception as e:  # a diagnosis must never stop training
        logger.debug(f"Pinging peers failed: {e!r}")
        return []


def unreachable_peers_future(dht: Any, peers: Sequence[str]) -> Any:
    """`unreachable_peers` without waiting for the answers: a future of the list (hivemind's MPFuture)."""
    from functools import partial

    return dht.run_coroutine(partial(_ping_in_dht, list(peers)), return_future=True)


# --- parameter helpers: auxiliary peers that lead the parameter rounds of trainers in client mode ---------------------
# Trainers in client mode (behind NAT) cannot lead a group, so among themselves no parameter round can form
# (trahiv.engine.watch skips those rounds). `trahiv aux --average` leads them, and says so under this key; a trainer
# that sees a fresh announcement schedules its parameter rounds again.

PARAMETER_HELPER_TTL = 30.0  # seconds an announcement lasts; the helper renews it every third of that


def parameter_helpers_key(run_id: str) -> str:
    return f"{run_id}_parameter_helpers"


def announce_parameter_helper(dht: Any, run_id: str) -> bool:
    """This peer leads the parameter rounds of trainers in client mode, for PARAMETER_HELPER_TTL seconds."""
    from hivemind.utils import get_dht_time

    subkey = dht.peer_id.to_base58()
    key, expiration = parameter_helpers_key(run_id), get_dht_time() + PARAMETER_HELPER_TTL
    return bool(dht.store(key, subkey=subkey, value=True, expiration_time=expiration))


def parameter_helpers(dht: Any, run_id: str) -> list[str]:
    """Peers whose announcement as a parameter helper of run `run_id` has not expired (malformed entries ignored)."""
    found = dht.get(parameter_helpers_key(run_id), latest=True)
    entries = found.value if found is not None and isinstance(found.value, dict) else {}
    return sorted(str(peer) for peer, entry in entries.items() if getattr(entry, "value", None) is True)
