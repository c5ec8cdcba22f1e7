"""The auth gate's token cache (trahiv.auth.gate.AuthGate) against a stand-in DHT, on a clock the test moves; and a
gated state download, which reads no source without a valid token (real DHTs and averagers on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from hivemind.utils.timed_storage import ValueWithExpiration
from swarm_helpers import wait_for

from trahiv.auth import gate as gate_module
from trahiv.auth import keys
from trahiv.auth.gate import AuthGate
from trahiv.auth.tokens import peer_id_of, sign_access_token

EXPERIMENT_KEY = keys.generate_private_key()
START = 1_000_000.0  # the stand-in DHT time when a test begins


class StandInDHT:
    """Answers `get(key, latest=True, return_future=True)` with the tokens it holds; counts the reads and notes when
    each began (time.monotonic(), the clock of the gate's rate limit)."""

    def __init__(self) -> None:
        self.tokens: dict[str, bytes] = {}
        self.reads = 0
        self.read_at: list[float] = []

    def publish(self, username: str, public_key: bytes, expires_at: float) -> None:
        token = sign_access_token(keys.private_key_der(EXPERIMENT_KEY), username, public_key, expires_at)
        self.tokens[peer_id_of(public_key).to_base58()] = token.SerializeToString()

    def get(self, key: str, latest: bool, return_future: bool) -> Any:
        return self._get()

    async def _get(self) -> ValueWithExpiration:
        self.reads += 1
        self.read_at.append(time.monotonic())
        await asyncio.sleep(0.01)
        entries = {subkey: ValueWithExpiration(value, START + 1e6) for subkey, value in self.tokens.items()}
        return ValueWithExpiration(entries, START + 1e6)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [START]
    monkeypatch.setattr(gate_module, "get_dht_time", lambda: now[0])
    monkeypatch.setattr(gate_module, "MIN_FETCH_PERIOD", 0.3)
    return now


def peer_key() -> bytes:
    return keys.public_key_openssh(keys.generate_private_key())


def make_gate() -> AuthGate:
    return AuthGate("gated", keys.public_key_openssh(EXPERIMENT_KEY))


def test_a_renewed_token_is_found_when_the_cached_one_expires_right_after_another_read(clock):
    """The gate holds alice's first token and read the DHT less than MIN_FETCH_PERIOD ago; that token expires: her
    renewed one is read and she is admitted (the gate used to refuse her until the next read)."""
    dht, alice, gate = StandInDHT(), peer_key(), make_gate()
    dht.publish("alice", alice, START + 5)

    async def scenario() -> tuple[Any, Any, float]:
        first = await gate.check(dht, peer_id_of(alice))
        dht.publish("alice", alice, START + 100)  # renewed and published; the gate still holds the first token
        clock[0] = START + 6  # the first token expired, less than MIN_FETCH_PERIOD after the gate's read
        second = await gate.check(dht, peer_id_of(alice))
        return first, second

    first, second = asyncio.run(scenario())
    assert first is not None and first.expires_at == START + 5
    assert second is not None and second.username == "alice" and second.expires_at == START + 100
    # a read of its own, after the rate limit's wait (measured between the reads' starts: the first read's token
    # checks take part of that period, more under load)
    assert dht.reads == 2 and dht.read_at[1] - dht.read_at[0] >= gate_module.MIN_FETCH_PERIOD


def test_a_token_about_to_expire_is_looked_up_again_without_making_its_holder_wait(clock):
    dht, alice, gate = StandInDHT(), peer_key(), make_gate()
    dht.publish("alice", alice, START + 5)

    async def scenario() -> list[Any]:
        await gate.check(dht, peer_id_of(alice))
        dht.publish("alice", alice, START + 100)
        await asyncio.sleep(gate_module.MIN_FETCH_PERIOD)
        clock[0] = START + 5 - gate_module.REFRESH_AHEAD_S / 2
        held = await gate.check(dht, peer_id_of(alice))  # answered from the cache; a read starts beside it
        assert gate._background is not None
        await gate._background
        return [held, gate.cached(peer_id_of(alice))]

    held, renewed = asyncio.run(scenario())
    assert held.expires_at == START + 5 and renewed.expires_at == START + 100 and dht.reads == 2


def test_strangers_are_refused_and_share_the_rate_limited_reads(clock):
    dht, alice, gate = StandInDHT(), peer_key(), make_gate()
    dht.publish("alice", alice, START + 100)

    async def scenario() -> list[Any]:
        strangers = [gate.check(dht, peer_id_of(peer_key())) for _ in range(8)]
        answers = await asyncio.gather(*strangers, gate.check(dht, peer_id_of(alice)))
        answers.append(await gate.check(dht, peer_id_of(peer_key())))  # right after: waits for the next read
        return answers

    answers = asyncio.run(scenario())
    assert answers[:8] == [None] * 8 and answers[8].username == "alice" and answers[9] is None
    # nine callers shared one read; the last one waited for the next, the rate limit's period after it
    assert dht.reads == 2 and dht.read_at[1] - dht.read_at[0] >= gate_module.MIN_FETCH_PERIOD


# --- state downloads: sources without a valid token are not read (real DHTs and averagers on 127.0.0.1) -------------


def _identity(folder: Any, name: str) -> tuple[str, bytes]:
    """A libp2p RSA identity file and its public key (OpenSSH), which a token binds to the peer ID."""
    from hivemind.p2p import P2P
    from hivemind.proto import crypto_pb2

    path = str(folder / f"{name}.key")
    P2P.generate_identity(path)
    with open(path, "rb") as f:
        der = crypto_pb2.PrivateKey.FromString(f.read()).data
    return path, keys.public_key_openssh(keys.load_private_key(der))


def _download_with(gated_downloader: bool, folder: Any) -> int | None:
    """Two peers serve a state: `honest` (valid token) step 5, `banned` (its token expired) step 9, the higher
    priority. A downloader, gated or not, downloads; returns the step it got (None: nothing)."""
    import hivemind
    import torch
    from hivemind.utils.timed_storage import get_dht_time

    from trahiv.auth.client import auth_key
    from trahiv.auxiliary.checkpoints import SwarmState
    from trahiv.engine.gate import gated
    from trahiv.engine.state import StateMirror

    identities = {name: _identity(folder, name) for name in ("honest", "banned")}
    dhts = {"downloader": hivemind.DHT(start=True, nat_port_map=False)}
    first = dhts["downloader"].get_visible_maddrs()
    for name, (path, _) in identities.items():
        dhts[name] = hivemind.DHT(start=True, nat_port_map=False, initial_peers=first, identity_path=path)
    averagers: list[Any] = []
    try:
        experiment = keys.private_key_der(EXPERIMENT_KEY)
        for name, expires_in in (("honest", 600.0), ("banned", -5.0)):
            public_key = identities[name][1]
            token = sign_access_token(experiment, name, public_key, get_dht_time() + expires_in)
            stored = dhts["downloader"].store(
                auth_key("gated"),
                token.SerializeToString(),
                get_dht_time() + 600,
                subkey=peer_id_of(public_key).to_base58(),
            )
            assert stored
        for name, step in (("honest", 5), ("banned", 9)):
            server = StateMirror(dht=dhts[name], run_id="gated")
            averagers.append(server)
            server.serve(SwarmState(step, [torch.full((4,), float(step))], [], []))
        cls = gated(StateMirror, make_gate()) if gated_downloader else StateMirror
        downloader = cls(dht=dhts["downloader"], run_id="gated")
        averagers.append(downloader)

        def both_declared() -> bool:
            found = dhts["downloader"].get("gated_state_averager.all_averagers", latest=True)
            return found is not None and len(found.value) == 2

        wait_for(both_declared, 60, "both sources' state-sharing records")
        loaded = downloader.download(timeout=30)
        step = None if loaded is None else loaded[0]["epoch"]
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in dhts.values():
            dht.shutdown()
    return step


@pytest.mark.swarm
def test_a_gated_download_skips_a_source_whose_token_expired(tmp_path):
    assert _download_with(True, tmp_path) == 5  # the honest peer's state, not the banned one's (the higher priority)


@pytest.mark.swarm
def test_without_the_gate_the_download_takes_the_banned_peers_state(tmp_path):
    """The control: the same sources, an ungated downloader picks the banned peer (the higher priority)."""
    assert _download_with(False, tmp_path) == 9
