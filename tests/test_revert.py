"""Reverting a moderated swarm to a checkpoint, with real processes on 127.0.0.1: an auth server, two trainers that
train past the checkpoint's step, a user who forges revert orders, and the moderator's `trahiv revert`."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from swarm_helpers import ENV, TESTS, start_peer, start_trahiv, wait_for
from test_auth import AuthServer, join_addresses, start_server, stop_all

from trahiv.auth import keys
from trahiv.auth.revert import RevertOrder, RevertOrderError, SignedRevertOrder, sign_order, verify_order
from trahiv.engine.state import reset_scheduler
from trahiv.revert import parameters_digest

RUN = "revertrun"
STEP = 2  # the checkpoint's collaborative step
MAX_STEPS = 200  # the trainers are stopped long before


# --- orders, in-process ---------------------------------------------------------------------------------------------


def _order(**changes) -> RevertOrder:
    fields = {"run_id": RUN, "revert_id": 3, "step": 7, "issued_at": 1.7e9, "reason": "poisoned at step 8"}
    return RevertOrder(**{**fields, **changes})


def test_orders_are_signed_and_verified():
    key = keys.generate_private_key()
    public = keys.public_key_openssh(key)
    signed = sign_order(key, _order(parameters_sha256="ab" * 32))
    parsed = SignedRevertOrder.from_bytes(signed.to_bytes())
    assert parsed == signed and verify_order(parsed, public, RUN).step == 7

    tampered = SignedRevertOrder(order=_order(step=0, parameters_sha256="ab" * 32), signature=signed.signature)
    with pytest.raises(RevertOrderError, match="not signed by this experiment's key"):
        verify_order(tampered, public, RUN)
    forged = sign_order(keys.generate_private_key(), _order())
    with pytest.raises(RevertOrderError, match="not signed by this experiment's key"):
        verify_order(forged, public, RUN)
    with pytest.raises(RevertOrderError, match="is for run 'revertrun'"):
        verify_order(sign_order(key, _order()), public, "another_run")
    with pytest.raises(RevertOrderError, match="unusable experiment key"):
        verify_order(signed, b"ssh-rsa nope", RUN)
    unsigned = json.dumps({"order": _order().model_dump()}).encode()
    for data, reason in [
        (b"not json", "malformed revert order"),
        (unsigned, "signature: Field required"),
        (signed.to_bytes().replace(b'"step":7', b'"step":"7"'), "order.step: Input should be a valid integer"),
        (signed.to_bytes().replace(b'step 8"', b'step 8","extra":1'), "order.extra: Extra inputs are not permitted"),
        (b"x" * 9000, "at most 8192 bytes"),
        ("a str", "at most 8192 bytes"),
    ]:
        with pytest.raises(RevertOrderError, match=reason):
            SignedRevertOrder.from_bytes(data)
    with pytest.raises(ValueError, match="String should match pattern"):
        _order(source="not a peer id!")
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        _order(step=-1)


def test_parameters_digest_and_scheduler_rewind():
    tensors = [torch.arange(6.0).reshape(2, 3), torch.ones(4, dtype=torch.bfloat16), torch.tensor(2.0)]
    digest = parameters_digest(tensors)
    assert digest == parameters_digest([t.clone() for t in tensors])
    assert digest != parameters_digest([tensors[0].reshape(3, 2), *tensors[1:]])  # shapes count
    assert digest != parameters_digest([tensors[0] + 1e-6, *tensors[1:]])

    def schedule(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))

    def advanced(steps: int):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        scheduler = schedule(optimizer)
        while scheduler._step_count <= steps:  # hivemind's _update_scheduler
            scheduler.step()
        return optimizer, scheduler

    optimizer, scheduler = advanced(9)
    reset_scheduler(scheduler, 3)
    expected_optimizer, expected = advanced(3)
    assert (scheduler.last_epoch, scheduler._step_count) == (expected.last_epoch, expected._step_count) == (3, 4)
    assert optimizer.param_groups[0]["lr"] == expected_optimizer.param_groups[0]["lr"] == pytest.approx(0.25)


# --- the auth server ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("revert-server"))
    try:
        status, body = server.api("POST", "/api/experiments", {"run_id": RUN, "token_lifetime": 60.0})
        assert status == 201, body
        yield server
    finally:
        server.stop()


@pytest.mark.swarm
def test_server_signs_revert_orders_and_rejects_bad_ones(server: AuthServer):
    path = f"/api/experiments/{RUN}/revert"
    status, body = server.api("GET", path, token=None)
    assert (status, body) == (200, {"revert": None})
    user = server.api("POST", f"/api/experiments/{RUN}/users", {"username": "carol"})[1]["token"]
    good = {"step": 5, "reason": "bad updates after step 5"}
    for body, token, code, reason in [
        (good, None, 401, "missing 'Authorization: Bearer <token>' header"),
        (good, user, 403, "not a moderator token"),
        ({"step": -1}, "admin", 422, "body.step: Input should be greater than or equal to 0"),
        ({"step": "5"}, "admin", 422, "body.step: Input should be a valid integer"),
        ({}, "admin", 422, "body.step: Field required"),
        ({"step": 5, "source": "bad id!"}, "admin", 422, "body.source: String should match pattern"),
        ({"step": 5, "parameters_sha256": "XYZ"}, "admin", 422, "body.parameters_sha256: String should match"),
        ({"step": 5, "reason": "x" * 501}, "admin", 422, "body.reason: String should have at most 500"),
        ({"step": 5, "revert_id": 9}, "admin", 422, "body.revert_id: Extra inputs are not permitted"),
    ]:
        status, reply = server.api("POST", path, body, token=token)
        assert status == code and reason in reply["detail"], (body, status, reply)
    status, reply = server.api("POST", "/api/experiments/nope/revert", good)
    assert status == 404 and "unknown experiment 'nope'" in reply["detail"]

    public_key = server.api("GET", f"/api/experiments/{RUN}", token=None)[1]["public_key"].encode()
    orders = []
    for _ in range(2):
        status, reply = server.api("POST", path, good)
        assert status == 201, reply
        orders.append(verify_order(SignedRevertOrder.model_validate(reply), public_key, RUN))
    assert [o.revert_id for o in orders] == [orders[0].revert_id, orders[0].revert_id + 1]
    assert orders[1].step == 5 and orders[1].reason == good["reason"] and orders[1].source == ""
    status, reply = server.api("GET", path, token=None)
    assert verify_order(SignedRevertOrder.model_validate(reply["revert"]), public_key, RUN) == orders[1]


# --- a real swarm ---------------------------------------------------------------------------------------------------


def _sha256(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _records_after_revert(peer, kind: str) -> list[dict]:
    rows = peer.records()
    first = next(i for i, row in enumerate(rows) if row["kind"] == "revert")
    return [row for row in rows[first:] if row["kind"] == kind]


def _steps_after_revert(peer) -> list[int]:
    return [row["step"] for row in _records_after_revert(peer, "step")]


@pytest.mark.swarm
@pytest.mark.timeout(400)
def test_revert_returns_every_trainer_to_the_checkpoint(server: AuthServer, tmp_path, workdir):
    from trahiv.auxiliary.checkpoints import load_checkpoint, save_checkpoint
    from trahiv.revert import state_from_trainer_checkpoint

    tokens = {
        name: server.api("POST", f"/api/experiments/{RUN}/users", {"username": name})[1]["token"]
        for name in ("alice", "bob", "moderator", "eve")
    }
    opt = {"min_peers": 2, "min_peers_timeout": 240, "averaging_timeout": 10.0}
    common = dict(workdir=str(workdir), run_id=RUN, target=16, max_steps=MAX_STEPS, batch_size=8, save_steps=1,
                  sleep_per_step=0.3, opt=opt)  # fmt: skip
    peers, others = {}, []
    try:
        peers["a"] = start_peer(tmp_path, "a", auth={"server": server.url, "token": tokens["alice"]}, **common)
        initial_peers = join_addresses(peers["a"])
        auth = {"server": server.url, "token": tokens["bob"]}
        peers["b"] = start_peer(tmp_path, "b", auth=auth, initial_peers=initial_peers, **common)
        for peer in peers.values():
            peer.wait_step(STEP + 2, timeout=200)

        # the checkpoint: the swarm's state at STEP (a trainer's save), in the auxiliary peer's format
        saved = [p.out / "output" / f"checkpoint-{STEP}" for p in peers.values()]
        state, model = state_from_trainer_checkpoint(next(path for path in saved if path.exists()))
        folder = save_checkpoint(tmp_path / "checkpoints", state, model, run_id=RUN)
        assert load_checkpoint(folder).step == STEP
        expected = {name: _sha256(tensor) for name, tensor in load_file(folder / "model.safetensors").items()}

        # an allowlisted user stores forged orders in the DHT: nobody follows them
        forger_out = tmp_path / "forger"
        forger_out.mkdir()
        spec = {"out": str(forger_out), "server": server.url, "token": tokens["eve"], "run_id": RUN,
                "initial_peers": initial_peers}  # fmt: skip
        (forger_out / "spec.json").write_text(json.dumps(spec))
        forger = subprocess.Popen(
            [sys.executable, str(TESTS / "revert_forger.py"), str(forger_out / "spec.json")],
            env=ENV, stdout=open(forger_out / "log.txt", "w"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        others.append(forger)
        stored = wait_for(
            lambda: forger.poll() is None and (forger_out / "stored.json").exists(), 120, "the forged orders"
        )
        assert stored and all(json.loads((forger_out / "stored.json").read_text()).values())
        for peer in peers.values():
            wait_for(lambda p=peer: p.log().count("Ignoring a revert order") >= 3, 30, f"{peer.name} to see them")

        # the moderator reverts to the checkpoint
        config = {"dht": {"initial_peers": initial_peers, "nat_port_map": False},
                  "opt": {"run_id": RUN, "target_batch_size": 16},
                  "auth": {"server": server.url, "token": tokens["moderator"]}}  # fmt: skip
        order_file = tmp_path / "order.json"
        argv = ["revert", "--config", json.dumps(config),
                "--checkpoint", str(folder), "--admin-token-file", str(Path(server_folder(server)) / "admin"),
                "--reason", "test", "--serve-for", "300", "--order-file", str(order_file)]  # fmt: skip
        moderator_log = tmp_path / "moderator.log"
        moderator = start_trahiv(argv, moderator_log, tmp_path)
        others.append(moderator)
        wait_for(lambda: moderator.poll() is None and order_file.exists(), 120, "the revert order")
        for peer in peers.values():
            wait_for(lambda p=peer: p._check_alive() and p.records("revert"), 90, f"{peer.name} to revert")

        # every trainer holds exactly the checkpoint's weights and step, then trains on from there
        for peer in peers.values():
            (revert,) = peer.records("revert")
            assert revert["step"] == STEP, (peer.name, revert)
            assert revert["sha256"] == expected, peer.name

        # then they train on from there, together: a peer that reverted late catches up with those that reverted
        # (it downloads only their state), so after their reverts both hold the same weights at some step
        def same_weights() -> list[int]:
            after = [{r["step"]: r["checksum"] for r in _records_after_revert(peer, "step")} for peer in peers.values()]
            return [s for s in after[0].keys() & after[1].keys() if after[0][s] == pytest.approx(after[1][s], rel=1e-9)]

        wait_for(lambda: max(same_weights(), default=0) >= STEP + 2, 120, "the trainers to train on together")
        afters = {peer.name: _steps_after_revert(peer) for peer in peers.values()}
        assert {STEP + 1, STEP + 2} <= set(afters["a"]) | set(afters["b"]), afters  # training resumed at STEP + 1
        for peer in peers.values():
            after = afters[peer.name]
            assert after == sorted(set(after)) and after[0] > STEP, (peer.name, after)
            rows = peer.records()
            first = next(i for i, row in enumerate(rows) if row["kind"] == "revert")
            for row in rows[first:]:  # the linear schedule (1 warmup step) restarted at the checkpoint's step
                if row["kind"] == "log":
                    assert row["lr"] == pytest.approx(3e-3 * (MAX_STEPS - row["step"]) / (MAX_STEPS - 1), rel=1e-6), (
                        peer.name,
                        row,
                    )
            log = peer.log()
            assert "Revert order #" in log and "Reverted to collaborative step 2" in log
            assert "from the DHT" in log or "from the auth server" in log
        order = SignedRevertOrder.model_validate_json(order_file.read_text()).order
        assert order.step == STEP and order.parameters_sha256 and order.source
    finally:
        stop_all([p.process for p in peers.values()] + others)
    assert moderator.returncode == 0, moderator_log.read_text()[-3000:]


def server_folder(server: AuthServer) -> str:
    """The folder of a test auth server (where its admin token file is)."""
    return str(Path(server.process.args[server.process.args.index("--admin-token-file") + 1]).parent)


def test_revert_cli_rejects_bad_input(tmp_path, capsys):
    from trahiv.cli.main import main

    admin = tmp_path / "admin"
    admin.write_text("trahiv-admin-x\n")
    moderated = {
        "opt": {"run_id": RUN, "target_batch_size": 16},
        "auth": {"server": "http://127.0.0.1:9", "token": "t"},
    }
    for config, extra, reason in [
        ({"opt": {"run_id": RUN, "target_batch_size": 16}}, [], "reverting needs a moderated swarm"),
        (moderated, ["--serve-for", "0"], "--serve-for 0.0: expected 0 < seconds"),
        (moderated, [], "not a trahiv checkpoint"),
    ]:
        argv = ["revert", "--config", json.dumps(config), "--checkpoint", str(tmp_path), "--admin-token-file",
                str(admin), *extra]  # fmt: skip
        assert main(argv) == 2
        assert reason in capsys.readouterr().err
