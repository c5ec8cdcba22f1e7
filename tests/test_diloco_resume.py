"""DiLoCo mode (trahiv.diloco) across a restart: peers saved with the Trainer's save_strategy and restarted with
resume_from_checkpoint continue at the same inner and outer step, with the same outer parameters, outer momenta,
inner optimizer state and (half-way) inner parameters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from swarm_helpers import Peer, start_bootstrap, start_peer, stop

pytestmark = pytest.mark.swarm


def start_diloco_peer(tmp: Path, name: str, **spec: Any) -> Peer:
    return start_peer(tmp, name, worker="diloco_worker.py", **spec)


def state_record(peer: Peer, at: str) -> dict:
    records = [r for r in peer.records("state") if r["at"] == at]
    assert records, f"peer {peer.name} wrote no state record at {at}:\n{peer.log()[-3000:]}"
    return records[-1]


def run_swarm(tmp: Path, resume: dict[str, str] | None = None, **common: Any) -> tuple[list[Peer], list[dict]]:
    """Peers a and b (from `resume[name]` if given) until they finish."""
    tmp.mkdir()
    peers = []
    try:
        for name in ("a", "b"):
            spec = {**common, "resume": resume[name]} if resume else common
            peers.append(start_diloco_peer(tmp, name, **spec))
        dones = [peer.finish(timeout=150) for peer in peers]
    finally:
        for peer in peers:
            stop(peer.process)
    return peers, dones


def test_resume_continues_at_the_same_inner_and_outer_step(tmp_path, workdir):
    """Two peers, H=4: one sync at inner step 4, a checkpoint at inner step 6 (outer step 1, 2 inner steps into the
    second round). Both stop, and restart from their checkpoints up to inner step 12: each begins with exactly the
    state it saved (outer parameters, momenta, model, inner optimizer), then they sync together at 8 and 12."""
    boot = start_bootstrap(tmp_path)
    common = {"workdir": str(workdir), "run_id": "diloco_resume", "batch_size": 2, "inner_steps": 4,
              "initial_peers": boot.initial_peers, "diloco": {"compression": "none"},
              "opt": {"min_peers": 2}}  # fmt: skip
    try:
        first, first_dones = run_swarm(tmp_path / "first", max_steps=6, save_steps=6, **common)
        for done in first_dones:
            assert done["global_step"] == 6 and done["outer_step"] == 1 and done["syncs"]["averaged"] == 1, done
        resume = {peer.name: str(peer.out / "output" / "checkpoint-6") for peer in first}
        # the same DHT: the first run's last progress records are still there (expiring) and must not matter
        second, dones = run_swarm(tmp_path / "second", resume, max_steps=12, **common)
    finally:
        boot.stop()

    for before, after, done in zip(first, second, dones, strict=True):
        saved, begin = state_record(before, "save"), state_record(after, "begin")
        assert (saved["global_step"], saved["outer_step"], saved["inner_done"]) == (6, 1, 2), saved
        assert saved["momenta_norm"] > 0, saved  # the first sync's pseudo-gradient is in the momenta
        for key in ("global_step", "outer_step", "inner_done", "outer_params", "momenta", "model", "inner_state"):
            assert begin[key] == saved[key], (after.name, key, saved, begin)
        assert saved["model"] != saved["outer_params"]  # half-way inner parameters, not the outer ones
        assert done["global_step"] == 12 and done["outer_step"] == 3, done
        assert done["syncs"] == {"averaged": 2, "alone": 0, "failed": 0, "missed": 0, "diverged": 0}, done
    syncs = [{r["outer_step"]: r["sha256"] for r in peer.records("sync")} for peer in second]
    assert syncs[0][2] == syncs[1][2] and syncs[0][3] == syncs[1][3]  # identical right after both syncs
