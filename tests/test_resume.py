"""Checkpoints hold the collaborative step; resuming continues from it with the same schedule."""

from __future__ import annotations

import json

import pytest
from swarm_helpers import start_peer

pytestmark = pytest.mark.swarm


def test_resume_restores_collaborative_step(tmp_path, workdir):
    first = start_peer(
        tmp_path, "first", workdir=str(workdir), run_id="resume1", target=16, max_steps=4, batch_size=8, save_steps=2
    )
    assert first.finish()["global_step"] == 4
    checkpoint = first.out / "output" / "checkpoint-4"
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["global_step"] == 4
    assert (checkpoint / "optimizer.pt").exists() and (checkpoint / "scheduler.pt").exists()

    second = start_peer(
        tmp_path,
        "second",
        workdir=str(workdir),
        run_id="resume2",
        target=16,
        max_steps=8,
        batch_size=8,
        resume=str(checkpoint),
    )
    done = second.finish()
    assert second.records("begin")[0]["step"] == 4, "did not resume at the checkpoint's collaborative step"
    assert second.records("begin")[0]["checksum"] == pytest.approx(first.params_at()[4]["checksum"], rel=1e-9)
    assert done["global_step"] == 8
    steps = [row["epoch_after"] for row in second.records("local")]
    assert steps[0] in (4, 5) and steps[-1] == 8
    # the linear schedule (1 warmup step, peak 3e-3) runs per collaborative step, across the restart
    for run, max_steps in ((first, 4), (second, 8)):
        for row in run.records("log"):
            expected = 3e-3 * (max_steps - row["step"]) / (max_steps - 1)
            assert row["lr"] == pytest.approx(expected, rel=1e-6, abs=1e-12), (max_steps, row)
