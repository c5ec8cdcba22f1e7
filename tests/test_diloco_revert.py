"""`trahiv revert` in a moderated DiLoCo swarm (trahiv.revert.DiLoCoRevertFollower): real processes on 127.0.0.1 (an
auth server, two DiLoCo trainers, the moderator's `trahiv revert` with a trainer's checkpoint)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
import torch
from swarm_helpers import Peer, start_peer, start_trahiv, stop, wait_for
from test_auth import join_addresses, start_server

from trahiv.auxiliary.checkpoints import swarm_parameters
from trahiv.revert import state_from_trainer_checkpoint

pytestmark = pytest.mark.swarm

RUN = "diloco_revert"
H = 4
REVERT_DELAY = 6.0  # b applies the order that long after it sees it: a reaches its next sync point first


def sha256(tensor: torch.Tensor) -> str:  # as tests/diloco_worker.py records the trainable tensors after each sync
    return hashlib.sha256(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def outer_steps(peer: Peer) -> list[dict[str, Any]]:
    """The peer's "sync" records, in order: one per outer step it reached (a revert goes back to an earlier one)."""
    return peer.records("sync")


def after_revert(peer: Peer) -> list[dict[str, Any]]:
    rows = outer_steps(peer)
    back = [i for i in range(1, len(rows)) if rows[i]["outer_step"] < rows[i - 1]["outer_step"]]
    return rows[back[0] :] if back else []


@pytest.mark.timeout(400)
def test_revert_returns_every_diloco_peer_to_the_checkpoints_outer_state(tmp_path, workdir):
    server = start_server(tmp_path / "server")
    peers: list[Peer] = []
    moderator = None
    try:
        status, body = server.api("POST", "/api/experiments", {"run_id": RUN, "token_lifetime": 60.0})
        assert status == 201, body
        tokens = {
            name: server.api("POST", f"/api/experiments/{RUN}/users", {"username": name})[1]["token"]
            for name in ("alice", "bob", "moderator")
        }
        common = {"workdir": str(workdir), "run_id": RUN, "batch_size": 2, "inner_steps": H, "max_steps": 400,
                  "sleep_per_step": 0.2, "save_steps": 2 * H, "diloco": {"compression": "none"},
                  "opt": {"min_peers": 2, "min_peers_timeout": 120}}  # fmt: skip
        peers.append(start_peer(tmp_path, "a", worker="diloco_worker.py",
                                auth={"server": server.url, "token": tokens["alice"]}, **common))  # fmt: skip
        initial_peers = join_addresses(peers[0])
        peers.append(start_peer(tmp_path, "b", worker="diloco_worker.py", initial_peers=initial_peers,
                                auth={"server": server.url, "token": tokens["bob"]}, revert_delay=REVERT_DELAY,
                                **common))  # fmt: skip

        def reached(step: int) -> bool:
            return all(p._check_alive() and max((r["outer_step"] for r in outer_steps(p)), default=0) >= step
                       for p in peers)  # fmt: skip

        wait_for(lambda: reached(3), 180, "the peers' outer step 3")
        checkpoint = peers[0].out / "output" / f"checkpoint-{2 * H}"  # right after the sync to outer step 2
        state, model = state_from_trainer_checkpoint(checkpoint)
        assert state.step == 2 and len(state.optimizer_tensors) == len(state.parameters)
        expected = {name: sha256(t) for (name, _), t in zip(swarm_parameters(model), state.parameters, strict=True)}
        assert next(r for r in outer_steps(peers[0]) if r["outer_step"] == 2)["sha256"] == expected

        admin = tmp_path / "admin"
        admin.write_text(server.admin)
        order_file = tmp_path / "order.json"
        config = {"dht": {"initial_peers": initial_peers, "nat_port_map": False},
                  "opt": {"run_id": RUN, "target_batch_size": 1}, "diloco": {"inner_steps": H},
                  "auth": {"server": server.url, "token": tokens["moderator"]}}  # fmt: skip
        argv = ["revert", "--config", json.dumps(config),
                "--checkpoint", str(checkpoint), "--admin-token-file", str(admin), "--serve-for", "300",
                "--order-file", str(order_file)]  # fmt: skip
        log = tmp_path / "moderator.log"
        moderator = start_trahiv(argv, log, tmp_path)
        wait_for(lambda: moderator.poll() is None and order_file.exists(), 120, "the revert order")

        def trained_on() -> bool:  # both reverted, then synced at least once more
            return all(p._check_alive() and len(after_revert(p)) >= 2 for p in peers)

        wait_for(trained_on, 120, "the peers to revert and sync again")
    finally:
        if moderator is not None:
            stop(moderator)
        for peer in peers:
            stop(peer.process)
        server.stop()

    rows = [after_revert(peer) for peer in peers]
    for peer, after in zip(peers, rows, strict=True):
        assert after[0]["outer_step"] == 2 and after[0]["sha256"] == expected, (peer.name, after[0])
        assert after[0]["global_step"] == 2 * H, after[0]  # the Trainer's step (and LR schedule) follows
    assert rows[0][1]["outer_step"] == rows[1][1]["outer_step"] == 3
    assert rows[0][1]["sha256"] == rows[1][1]["sha256"]  # together again after the next sync
    for peer, after in zip(peers, rows, strict=True):  # ... by averaging: a waited for b, slower to revert
        averaged = after[1]["syncs"]["averaged"] - after[0]["syncs"]["averaged"]
        assert averaged == 1 and after[1]["syncs"]["alone"] == after[0]["syncs"]["alone"], (peer.name, after[:2])
    assert "Reverted to outer step 2" in peers[0].log() and "Reverted to outer step 2" in peers[1].log()
