"""One peer lifecycle (trahiv/lifecycle.py): auth -> DHT -> token -> watchers in order, the reverse on exit, and when a
step in the middle fails, what started is stopped and nothing else. One process; the DHT, the auth client and the
revert watcher are stand-ins that record what happens to them (the real ones: tests/test_auth.py, test_revert.py)."""

from __future__ import annotations

import logging

import pytest

import trahiv.revert
import trahiv.swarm
from trahiv.config import DHTConfig
from trahiv.lifecycle import Lifecycle, join_swarm


class Events(list):
    def step(self, name: str, fail: bool = False):
        def start() -> str:
            self.append(f"start {name}")
            if fail:
                raise RuntimeError(f"{name} failed")
            return name

        return start

    def stop(self, value: str) -> None:
        self.append(f"stop {value}")


def test_steps_stop_in_reverse_order_once():
    events = Events()
    with Lifecycle() as life:
        assert [life.enter(n, events.step(n), events.stop) for n in ("a", "b", "c")] == ["a", "b", "c"]
        assert life.started == ["a", "b", "c"]
        life.close(after="a")  # e.g. the watchers and the token before a trainer's averagers stop
        assert life.started == ["a"]
    assert events == ["start a", "start b", "start c", "stop c", "stop b", "stop a"]


def test_a_failing_step_stops_what_started_and_nothing_else(caplog):
    events = Events()
    with pytest.raises(RuntimeError, match="c failed"), Lifecycle() as life:
        life.enter("a", events.step("a"), events.stop)
        life.enter("b", events.step("b"), lambda _: 1 / 0)  # a stop that fails: logged, the next one still runs
        life.enter("c", events.step("c", fail=True), events.stop)
        life.enter("d", events.step("d"), events.stop)
    assert events == ["start a", "start b", "start c", "stop a"]
    assert "Stopping b failed: ZeroDivisionError" in caplog.text and not life.started


class FakeDHT:
    def __init__(self, events: Events, peer_id: str = "peer"):
        self.events, self.peer_id, self.alive = events, peer_id, True

    def is_alive(self) -> bool:
        return self.alive

    def shutdown(self) -> None:
        self.events.append("stop dht")
        self.alive = False

    def join(self, timeout: float | None = None) -> None:
        pass

    @property
    def exitcode(self) -> int | None:
        return None if self.alive else 0


class FakeAuth:
    experiment_public_key, client = "ssh-rsa KEY", "client"

    def __init__(self, events: Events, fail_attach: bool = False):
        self.events, self.fail_attach = events, fail_attach

    def dht_kwargs(self) -> dict:
        return {"record_validators": ["signed"]}

    def attach(self, dht: FakeDHT, contribution=None) -> None:
        self.events.append(f"start token {contribution() if contribution else None}")
        if self.fail_attach:
            raise RuntimeError("token refused")

    def close(self) -> None:
        self.events.append("stop auth")


class FakeWatcher:
    def __init__(self, dht, run_id, key, client):
        self.events = dht.events
        assert (run_id, key, client) == ("run", "ssh-rsa KEY", "client")

    def start(self) -> FakeWatcher:
        self.events.append("start watcher")
        return self

    def close(self) -> None:
        self.events.append("stop watcher")


@pytest.fixture
def events(monkeypatch) -> Events:
    events = Events()

    def start_dht(config, **extra):
        assert extra == {"record_validators": ["signed"]} or extra == {}
        events.append("start dht")
        return FakeDHT(events)

    monkeypatch.setattr(trahiv.swarm, "start_dht", start_dht)
    monkeypatch.setattr(trahiv.revert, "RevertWatcher", FakeWatcher)
    return events


def _auth(events: Events, **kwargs):
    def start() -> FakeAuth:
        events.append("start auth")
        return FakeAuth(events, **kwargs)

    return start


def test_a_moderated_peer_joins_in_order_and_leaves_in_reverse(events):
    life = Lifecycle()
    member = join_swarm(life, DHTConfig(), auth=_auth(events), run_id="run", contribution=lambda: (8, 1))
    assert isinstance(member.revert_watcher, FakeWatcher) and member.auth is not None
    assert events == ["start auth", "start dht", "start token (8, 1)", "start watcher"]
    assert life.started == ["auth", "dht", "token", "watchers"]
    life.close()
    # the token stops (no renewal) before the DHT; the auth step's own close runs again last (it is idempotent)
    assert events[4:] == ["stop watcher", "stop auth", "stop dht", "stop auth"]


def test_an_open_swarm_peer_has_no_token_nor_watcher(events):
    with Lifecycle() as life:
        member = join_swarm(life, DHTConfig(), auth=lambda: None, run_id="run")
        assert member.auth is None and member.revert_watcher is None and life.started == ["auth", "dht"]
    assert events == ["start dht", "stop dht"]


def test_a_refused_token_stops_the_dht_and_the_auth_and_nothing_else(events, caplog):
    caplog.set_level(logging.WARNING)
    life = Lifecycle()
    with pytest.raises(RuntimeError, match="token refused"):
        join_swarm(life, DHTConfig(), auth=_auth(events, fail_attach=True), run_id="run")
    assert events == ["start auth", "start dht", "start token None", "stop dht", "stop auth"]
    assert not life.started and "failed" not in caplog.text


def test_a_refused_auth_starts_no_dht(events):
    def refused() -> FakeAuth:
        raise ValueError("unknown user token")

    with pytest.raises(ValueError, match="unknown user token"):
        join_swarm(Lifecycle(), DHTConfig(), auth=refused, run_id="run")
    assert events == []
