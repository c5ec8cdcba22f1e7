"""The auxiliary peer in a moderated swarm, with real processes on 127.0.0.1: an auth server, `trahiv aux --average`
with a user token, and two trainers with their own. The aux peer authenticates, collects the trainers' metrics,
downloads their state through the auth gate, saves a checkpoint and helps them average (through their gates, and they
through its); with an unknown or banned token it fails at start with the server's reason (exit code 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from swarm_helpers import start_peer, start_trahiv, stop, wait_for
from test_auth import AuthServer, start_server

from trahiv.auxiliary.checkpoints import list_checkpoints, load_checkpoint
from trahiv.auxiliary.store import MetricsStore, default_store_url

pytestmark = pytest.mark.timeout(400)

RUN = "auxauthrun"
LIFETIME = 10.0  # the aux peer renews its access token during the test


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("aux-auth-server"))
    try:
        status, body = server.api("POST", "/api/experiments", {"run_id": RUN, "token_lifetime": LIFETIME})
        assert status == 201, body
        yield server
    finally:
        server.stop()


def _config(server: AuthServer, token: str, initial_peers: list[str] | None = None) -> str:
    return json.dumps({
        "dht": {"nat_port_map": False, "initial_peers": initial_peers or []},
        "opt": {"run_id": RUN, "target_batch_size": 16},
        "auth": {"server": server.url, "token": token},
    })  # fmt: skip


def _add_user(server: AuthServer, username: str) -> str:
    status, body = server.api("POST", f"/api/experiments/{RUN}/users", {"username": username})
    assert status == 201, body
    return str(body["token"])


@pytest.mark.swarm
def test_aux_peer_is_refused_at_start_with_the_servers_reason(server, tmp_path, capsys):
    from trahiv.cli.main import main

    banned = _add_user(server, "spammer")
    assert server.api("POST", f"/api/experiments/{RUN}/users/spammer/ban", {"reason": "spam"})[0] == 200
    for token, reason in [
        ("trahiv-user-not-a-real-token-000000", f"unknown user token for experiment '{RUN}'"),
        (banned, f"'spammer' is banned from '{RUN}': spam"),
    ]:
        argv = ["aux", "--config", _config(server, token), "--output-dir", str(tmp_path / "out"), "--report-to", "none"]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert reason in err and "Traceback" not in err, err


@pytest.mark.swarm
def test_aux_peer_with_a_token_collects_metrics_and_checkpoints(server, tmp_path, workdir):
    out, addresses, log = tmp_path / "aux", tmp_path / "aux-addresses.json", tmp_path / "aux.log"
    argv = [
        "aux", "--config", _config(server, _add_user(server, "keeper")),
        "--output-dir", str(out), "--report-to", "none", "--addresses-file", str(addresses), "--period", "1",
        "--model", str(workdir / "model"), "--checkpoint-every", "1", "--state-poll", "0.5", "--average",
    ]  # fmt: skip
    aux = start_trahiv(argv, log, tmp_path)
    try:

        def joined() -> list[str] | None:
            if aux.poll() is not None:
                raise AssertionError(f"aux peer exited with {aux.returncode}:\n{log.read_text()[-4000:]}")
            return json.loads(addresses.read_text()) if addresses.exists() and addresses.stat().st_size else None

        initial_peers = wait_for(joined, 90, "the aux peer")
        trainers = [
            start_peer(tmp_path, name, workdir=str(workdir), run_id=RUN, target=16, max_steps=200, batch_size=8,
                       sleep_per_step=0.5, auth={"server": server.url, "token": _add_user(server, name)},
                       initial_peers=initial_peers, opt={"min_peers": 2})
            for name in ("alice", "bob")
        ]  # fmt: skip
        try:  # the trainers keep training (and serving their state) until the aux peer saved a checkpoint
            for trainer in trainers:
                trainer.ready(timeout=120)
            checkpoints = out / "checkpoints"
            alive = lambda: all(t._check_alive() for t in trainers)  # noqa: E731
            saved = wait_for(lambda: alive() and list_checkpoints(checkpoints), 90, "a checkpoint")
            helped = "complete averaging round with 3 peers"  # both trainers and the aux peer, through the gates
            wait_for(lambda: alive() and helped in log.read_text(errors="replace"), 90, "a round the aux peer helped")
            store = MetricsStore(default_store_url(out))
            try:
                steps = wait_for(lambda: [row["step"] for row in store.steps()], 30, "the trainers' steps in the store")
                # each trainer's first metrics record reaches the store at the collector's next read (it once held
                # alice's while bob's was on its way): wait for both, then compare
                both = lambda: {row["name"] for row in store.contributors()} >= {"alice", "bob"}  # noqa: E731
                wait_for(lambda: alive() and both(), 30, "both trainers in the store")
                names = {row["name"] for row in store.contributors()}
            finally:
                store.close()
        finally:
            for trainer in trainers:
                stop(trainer.process)
    finally:
        stop(aux)
    text = log.read_text(errors="replace")
    assert aux.returncode == 0, text[-3000:]
    assert f"Authenticated as 'keeper' for '{RUN}'" in text
    # the helper does not build a parameter-round averager under the names the keeper serves state with (it failed
    # at every start with a traceback: "...rpc_join_group already set"); it says why it offers none
    assert "already set" not in text and "parameter rounds not offered (this aux peer keeps" in text, text[-3000:]
    assert steps and min(steps) >= 1, steps
    assert names == {"alice", "bob"}  # metrics records carry the trainers' usernames
    # the newest checkpoint now (the one listed while training may have been pruned by retention since)
    assert saved
    checkpoint = load_checkpoint(list_checkpoints(out / "checkpoints")[-1])  # downloaded through the auth gate
    assert checkpoint.run_id == RUN and checkpoint.step >= 1
    assert (Path(checkpoint.path) / "model.safetensors").exists()


# --- in-process -------------------------------------------------------------------------------------------------


def test_gated_state_mirror_keeps_the_trainers_rpc_names():
    from hivemind.optim.state_averager import TrainingStateAverager

    from trahiv.auth.gate import AuthGate
    from trahiv.engine.gate import gated
    from trahiv.engine.state import StateMirror

    cls = gated(StateMirror, AuthGate(RUN, b"ssh-rsa AAAA"))
    cls._rpc_handlers = None  # collected afresh, as in the forked averager process
    cls._collect_rpc_handlers()
    assert {h.method_name for h in cls._rpc_handlers} == {"rpc_aggregate_part", "rpc_download_state", "rpc_join_group"}
    for method in ("rpc_download_state", "rpc_join_group"):
        assert cls._get_handle_name(RUN, method) == TrainingStateAverager._get_handle_name(RUN, method)


class _Mirror:
    """What the keeper uses of its StateMirror, without a process."""

    def __init__(self):
        self.state = None

    def serve(self, state):
        self.state = state

    def withdraw(self):
        self.state = None


def test_keeper_sets_aside_reverted_checkpoints(tmp_path):
    from types import SimpleNamespace

    from transformers import GPT2LMHeadModel

    from trahiv.auxiliary.checkpoints import SwarmState, save_checkpoint, swarm_parameters
    from trahiv.auxiliary.keeper import StateKeeper
    from trahiv.auxiliary.state import StateKeeperConfig
    from trahiv.demo import tiny_gpt2_config

    model = GPT2LMHeadModel(tiny_gpt2_config(n_layer=1, n_embd=32, n_head=2))
    params = [p.detach().clone() for _, p in swarm_parameters(model)]
    folder = tmp_path / "checkpoints"
    states = {step: SwarmState(step, [p + step for p in params], [], []) for step in (2, 4, 6)}
    for state in states.values():
        save_checkpoint(folder, state, model, run_id=RUN)
    keeper = StateKeeper(StateKeeperConfig(model="unused", checkpoint_dir=str(folder)), model=model)
    keeper.run_id, keeper.mirror = RUN, _Mirror()
    keeper.mirror.serve(states[6])
    order = SimpleNamespace(order=SimpleNamespace(revert_id=7, step=3))
    keeper._watcher = SimpleNamespace(pending=lambda applied: order if applied < 7 else None, grace=60.0)

    assert keeper.follow_revert() and not keeper.follow_revert()  # applied once
    assert [p.name for p in list_checkpoints(folder)] == ["checkpoint-2"]
    assert sorted(p.name for p in (folder / "reverted-7").iterdir()) == ["checkpoint-4", "checkpoint-6"]
    assert keeper.step == 2  # serves the newest checkpoint the revert kept, not the reverted-away state
    assert all(a.equal(b + 2) for a, b in zip(keeper.mirror.state.parameters, params, strict=True))
    assert keeper.poll() is None  # no download during the revert's grace period

    assert keeper.apply_revert(8, 0) == [folder / "reverted-8" / "checkpoint-2"]
    assert list_checkpoints(folder) == [] and keeper.step is None  # nothing left to serve
