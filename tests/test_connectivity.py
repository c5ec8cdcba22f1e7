"""trahiv.connectivity in one process: the silence watch's warnings, address kinds and the join addresses printed."""

from __future__ import annotations

import logging

import pytest
from swarm_helpers import start_bootstrap, start_peer

from trahiv.connectivity import PeerView, SilenceWatch, address_kind, join_lines

PUBLIC_PEER = "/ip4/44.0.0.7/tcp/31337/p2p/12D3KooWSs2VQwvuNVpN58BXcHVSKtvo5n2ztug9xUau8vpgNN2s"  # (never dialled)
LOCAL_PEER = "/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWSs2VQwvuNVpN58BXcHVSKtvo5n2ztug9xUau8vpgNN2s"


def test_silence_watch_warns_once_after_n_silent_rounds_with_peers(caplog):
    watch = SilenceWatch(3, client_mode=True)
    others = [PeerView("a", client_mode=True), PeerView("b", client_mode=True)]
    with caplog.at_level(logging.INFO, logger="trahiv.connectivity"):
        assert watch.observe(False, []) is None  # alone: nothing to average with, nothing to say
        assert [watch.observe(False, others) for _ in range(2)] == [None, None]
        warning = watch.observe(False, others)
        assert [watch.observe(False, others) for _ in range(5)] == [None] * 5  # once per silent stretch
    assert warning is not None and "every trainer is in client mode" in warning and "trahiv aux --average" in warning
    assert [r.levelno for r in caplog.records] == [logging.WARNING]  # (hivemind renames the level "WARN")
    assert watch.observe(True, others) is None  # averaged: the stretch ends, a new one may warn again
    assert [watch.observe(False, others) for _ in range(3)][-1] is not None


def test_silence_watch_counts_only_consecutive_rounds_and_names_the_cause():
    watch = SilenceWatch(3, client_mode=False)
    public = [PeerView("a", client_mode=False)]
    for averaged in (False, False, True, False, False):
        assert watch.observe(averaged, public) is None
    warning = watch.observe(False, public)
    assert warning is not None and "other peers cannot connect to this one" in warning and "trahiv doctor" in warning
    client = SilenceWatch(1, client_mode=True)
    assert "different trahiv/hivemind version" in (client.observe(False, public) or "")
    unreachable = SilenceWatch(1, client_mode=True).observe(False, public, unreachable=["a"])
    assert unreachable is not None and "cannot connect to 1 of them (a)" in unreachable and "split" in unreachable


def test_a_trainer_looks_for_a_parameter_helper_again_before_it_skips_a_parameter_round(monkeypatch):
    """Trainers all in client mode skip parameter rounds unless an aux peer announced itself as their leader; the
    answer is looked up every HELPER_LOOKUP_PERIOD. A trainer that looked as the aux peer started skipped the aux peer's
    first parameter round on an answer 3 s old (a clean-clone run of test_aux.py: the aux led that round with the other
    two). An answer "none" is looked up again before a round is skipped on it."""
    from types import SimpleNamespace

    from trahiv.engine import watch

    helpers: list[str] = []
    monkeypatch.setattr(watch, "parameter_helpers", lambda dht, run_id: list(helpers))
    rounds: list[bool] = []
    optimizer = SimpleNamespace(
        auxiliary=False, client_mode=True, dht=None, run_id="run",
        tracker=SimpleNamespace(active_peers={"a": SimpleNamespace(client_mode=True)}),
        state_averager=SimpleNamespace(step=lambda **kwargs: rounds.append(kwargs["averaging_round"])),
        _maybe_schedule_state_averaging=lambda: rounds.append(True),
    )  # fmt: skip
    watch.skip_state_rounds_that_cannot_form(optimizer)
    optimizer._maybe_schedule_state_averaging()  # looks: no helper yet (nothing scheduled)
    optimizer.state_averager.step(averaging_round=True)  # still none: skipped
    assert rounds == [False]
    helpers.append("aux")  # the aux peer announces itself, well within HELPER_LOOKUP_PERIOD
    optimizer.state_averager.step(averaging_round=True)
    assert rounds == [False, True]


