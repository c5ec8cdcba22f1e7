"""The auxiliary peer in a DiLoCo swarm (trahiv.auxiliary.diloco): its checkpoints hold the outer parameters at an
outer step (those every trainer holds right after that sync), and its store shows each peer's outer step and bytes."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest
import torch
from swarm_helpers import start_peer, start_trahiv, stop, wait_for

from trahiv.auxiliary.checkpoints import (
    SwarmState,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    swarm_parameters,
)
from trahiv.auxiliary.store import MetricsStore, default_store_url

RUN = "diloco_aux"
INNER_STEPS = 4


def sha256(tensor: torch.Tensor) -> str:  # as tests/diloco_worker.py records the trainable tensors after each sync
    return hashlib.sha256(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def start_aux(tmp: Path, workdir: Path, name: str = "aux") -> tuple[subprocess.Popen, Path, list[str]]:
    """`trahiv aux` with the trainers' config (its `diloco` section), keeping a checkpoint of every outer step (in
    tmp/auxiliary, whatever its `name`: a restarted one serves the newest checkpoint there)."""
    out, addresses, log = tmp / "auxiliary", tmp / f"{name}-addresses.json", tmp / f"{name}.log"
    config = {"dht": {"nat_port_map": False}, "opt": {"run_id": RUN, "target_batch_size": 1},
              "diloco": {"inner_steps": INNER_STEPS}}  # fmt: skip
    argv = [
        "aux", "--config", json.dumps(config), "--output-dir", str(out),
        "--report-to", "none", "--addresses-file", str(addresses), "--period", "0.5",
        "--model", str(workdir / "model"), "--checkpoint-every", "1", "--keep-checkpoints", "10", "--state-poll", "0.5",
    ]  # fmt: skip
    process = start_trahiv(argv, log, tmp)

    def joined() -> list[str] | None:
        if process.poll() is not None:
            raise AssertionError(f"aux peer exited with {process.returncode}:\n{log.read_text()[-4000:]}")
        return json.loads(addresses.read_text()) if addresses.exists() and addresses.stat().st_size else None

    return process, out, wait_for(joined, 90, "the aux peer")


def test_keeper_sets_aside_outer_steps_after_a_revert(tmp_path):
    from transformers import GPT2LMHeadModel

    from trahiv.auxiliary.diloco import DiLoCoStateKeeper, momentum_metadata
    from trahiv.auxiliary.state import StateKeeperConfig
    from trahiv.demo import tiny_gpt2_config

    model = GPT2LMHeadModel(tiny_gpt2_config(n_layer=1, n_embd=32, n_head=2))
    params = [p.detach().clone() for _, p in swarm_parameters(model)]
    folder = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        state = SwarmState(step, [p + step for p in params], momentum_metadata(len(params)), params)
        save_checkpoint(folder, state, model, run_id=RUN, extra={"diloco": {"outer_step": step}})
    keeper = DiLoCoStateKeeper(StateKeeperConfig(model="unused", checkpoint_dir=str(folder)), model=model)
    keeper.held = 3

    class Mirror:  # what the keeper serves to joiners
        served: list = []

        def serve(self, state):
            self.served.append(state.step)

        def withdraw(self):
            self.served.append(None)

    keeper.diloco_mirror = Mirror()  # type: ignore[assignment]
    moved = keeper.apply_revert(revert_id=7, step=1)
    assert sorted(path.name for path in moved) == ["checkpoint-2", "checkpoint-3"]
    assert [path.name for path in list_checkpoints(folder)] == ["checkpoint-1"]
    assert keeper.held == 1  # the next checkpoint: outer step 2 of the reverted swarm
    assert Mirror.served == [1]  # no longer outer step 3
    assert (folder / "reverted-7" / "checkpoint-3" / "trahiv_state.json").exists()
    keeper.apply_revert(revert_id=8, step=0)
    assert Mirror.served == [1, None] and keeper.held is None
    keeper.diloco_mirror = None


def test_keeper_refuses_a_synchronous_swarms_checkpoint(tmp_path):
    from transformers import GPT2LMHeadModel

    from trahiv.auxiliary.diloco import DiLoCoStateKeeper
    from trahiv.auxiliary.state import StateKeeperConfig
    from trahiv.demo import tiny_gpt2_config

    model = GPT2LMHeadModel(tiny_gpt2_config(n_layer=1, n_embd=32, n_head=2))
    params = [p.detach().clone() for _, p in swarm_parameters(model)]
    folder = tmp_path / "checkpoints"
    metadata = [{"type": "tensor", "index": i} for i in range(len(params))]  # an optimizer state, not outer momenta
    save_checkpoint(folder, SwarmState(5, params, metadata, params), model, run_id=RUN)
    keeper = DiLoCoStateKeeper(StateKeeperConfig(model="unused", checkpoint_dir=str(folder)), model=model)
    with pytest.raises(ValueError, match="checkpoint-5 is a checkpoint of a synchronous swarm, not the outer state"):
        keeper.start_with(dht=None, run_id=RUN)


PEER = "12D3KooWCMqkmGbLW8rYCgpNaaVFH5xaVMaAx5wNVfYD7jZ3Z9D5"


def test_dashboard_shows_diloco_peers(tmp_path):
    import shutil
    import time

    from fastapi.testclient import TestClient
    from test_dashboard import Page, chromium

    from trahiv.auxiliary.dashboard import DashboardServer, create_app

    store = MetricsStore(default_store_url(tmp_path))
    row = {"outer_step": 7, "inner_done": 3, "inner_steps": 4, "steps_per_second": 2.0, "bytes_sent": 1234,
           "bytes_received": 5678, "last_seen": time.time()}  # fmt: skip
    store.upsert_diloco_peer(PEER, **row)
    store.upsert_diloco_peer(PEER, **{**row, "outer_step": 8})  # the latest record replaces the earlier one
    store.upsert_diloco_peer("Qm" + "a" * 44, **{**row, "outer_step": 2})
    answer = TestClient(create_app(store)).get("/api/diloco").json()
    assert answer["diloco"] is False  # (the mode is set by the DiLoCoMonitor: from the config or the first record)
    assert [(r["peer_id"], r["outer_step"]) for r in answer["peers"]] == [(PEER, 8), ("Qm" + "a" * 44, 2)]
    store.set_meta("mode", "diloco")
    for step in (1, 2):  # the trainers' metrics records, one per outer step
        store.add_step(step=step, time=time.time() - 60 * (2 - step), loss=5.0, active_peers=2, samples_per_second=9.0,
                       samples=32)  # fmt: skip
    if shutil.which("chromium") is None:
        return
    with DashboardServer(store, port=0, refresh_seconds=1.0) as server:
        done = chromium(server.url, tmp_path, "--dump-dom")
    assert done.returncode == 0, done.stderr[-2000:]
    page = Page(done.stdout)
    assert page.by_id["diloco-board"]["attrs"].get("hidden") is None
    # the swarm's steps are outer steps (its metrics records, max_steps): the page says so
    assert page.text("step-label") == "Outer step", page.text("step-label")
    assert page.text("empty").startswith("No outer step recorded yet"), page.text("empty")  # (hidden: 2 steps)
    assert page.text("step") == "2" and page.text("step-rate") == "60.0 outer steps/h", page.text("step-rate")
    text = page.text("diloco")  # (the cells' texts, concatenated): the newest outer step first
    first = f"peer …{PEER[-8:]}" + "8" + "3 / 4" + "1.2 kB" + "5.7 kB"
    assert first in text and text.index(first) < text.index("peer …aaaaaaaa2"), text
    store.close()


def test_a_stopped_monitor_reads_the_progress_records_once_more():
    """Each trainer's last DiLoCo record (published as it leaves) reaches the store when the aux peer is stopped right
    after the trainers, as `trahiv demo --diloco` stops it: stop() reads the records once more."""
    import concurrent.futures
    import time
    from types import SimpleNamespace

    from hivemind.p2p import PeerID

    from trahiv.auxiliary.diloco import DiLoCoMonitor

    now = time.time()
    last = {"peer_id": PeerID.from_base58(PEER).to_bytes(), "outer_step": 2, "inner_done": 0, "inner_steps": 4,
            "samples_accumulated": 0, "steps_per_second": 1.0, "time": now, "started": now - 10,
            "averaging_bytes_sent": 1234, "averaging_bytes_received": 5678}  # fmt: skip

    class ProgressDHT:
        records: dict = {}

        def get(self, key: str, latest: bool = False, return_future: bool = False) -> concurrent.futures.Future:
            future: concurrent.futures.Future = concurrent.futures.Future()
            entries = {subkey: SimpleNamespace(value=value) for subkey, value in self.records.items()}
            future.set_result(SimpleNamespace(value=entries) if entries else None)
            return future

    store, dht = MetricsStore("sqlite://"), ProgressDHT()
    monitor = DiLoCoMonitor(dht, RUN, store, period=3600.0, diloco=True).start()  # (it reads every hour)
    dht.records = {b"a": last}
    monitor.stop()
    rows = [(r["peer_id"], r["outer_step"], r["bytes_sent"], r["bytes_received"]) for r in store.diloco_peers()]
    assert rows == [(PEER, 2, 1234, 5678)]
    store.close()


@pytest.mark.swarm
def test_aux_checkpoints_outer_parameters_and_shows_outer_steps_and_bytes(tmp_path, workdir):
    aux, out, initial_peers = start_aux(tmp_path, workdir)
    store = MetricsStore(default_store_url(out))
    common = {"workdir": str(workdir), "run_id": RUN, "initial_peers": initial_peers, "batch_size": 2,
              "inner_steps": INNER_STEPS, "max_steps": 3 * INNER_STEPS, "sleep_per_step": 0.2,
              "diloco": {"compression": "none"}, "opt": {"min_peers": 2}}  # fmt: skip
    peers = [start_peer(tmp_path, name, worker="diloco_worker.py", **common) for name in ("a", "b")]
    try:
        dones = [peer.finish(timeout=150) for peer in peers]
        ids = [json.loads((peer.out / "ready.json").read_text())["peer_id"] for peer in peers]
        sent = {peer_id: done["metrics"]["averaging_bytes_sent"] for peer_id, done in zip(ids, dones, strict=True)}

        def final_rows() -> list[dict] | None:  # each peer's last progress record (published as it leaves)
            rows = {row["peer_id"]: row for row in store.diloco_peers()}
            done = [rows.get(peer_id) for peer_id in ids]
            return done if all(r is not None and r["bytes_sent"] == sent[r["peer_id"]] for r in done) else None

        rows = wait_for(final_rows, 30, "the peers' last DiLoCo records in the aux peer's store")

        def outer_steps() -> list[dict] | None:  # the loss curve: one step per outer step, both peers' inner samples
            steps = store.steps()
            whole = [s for s in steps if s["samples"] == 2 * INNER_STEPS * common["batch_size"]]
            return steps if len(whole) == 3 else None

        steps = wait_for(outer_steps, 30, "a metrics step per outer step in the aux peer's store")
        saved = list_checkpoints(out / "checkpoints")
    finally:
        for peer in peers:
            stop(peer.process)
        stop(aux)
    log = (tmp_path / "aux.log").read_text()
    assert aux.returncode == 0, log[-3000:]
    assert store.meta().get("mode") == "diloco"
    assert [(s["step"], s["active_peers"]) for s in steps] == [(1, 2), (2, 2), (3, 2)], steps
    assert all(s["loss"] is not None and 0 < s["loss"] < 20 for s in steps), steps
    for row, done in zip(rows, dones, strict=True):
        assert row["outer_step"] == done["outer_step"] == 3, (row, done)
        assert row["bytes_sent"] > 0 and row["bytes_received"] == done["metrics"]["averaging_bytes_received"], row
    store.close()

    assert saved, f"no checkpoint:\n{log[-3000:]}"
    syncs = [{r["outer_step"]: r["sha256"] for r in peer.records("sync")} for peer in peers]
    for path in saved:
        checkpoint = load_checkpoint(path)
        outer = checkpoint.step
        assert path.name == f"checkpoint-{outer}" and 1 <= outer <= 3, path
        assert checkpoint.diloco == {"outer_step": outer, "inner_steps": INNER_STEPS, "global_step": outer * 4}
        weights = {name: sha256(t) for name, t in checkpoint.model_state_dict().items()}
        for sync in syncs:  # the outer parameters every trainer copied into its model right after that sync
            assert weights == sync[outer], (path, [n for n in weights if weights[n] != sync[outer].get(n)])
        momenta = checkpoint.optimizer_state["tensors"]
        assert len(momenta) == len(weights) and any(bool(m.abs().sum() > 0) for m in momenta)

    # The whole swarm stopped. Restarted on the same checkpoint directory, the aux peer serves its newest checkpoint,
    # and a trainer started afterwards with its usual script continues from it: that outer step, those outer
    # parameters, the inner step count and LR schedule at outer step x H.
    newest = load_checkpoint(latest_checkpoint(out / "checkpoints"))
    aux, _, initial_peers = start_aux(tmp_path, workdir, name="aux-restarted")
    peer = start_peer(tmp_path, "c", worker="diloco_worker.py", **{**common, "initial_peers": initial_peers,
                      "max_steps": (newest.step + 1) * INNER_STEPS, "opt": {"min_peers": 1}})  # fmt: skip
    try:
        done = peer.finish(timeout=150)
    finally:
        stop(peer.process)
        stop(aux)
    log = (tmp_path / "aux-restarted.log").read_text()
    assert f"(DiLoCo outer step {newest.step}) to peers that join" in log, log[-3000:]
    first = peer.records("sync")[0]
    assert (first["outer_step"], first["global_step"]) == (newest.step, newest.step * INNER_STEPS), first
    weights = {name: sha256(t) for name, t in newest.model_state_dict().items()}
    assert first["outer_sha256"] == first["sha256"] == weights, "the trainer did not start from the checkpoint"
    assert done["outer_step"] == newest.step + 1, done
    assert "starting from it" in peer.log(), peer.log()[-3000:]
