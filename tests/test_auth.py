"""Authentication, allowlists and moderation, with real processes on 127.0.0.1: an auth server, three trainers (alice,
bob, mallory) of a moderated swarm, and an intruder (tests/auth_attacker.py). Access tokens live 10 s here."""

from __future__ import annotations

import ast
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from swarm_helpers import ENV, TESTS, Peer, start_peer, stop, wait_for

from trahiv.auth import AuthError, PeerAuth

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(600)]  # a busy machine may take minutes to start the peers

RUN_ID = "authrun"
LIFETIME = 10.0
MAX_STEPS = 24  # each step takes >= 1 s (2 local steps of 0.5 s): >= 2 steps after the banned token expired


@dataclass
class AuthServer:
    process: subprocess.Popen
    url: str
    admin: str

    def api(self, method: str, path: str, body: Any = None, token: str | None = "admin") -> tuple[int, Any]:
        request = urllib.request.Request(
            self.url + path, data=None if body is None else json.dumps(body).encode(), method=method
        )
        request.add_header("Content-Type", "application/json")
        if token is not None:
            request.add_header("Authorization", f"Bearer {self.admin if token == 'admin' else token}")
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def add_user(self, username: str) -> str:
        status, body = self.api("POST", f"/api/experiments/{RUN_ID}/users", {"username": username})
        assert status == 201, body
        return str(body["token"])

    def stop(self) -> None:
        stop(self.process)


def start_server(folder: Path) -> AuthServer:
    folder.mkdir(parents=True, exist_ok=True)
    url_file = folder / "url"
    url_file.unlink(missing_ok=True)
    command = [sys.executable, "-m", "trahiv.cli.main", "auth-server", "--db", f"sqlite:///{folder / 'auth.db'}",
               "--port", "0", "--admin-token-file", str(folder / "admin"), "--url-file", str(url_file)]  # fmt: skip
    log = open(folder / "server.log", "a")
    process = subprocess.Popen(command, env=ENV, stdout=log, stderr=subprocess.STDOUT)
    url = wait_for(lambda: process.poll() is None and url_file.exists() and url_file.read_text(), 90, "auth server")
    return AuthServer(process, url, (folder / "admin").read_text().strip())


def join_addresses(peer: Peer) -> list[str]:
    line = wait_for(
        lambda: [row for row in peer.log().splitlines() if "To join the training" in row], 180, f"{peer.name}'s address"
    )[0]
    return list(ast.literal_eval(line.split("initial_peers = ", 1)[1]))