@pytest.mark.parametrize(
    ("maddr", "kind"),
    [
        ("/ip4/127.0.0.1/tcp/1", "loopback"),
        ("/ip4/0.0.0.0/tcp/1", "unspecified"),
        ("/ip4/192.168.1.5/tcp/1", "private"),
        ("/ip4/10.213.0.2/tcp/1", "private"),
        ("/ip4/100.64.3.3/tcp/1", "private"),
        ("/ip4/44.0.0.7/tcp/1/p2p/x/p2p-circuit", "relay"),
        ("/ip4/203.0.113.7/tcp/1", "private"),
        ("/dns4/example.org/tcp/1", "dns"),
        ("/ip6/::1/tcp/1", "loopback"),
        ("/ip4/8.8.4.4/tcp/1", "public"),
    ],
)
def test_address_kind(maddr, kind):
    assert address_kind(maddr) == kind


def test_join_lines_print_only_addresses_others_can_dial():
    loopback = join_lines(["/ip4/127.0.0.1/tcp/5/p2p/Q"], [LOCAL_PEER], client_mode=False)
    assert loopback[0] == "To join the training, use initial_peers = ['/ip4/127.0.0.1/tcp/5/p2p/Q']"  # tests parse it
    assert "127.0.0.1 only" in loopback[1] and "host_maddrs" in loopback[1]
    mixed = ["/ip4/127.0.0.1/tcp/5/p2p/Q", "/ip4/192.168.1.5/tcp/5/p2p/Q", "/ip4/45.0.0.4/tcp/5/p2p/Q"]
    assert join_lines(mixed, [PUBLIC_PEER], client_mode=False) == [
        "To join the training, use initial_peers = ['/ip4/45.0.0.4/tcp/5/p2p/Q']"
    ]
    assert join_lines(mixed[:2], [LOCAL_PEER], client_mode=False) == [
        "To join the training, use initial_peers = ['/ip4/192.168.1.5/tcp/5/p2p/Q']"  # a LAN swarm
    ]
    behind_nat = join_lines(mixed[:2], [PUBLIC_PEER], client_mode=False)
    assert len(behind_nat) == 1 and "no address peers on other machines can dial" in behind_nat[0]
    client = join_lines(mixed, [PUBLIC_PEER], client_mode=True)
    assert "client mode" in client[0] and PUBLIC_PEER in client[0] and "To join" not in client[0]


@pytest.mark.swarm
def test_trainers_that_never_average_are_warned(tmp_path, workdir):
    """Two client-mode trainers on 127.0.0.1 and a bootstrap: no group can form (no peer accepts connections); each
    trainer's SilenceWatch, fed by the swarm's optimizer, warns once after 3 collaborative steps without averaging."""
    bootstrap = start_bootstrap(tmp_path)
    common = dict(workdir=str(workdir), run_id="silent", target=16, batch_size=8, max_steps=4, scheduler="constant")
    common.update(initial_peers=bootstrap.initial_peers, opt={"min_peers": 2, "averaging_timeout": 3.0})
    common["sleep_per_step"] = 0.5  # compute time: 0.1 s steps would finish before the peers' progress meets
    try:
        peers = [start_peer(tmp_path, f"p{i}", dht={"client_mode": True}, **common) for i in range(2)]
        dones = [peer.finish() for peer in peers]
    finally:
        bootstrap.stop()
    for peer, done in zip(peers, dones, strict=True):
        assert done["averaging_rounds"]["complete"] == 0, done
        warnings = [line for line in peer.log().splitlines() if "has not averaged with anyone for 3 steps" in line]
        assert len(warnings) == 1, peer.log()[-3000:]
        assert "every trainer is in client mode" in warnings[0]


def test_unreachable_peers_are_the_ones_that_do_not_answer():
    import hivemind

    from trahiv.connectivity import unreachable_peers

    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, wait_timeout=1.0)
    second = hivemind.DHT(start=True, initial_peers=first.get_visible_maddrs(), nat_port_map=False)
    gone = hivemind.DHT(start=True, initial_peers=first.get_visible_maddrs(), nat_port_map=False)
    gone_id = gone.peer_id.to_base58()
    gone.shutdown()
    try:
        assert unreachable_peers(first, [second.peer_id.to_base58(), gone_id]) == [gone_id]
        assert unreachable_peers(first, []) == []
    finally:
        second.shutdown()
        first.shutdown()