@dataclass
class AuthSwarm:
    server: AuthServer
    peers: dict[str, Peer]
    intruder: subprocess.Popen
    intruder_out: Path
    ban_time: float | None = None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("auth-server"))
    try:
        status, body = server.api("POST", "/api/experiments", {"run_id": RUN_ID, "token_lifetime": LIFETIME})
        assert status == 201, body
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def swarm(server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("auth-swarm")
    tokens = {name: server.add_user(name) for name in ("alice", "bob", "mallory", "eve")}
    torch.save(torch.randint(0, 100, (256, 8)), tmp / "blocks.pt")  # the toy model ignores the data
    common = dict(workdir=str(tmp), run_id=RUN_ID, target=12, max_steps=MAX_STEPS, batch_size=2, sleep_per_step=0.5,
                  opt={"min_peers": 3, "min_peers_timeout": 240})  # fmt: skip
    peers: dict[str, Peer] = {}
    intruder = None
    try:
        auth = {"server": server.url, "token": tokens["alice"]}
        peers["alice"] = start_peer(tmp, "alice", toy_grad=1.0, auth=auth, **common)
        initial_peers = join_addresses(peers["alice"])
        for name, grad in (("bob", 1.0), ("mallory", -3.0)):
            auth = {"server": server.url, "token": tokens[name]}
            peers[name] = start_peer(tmp, name, toy_grad=grad, auth=auth, initial_peers=initial_peers, **common)
        alice = peers["alice"].ready(timeout=300)  # generous: three peers start together on a busy machine
        out = tmp / "intruder"
        out.mkdir()
        spec = {"out": str(out), "server": server.url, "run_id": RUN_ID, "eve_token": tokens["eve"],
                "target_peer_id": alice["peer_id"], "target_maddrs": initial_peers}  # fmt: skip
        (out / "spec.json").write_text(json.dumps(spec))
        intruder = subprocess.Popen(
            [sys.executable, str(TESTS / "auth_attacker.py"), str(out / "spec.json")],
            env=ENV, stdout=open(out / "log.txt", "w"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        yield AuthSwarm(server, peers, intruder, out)
    finally:
        stop_all([p.process for p in peers.values()] + ([intruder] if intruder else []))


def stop_all(processes: list[subprocess.Popen], timeout: float = 10) -> None:
    """SIGTERM every process at once, then wait for all together (SIGKILL what is left after `timeout`)."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def round_events(log: str) -> str:
    """The lines of a peer's log that tell how its rounds went (shown when a step was lost)."""
    keys = ("Beginning optimizer step", "without this peer", "Refused", "leaving the averaging", "access token",
            "partial", "caught", "downloading")  # fmt: skip
    return "\n".join(line[:240] for line in log.splitlines() if any(k in line for k in keys))[-4000:]


def deltas(peer: Peer) -> dict[int, list[float]]:
    """How each collaborative step moved the toy weights: -1 per step when only honest gradients (+1) count."""
    values = {row["step"]: row["values"] for row in peer.records("begin") + peer.records("step")}
    return {s: [a - b for a, b in zip(values[s], values[s - 1], strict=True)] for s in values if s - 1 in values}


def step_times(peer: Peer, key: str = "t") -> dict[int, float]:
    """When this peer finished each collaborative step (key "t"), or began the local step whose averaging rounds
    made it ("began")."""
    times: dict[int, float] = {}
    for row in peer.records("local"):
        if row["epoch_after"] > row["epoch_before"]:
            times.setdefault(row["epoch_after"], row[key])
    return times


def test_banned_peer_leaves_the_next_rounds_and_others_lose_no_step(swarm):
    alice, bob, mallory = (swarm.peers[name] for name in ("alice", "bob", "mallory"))
    alice.wait_step(4, timeout=150)
    mallory.wait_step(4, timeout=150)
    status, body = swarm.server.api("POST", f"/api/experiments/{RUN_ID}/users/mallory/ban", {"reason": "bad grads"})
    assert status == 200 and body["banned"], body
    ban_time = time.time()
    for peer in (alice, bob):
        assert peer.finish(timeout=200)["global_step"] == MAX_STEPS
        start = peer.ready()["start_step"]  # a peer that joined late first downloaded the swarm's state
        steps = sorted(peer.params_at())
        assert steps == list(range(start + 1, MAX_STEPS + 1)), (peer.name, round_events(peer.log()))  # none lost
    influenced = False
    for peer in (alice, bob):
        moved, times, began = deltas(peer), step_times(peer), step_times(peer, "began")
        before = [s for s in moved if times[s] < ban_time]
        # rounds begun once mallory's last token expired, plus margin (by when a step ended, a step whose parameter
        # round stalled 30 s after its gradient round with mallory counted as "after": clean-clone run I)
        after = [s for s in moved if began[s] > ban_time + LIFETIME + 4]
        influenced |= any(moved[s] != pytest.approx([-1.0] * 4, abs=1e-5) for s in before)
        assert len(after) >= 2, (peer.name, times, ban_time)
        for step in after:
            assert moved[step] == pytest.approx([-1.0] * 4, abs=1e-5), (peer.name, step, moved)  # honest grads only
    assert influenced  # before the ban, mallory's gradients (-3) were averaged in
    assert "is banned from 'authrun': bad grads" in mallory.log()
    assert {row["name"] for row in alice.records("metrics")} == {"alice"}  # metrics records carry the username
    status, users = swarm.server.api("GET", f"/api/experiments/{RUN_ID}/users")
    by_name = {u["username"]: u for u in users}
    assert by_name["mallory"]["banned"] and by_name["mallory"]["ban_reason"] == "bad grads"
    assert by_name["alice"]["samples"] > 0 and by_name["alice"]["steps"] > 0  # contributions reported on renewal
    status, board = swarm.server.api("GET", f"/api/experiments/{RUN_ID}/contributions", token=None)
    assert status == 200 and {row["username"] for row in board} >= {"alice", "bob", "mallory"}


def test_intruders_can_neither_store_nor_average_nor_download(swarm):
    """No token, a token for another key, an expired token, replayed requests: all refused; eve (allowlisted) is the
    control that the same calls succeed with a valid token."""
    try:
        swarm.intruder.wait(timeout=150)
    except subprocess.TimeoutExpired:
        raise AssertionError((swarm.intruder_out / "log.txt").read_text()[-3000:]) from None
    log = (swarm.intruder_out / "log.txt").read_text()
    assert swarm.intruder.returncode == 0, log[-3000:]
    results = json.loads((swarm.intruder_out / "results.json").read_text())
    refused = {"dht_store": None, "join": "PROTOCOL_VIOLATION", "aggregate": "PROTOCOL_VIOLATION", "download": 0}
    for phase in ("no_token", "other_key", "expired"):
        assert results[phase] == refused, (phase, results)
    legit = results["legit"]
    seen = "\n".join(line for line in swarm.peers["alice"].log().splitlines() if legit["peer_id"] in line)
    legit["alice_on_eve"] = seen[-2000:]  # (the target's view of eve, shown if an assertion below fails)
    assert legit["dht_store"] == [True], legit
    assert legit["replayed_store"].startswith("refused"), legit  # the same signed bytes a second time
    assert legit["join"] not in ("PROTOCOL_VIOLATION",) and not legit["join"].startswith("error"), legit
    assert legit["aggregate"] == "BAD_GROUP_ID", legit  # reached the averager: only the group id is wrong
    assert legit["token_left_s"] > 0, legit  # (the control ran while eve's token was valid)
    assert isinstance(legit["download"], int) and legit["download"] > 0, legit
    assert legit["replayed_join_from_x"] == "PROTOCOL_VIOLATION", legit  # eve's join request, sent by X
    assert legit["reads_intruder_keys"] == [False, False] and legit["reads_own_key"] is True, legit


def test_gated_averagers_keep_the_swarms_rpc_names_and_streaming():
    from trahiv.auth.gate import AuthGate
    from trahiv.engine.gate import gated
    from trahiv.engine.optimizer import SwarmOptimizer
    from trahiv.swarm import Swarm

    told = {"rpc_trahiv_round_began": False}  # (trahiv.engine.tell: the gradient averagers', gated as well)
    for cls, own in ((Swarm.grad_averager_cls, told), (SwarmOptimizer.state_averager_cls, {})):
        gated_cls = gated(cls, AuthGate(RUN_ID, b"ssh-rsa AAAA"))
        gated_cls._rpc_handlers = None  # collected afresh, as in the forked averager process
        gated_cls._collect_rpc_handlers()
        assert {h.method_name: h.stream_output for h in gated_cls._rpc_handlers} == {
            "rpc_aggregate_part": True, "rpc_download_state": True, "rpc_join_group": True, **own}  # fmt: skip
        if own:
            assert "rpc_trahiv_round_began" in vars(gated_cls.__mro__[1])  # the gate's, in front of the handler
        assert gated_cls._get_handle_name("p", "rpc_join_group") == cls._get_handle_name("p", "rpc_join_group")
        assert issubclass(gated_cls, cls)


def test_refused_peers_fail_at_start_with_the_reason(server):
    with pytest.raises(AuthError, match="unknown user token"):
        PeerAuth.start(server.url, "trahiv-user-not-a-real-token-000000", RUN_ID)
    with pytest.raises(AuthError, match="unknown experiment 'nope'"):
        PeerAuth.start(server.url, "trahiv-user-not-a-real-token-000000", "nope")
    token = server.add_user("banned_at_start")
    server.api("POST", f"/api/experiments/{RUN_ID}/users/banned_at_start/ban", {"reason": "spam"})
    with pytest.raises(AuthError, match="'banned_at_start' is banned from 'authrun': spam"):
        PeerAuth.start(server.url, token, RUN_ID)
    with pytest.raises(AuthError, match="could not reach the auth server"):
        PeerAuth.start("http://127.0.0.1:9", token, RUN_ID, timeout=2)
    status, body = server.api("GET", f"/api/experiments/{RUN_ID}")
    with pytest.raises(AuthError, match="another key than the pinned"):
        PeerAuth.start(server.url, server.add_user("pinned"), RUN_ID, experiment_public_key="ssh-rsa AAAAB3Nza")
    auth = PeerAuth.start(server.url, server.add_user("fine"), RUN_ID, experiment_public_key=body["public_key"])
    try:
        assert auth.username == "fine" and LIFETIME - 2 < auth.lifetime <= LIFETIME
    finally:
        auth.close()


def test_bootstrap_peer_joins_a_moderated_swarm_only_with_a_token(server, tmp_path, capsys):
    from trahiv.cli.main import main

    token_file = tmp_path / "token"
    token_file.write_text("trahiv-user-not-a-real-token-000000\n")
    args = ["dht", "--no-nat-port-map", "--auth-server", server.url, "--run-id", RUN_ID]
    assert main(args + ["--auth-token-file", str(token_file)]) == 2
    assert "unknown user token for experiment 'authrun'" in capsys.readouterr().err
    assert main(args) == 2
    assert "--auth-server needs --run-id and --auth-token-file" in capsys.readouterr().err


def test_server_rejects_bad_input_and_keeps_allowlist_and_bans_across_restarts(tmp_path):
    server = start_server(tmp_path / "srv")
    try:
        api = server.api
        assert api("POST", "/api/experiments", {"run_id": "a b"})[0] == 422
        status, body = api("POST", "/api/experiments", {"run_id": "r", "token_lifetime": 1, "colour": "red"})
        assert status == 422 and "token_lifetime" in body["detail"] and "colour: Extra inputs" in body["detail"]
        assert api("POST", "/api/experiments", {"run_id": "r"}, token=None) == (
            401, {"detail": "missing 'Authorization: Bearer <token>' header"})  # fmt: skip
        assert api("POST", "/api/experiments", {"run_id": "r"}, token="x" * 20)[0] == 403
        assert api("POST", "/api/experiments", {"run_id": RUN_ID})[0] == 201
        assert api("POST", "/api/experiments", {"run_id": RUN_ID})[0] == 409
        assert api("POST", "/api/experiments/nope/users", {"username": "a"})[0] == 404
        status, body = api("POST", f"/api/experiments/{RUN_ID}/users", {"username": "x" * 65})
        assert status == 422 and "body.username" in body["detail"]
        alice, bob = server.add_user("alice"), server.add_user("bob")
        assert api("POST", f"/api/experiments/{RUN_ID}/users", {"username": "alice"})[0] == 409
        assert api("POST", f"/api/experiments/{RUN_ID}/users/bob/ban", {"reason": "cheating"})[0] == 200
        assert api("POST", f"/api/experiments/{RUN_ID}/users/zed/ban", {})[0] == 404
        status, body = api("POST", f"/api/experiments/{RUN_ID}/access_token", {"public_key": "ssh-rsa AAAA" + "B" * 20},
                           token=alice)  # fmt: skip
        assert status == 422 and "not an RSA public key" in body["detail"]
        status, body = api("POST", f"/api/experiments/{RUN_ID}/access_token", {"public_key": 5}, token=alice)
        assert status == 422 and "body.public_key" in body["detail"]
    finally:
        server.stop()
    server = start_server(tmp_path / "srv")  # same database and admin token file
    try:
        auth = PeerAuth.start(server.url, alice, RUN_ID)
        auth.close()
        with pytest.raises(AuthError, match="'bob' is banned from 'authrun': cheating"):
            PeerAuth.start(server.url, bob, RUN_ID)
        status, users = server.api("GET", f"/api/experiments/{RUN_ID}/users")  # the admin token still works
        assert status == 200 and [(u["username"], u["banned"]) for u in users] == [("alice", False), ("bob", True)]
        assert server.api("POST", f"/api/experiments/{RUN_ID}/users/bob/unban")[0] == 200
        PeerAuth.start(server.url, bob, RUN_ID).close()
    finally:
        server.stop()


def test_every_write_is_committed_before_its_answer_starts(tmp_path):
    """A client that asks again as soon as it has an answer (ban the user it has just added) must find what the answer
    said was written: the request's transaction commits before the answer starts, not after it is sent."""
    import asyncio

    from sqlalchemy import select

    from trahiv.auth.server import AuthServerState, Experiment, User, create_app, open_database

    state = AuthServerState(open_database(f"sqlite:///{tmp_path / 'auth.db'}"))
    admin = state.ensure_admin()
    app = create_app(state)

    def committed() -> tuple[bool, bool, bool]:  # what another connection sees right now
        with state.sessions() as db:
            user = db.scalar(select(User).where(User.run_id == "r", User.username == "u"))
            return db.get(Experiment, "r") is not None, user is not None, bool(user is not None and user.banned)

    async def call(path: str, body: dict[str, Any]) -> tuple[int, tuple[bool, bool, bool]]:
        data, seen = json.dumps(body).encode(), []
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": [(b"content-type", b"application/json"), (b"authorization", f"Bearer {admin}".encode())],
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
        }  # fmt: skip

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": data, "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                seen.append((message["status"], committed()))

        await app(scope, receive, send)
        return seen[0]

    assert asyncio.run(call("/api/experiments", {"run_id": "r"})) == (201, (True, False, False))
    assert asyncio.run(call("/api/experiments/r/users", {"username": "u"})) == (201, (True, True, False))
    assert asyncio.run(call("/api/experiments/r/users/u/ban", {"reason": "spam"})) == (200, (True, True, True))