def test_dialback_limiter_per_caller_per_minute_and_queue():
    from trahiv.connectivity import DialBackLimiter

    now = [0.0]
    limiter = DialBackLimiter(per_caller=10.0, per_minute=3, max_queued=1, clock=lambda: now[0])
    assert limiter.admit("a") == 0.0
    assert limiter.admit("a") == pytest.approx(10.0)  # the same caller within 10 s
    assert limiter.admit("b") == 0.0
    assert limiter.admit("c") == pytest.approx(5.0)  # 2 admitted and not done (1 dialling + 1 waiting): queue full
    limiter.done()
    limiter.done()
    now[0] = 11.0
    assert limiter.admit("a") == 0.0  # a again after its interval: the third dial of this minute
    limiter.done()
    assert limiter.admit("d") == pytest.approx(49.0)  # 3 in the last minute: the oldest leaves it at t = 60
    now[0] = 60.0
    assert limiter.admit("d") == 0.0


def test_prober_asks_again_when_every_initial_peer_was_busy(monkeypatch):
    """A refused dial-back (rate limit) is not an answer: the prober tries the next initial peer, then once more
    after the time it was told; it never concludes 'unreachable' (client mode) from a refusal."""
    import asyncio

    from hivemind.p2p import PeerID

    from trahiv import connectivity
    from trahiv.connectivity import DialBack

    answers = [DialBack(False, retry_after=0.2), DialBack(False, retry_after=0.3), DialBack(True, dialled=["x"])]
    asked: list[str] = []

    async def fake_request(p2p, peer_id, maddrs, timeout):
        asked.append(peer_id.to_base58())
        return answers.pop(0)

    class FakeP2P:
        peer_id = PeerID.from_base58(LOCAL_PEER.rsplit("/", 1)[1])

        async def get_visible_maddrs(self, latest=False):
            return []

    class FakeNode:
        p2p = FakeP2P()

    monkeypatch.setattr(connectivity, "request_dialback", fake_request)
    second = "/ip4/127.0.0.1/tcp/31338/p2p/12D3KooWMEGSxULAnyzgdnsfDLBV5wjy7CThowe4rVoRqrYEy5Rv"
    answer = asyncio.run(connectivity._probe_in_dht([LOCAL_PEER, second], 1.0, None, FakeNode()))
    assert answer is not None and answer.ok and len(asked) == 3  # both busy, then the first again
    answers[:] = [DialBack(False, retry_after=120.0)]
    assert asyncio.run(connectivity._probe_in_dht([LOCAL_PEER], 1.0, None, FakeNode())) is None  # cannot tell


@pytest.mark.swarm
def test_dialback_service_refuses_a_caller_that_asks_again_at_once(tmp_path):
    """Across processes: `trahiv dht` dials a caller back once, and tells it when to ask again the second time."""
    import asyncio

    from hivemind.p2p import P2P, PeerID
    from hivemind.utils.multiaddr import Multiaddr

    from trahiv.connectivity import DIAL_INTERVAL_PER_CALLER, request_dialback

    bootstrap = start_bootstrap(tmp_path)

    async def ask_twice():
        p2p = await P2P.create(initial_peers=bootstrap.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                               nat_port_map=False)  # fmt: skip
        try:
            peer = PeerID.from_base58(Multiaddr(bootstrap.initial_peers[0]).value_for_protocol("p2p"))
            own = f"/p2p/{p2p.peer_id.to_base58()}"
            maddrs = [str(m).removesuffix(own) for m in await p2p.get_visible_maddrs()]
            return [await request_dialback(p2p, peer, maddrs, timeout=30) for _ in range(2)]
        finally:
            await p2p.shutdown()

    try:
        first, second = asyncio.run(ask_twice())
    finally:
        bootstrap.stop()
    assert first is not None and first.ok and not first.refused, first
    assert second is not None and not second.ok and second.refused, second
    assert 0 < second.retry_after <= DIAL_INTERVAL_PER_CALLER and "busy" in second.error
