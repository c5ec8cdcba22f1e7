"""Peers training together as real processes on 127.0.0.1."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
from swarm_helpers import Peer, samples_per_epoch, start_bootstrap, start_peer

pytestmark = pytest.mark.swarm


def test_two_peers_train_together(tmp_path, workdir):
    """Different batch sizes, one peer in client mode: the swarm steps after target_batch_size samples in total, all
    peers hold the same parameters, bit for bit, after every collaborative step, and the loss goes down. (With
    hivemind's all-reduce each peer added its own rounding of the average's difference: GPT-2's weights differed in
    the last bits after every step.)"""

    def scenario(tmp: Path) -> tuple[Peer, Peer, dict, dict]:
        tmp.mkdir()
        boot = start_bootstrap(tmp)
        common = dict(
            workdir=str(workdir),
            run_id="together",
            target=64,
            max_steps=5,
            initial_peers=boot.initial_peers,
            opt={"min_peers": 2},
        )
        try:
            a = start_peer(tmp, "a", batch_size=8, **common)
            b = start_peer(tmp, "b", batch_size=4, dht={"client_mode": True}, **common)
            return a, b, a.finish(), b.finish()
        finally:
            boot.stop()

    a, b, done_a, done_b = scenario(tmp_path / "run")
    assert done_a["global_step"] == done_b["global_step"] == 5
    totals = samples_per_epoch([a, b])
    for step in range(5):
        assert totals[step] >= 64, f"step {step} advanced after only {totals[step]} samples: {totals}"
    params_a, params_b = a.params_at(), b.params_at()
    for step in range(1, 6):
        assert params_a[step]["digest"] == params_b[step]["digest"], step
    losses = [r["loss"] for r in a.records("log")]
    assert losses[-1] < losses[0] - 0.1, losses
    assert done_a["samples_contributed"] > 0 and done_b["samples_contributed"] > 0
    assert "To join the training, use initial_peers = ['/ip4/127.0.0.1/tcp/" in a.log()
    assert "Peer joined the swarm" in a.log() and "Peer joined the swarm" in b.log()
    assert "'swarm_peers': 2" in a.log(), "the Trainer's logs should count both peers"


def test_contributions_weighted_by_samples(tmp_path, workdir):
    """Each peer's gradient is constant (+1 here, -1 there): the averaged SGD update equals the sample-weighted mean,
    with parameter averaging after every step (hivemind 1.1.12's delayed parameter averaging fails this test)."""
    boot = start_bootstrap(tmp_path)
    common = dict(
        workdir=str(workdir),
        run_id="weights",
        target=200,
        max_steps=2,
        initial_peers=boot.initial_peers,
        sleep_per_step=0.2,
        opt={"min_peers": 2, "average_state_every": 1},
    )
    try:
        a = start_peer(tmp_path, "a", batch_size=8, toy_grad=1.0, **common)
        b = start_peer(tmp_path, "b", batch_size=2, toy_grad=-1.0, **common)
        a.finish(), b.finish()
    finally:
        boot.stop()
    for step in (1, 2):
        weights = {}
        for name, peer in (("a", a), ("b", b)):
            rows = [r for r in peer.records("local") if r["epoch_before"] == step - 1]
            weights[name] = rows[-1]["pre_samples"] + rows[-1]["batch"]  # samples accumulated when averaging
        expected_delta = -(weights["a"] * 1.0 + weights["b"] * -1.0) / (weights["a"] + weights["b"])
        before = a.params_at().get(step - 1, {"values": [0.0] * 4})["values"] if step > 1 else [0.0] * 4
        for peer in (a, b):
            after = peer.params_at()[step]["values"]
            assert after == pytest.approx([v + expected_delta for v in before], abs=1e-5), (step, weights)
    assert weights["a"] > 2 * weights["b"]  # the faster-batching peer really contributed more


def test_peers_that_cannot_average_step_with_their_own_gradients(tmp_path, workdir):
    """Two trainers in client mode cannot form a group (neither accepts connections): every round fails, is counted
    as failed, and each peer steps with its own gradients (+1 here, -1 there). hivemind 1.1.12 stepped with zeros
    (its accumulators were reset before the round), so the parameters never moved."""
    boot = start_bootstrap(tmp_path)
    common = dict(
        workdir=str(workdir),
        run_id="unreachable",
        target=16,
        max_steps=3,
        initial_peers=boot.initial_peers,
        mm=1.0,
        dht={"client_mode": True},
        opt={"min_peers": 2, "averaging_timeout": 4.0, "average_state_every": 100},
    )
    try:
        a = start_peer(tmp_path, "a", batch_size=4, toy_grad=1.0, **common)
        b = start_peer(tmp_path, "b", batch_size=4, toy_grad=-1.0, **common)
        done_a, done_b = a.finish(), b.finish()
    finally:
        boot.stop()
    for peer, done, grad in ((a, done_a, 1.0), (b, done_b, -1.0)):
        assert done["global_step"] == 3
        for step in (1, 2, 3):  # SGD, lr 1: each failed round moves the weights by -1 x this peer's gradient
            assert peer.params_at()[step]["values"] == pytest.approx([-grad * step] * 4), (peer.name, step)
        # (a peer whose groupmate finished first and left stops its last search then: cancelled, not failed)
        cancelled = peer.log().count("no other peer is left to average with")
        assert done["averaging_rounds"]["failed"] + cancelled >= 3 and done["averaging_rounds"]["complete"] == 0, done
        assert "Proceeding with local gradients" in peer.log()
        assert "Traceback" not in peer.log(), "a round without a group is no error"


def test_a_step_costs_its_compute_not_the_matchmaking_time_and_takes_the_target(tmp_path, workdir):
    """Two peers of equal speed, matchmaking_time 30 s, target 16 = 2 local steps of both. The group forms as soon as
    both peers joined it (hivemind 1.1.12's leader waited out the 30 s it declared: every step took 30 s), every round
    is complete, and each step took exactly the target: each peer computed its share and waited for the other's
    report (with hivemind each computed on until it saw the target: 2-4x the target per step)."""
    boot = start_bootstrap(tmp_path)
    common = dict(
        workdir=str(workdir), run_id="prompt", target=16, max_steps=4, batch_size=4, mm=30.0,
        initial_peers=boot.initial_peers, opt={"min_peers": 2, "averaging_timeout": 60.0},
    )  # fmt: skip
    try:
        a, b = start_peer(tmp_path, "a", **common), start_peer(tmp_path, "b", **common)
        done_a, done_b = a.finish(), b.finish()
    finally:
        boot.stop()
    assert done_a["global_step"] == done_b["global_step"] == 4
    for done in (done_a, done_b):
        assert done["averaging_rounds"]["complete"] >= 4 and done["averaging_rounds"]["failed"] == 0, done
    times = [row["t"] for peer in (a, b) for row in peer.records("local")]
    assert max(times) - min(times) < 30.0, "4 steps took longer than one matchmaking_time"
    assert samples_per_epoch([a, b]) == {step: 16 for step in range(4)}
    assert a.params_at()[4]["digest"] == b.params_at()[4]["digest"]


@pytest.mark.parametrize("busy_core", [False, True], ids=["idle", "one-core-busy"])
def test_fast_steps_keep_two_peers_in_step(tmp_path, workdir, busy_core):
    """The run_clm.py case: 2 peers, local steps of a few tens of ms, target_batch_size reached in 2 local steps of
    both peers, min_peers 2 (optionally with another process keeping a core busy). Both peers hold identical parameters
    after every collaborative step, every gradient round is complete, and neither steps alone."""
    boot = start_bootstrap(tmp_path)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy_core else None
    common = dict(
        workdir=str(workdir), run_id="fast", target=16, max_steps=8, batch_size=4, initial_peers=boot.initial_peers
    )
    try:
        a = start_peer(tmp_path, "a", opt={"min_peers": 2}, **common)
        b = start_peer(tmp_path, "b", opt={"min_peers": 2}, **common)
        done_a, done_b = a.finish(), b.finish()
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
        boot.stop()
    assert done_a["global_step"] == done_b["global_step"] == 8
    params_a, params_b = a.params_at(), b.params_at()
    differ = [s for s in range(1, 9) if params_a[s]["checksum"] != pytest.approx(params_b[s]["checksum"], rel=1e-6)]
    assert differ == [], f"peers differ after steps {differ}"
    for done in (done_a, done_b):
        assert done["averaging_rounds"]["failed"] == done["averaging_rounds"]["partial"] == 0, done
    for peer in (a, b):
        assert "Skipped averaging: there are no other peers" not in peer.log(), "a peer stepped alone"


def test_peers_that_start_together_start_from_the_weights_of_the_first_ready(tmp_path, workdir):
    """Three peers start a swarm together, a and b with the same weights, c with weights of its own. The peer that was
    ready first keeps its weights; a peer with the same weights downloads nothing; any other downloads the first
    one's state (each used to download some peer's state, whichever served the highest priority, at once). All three
    hold the same parameters after every step."""
    boot = start_bootstrap(tmp_path)
    common = dict(
        workdir=str(workdir), run_id="together", target=24, max_steps=3, batch_size=4,
        initial_peers=boot.initial_peers, opt={"min_peers": 3},
    )  # fmt: skip
    try:
        peers = [start_peer(tmp_path, name, **common, **extra) for name, extra in (("a", {}), ("b", {}), ("c", {
            "init_seed": 7}))]  # fmt: skip
        for peer in peers:
            peer.finish()
    finally:
        boot.stop()
    ids = {peer.name: json.loads((peer.out / "ready.json").read_text())["peer_id"] for peer in peers}
    keeps = [peer.name for peer in peers if "starts from this peer's weights" in peer.log()]
    assert len(keeps) == 1, keeps
    first = ids[keeps[0]]
    for peer in peers:
        log = peer.log()
        assert "downloading its state before training" not in log, peer.name
        if peer.name == keeps[0]:
            continue
        same = f"the weights of peer {first} (ready first), the same as this peer's" in log
        loaded = f"starting from the weights of peer {first}" in log
        same_weights = {peer.name, keeps[0]} == {"a", "b"}
        assert (same, loaded) == (same_weights, not same_weights), (peer.name, keeps[0], log[-2000:])
    began = {peer.name: peer.records("begin")[0]["digest"] for peer in peers}  # as each began training
    assert len(set(began.values())) == 1, began
    for step in range(1, 4):
        digests = {peer.name: peer.wait_params(step)["digest"] for peer in peers}
        assert len(set(digests.values())) == 1, (step, digests)


def run_background_pair(
    tmp_path: Path,
    workdir: Path,
    *,
    run_id: str,
    max_steps: int,
    sleep_per_step: float,
    busy_core: bool = False,
    **spec: Any,
) -> tuple[list[Peer], list[dict]]:
    """Two peers in background mode (delay_optimizer_step + delay_grad_averaging), constant gradient +1, SGD with lr
    1, target 16 = 2 batches of 4 each, optionally with another process keeping a core busy. Returns the peers and
    what each reported at the end."""
    boot = start_bootstrap(tmp_path)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy_core else None
    common = dict(
        workdir=str(workdir), run_id=run_id, target=16, max_steps=max_steps, batch_size=4,
        sleep_per_step=sleep_per_step, initial_peers=boot.initial_peers, toy_grad=1.0,
        opt={"min_peers": 2, "delay_optimizer_step": True, "delay_grad_averaging": True, "average_state_every": 1000},
        **spec,
    )  # fmt: skip
    try:
        peers = [start_peer(tmp_path, name, **common) for name in "ab"]
        done = [peer.finish() for peer in peers]
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
        boot.stop()
    return peers, done


def test_background_mode_ends_with_every_step_applied(tmp_path, workdir):
    """Background mode (delay_optimizer_step + delay_grad_averaging): the optimizer step of a collaborative step runs
    in the background. When training ends, the model holds every step's update: constant gradient +1 on both peers,
    SGD with lr 1, 6 steps: the parameters are -6, not -5 (the last update still in flight), already as training
    ends (the callbacks' `on_train_end`), before the peer leaves the swarm: hivemind applied it only as it shut down,
    and `train()` returned without it when leaving took longer than the swarm's shutdown waited for. A checkpoint
    holds its step's own weights (save_steps 3: -3 and -6; hivemind would have saved the weights of the step before,
    the update still in flight). Every round is complete, and no peer warns that it averaged with nobody (the warning
    counted a step whose round was still running in the background as a step without averaging: all peers warned
    after 3 steps, naming a NAT or firewall)."""
    peers, finished = run_background_pair(
        tmp_path, workdir, run_id="background", max_steps=6, sleep_per_step=0.5, save_steps=3
    )
    for peer, done in zip(peers, finished, strict=True):
        assert done["global_step"] == 6
        assert done["values"] == pytest.approx([-6.0] * 4, abs=1e-5), done
        assert done["averaging_rounds"]["complete"] == 6, done
        end = peer.records("end")
        assert [row["step"] for row in end] == [6] and end[0]["values"] == pytest.approx([-6.0] * 4), end
        for step in (3, 6):
            saved = safetensors.torch.load_file(peer.out / "output" / f"checkpoint-{step}" / "model.safetensors")
            assert saved["w"].tolist() == pytest.approx([-float(step)] * 4), (peer.name, step, saved["w"])
    for peer in peers:  # the rounds end in the background, after their steps: they were not silent
        assert "has not averaged with anyone" not in peer.log(), peer.name


@pytest.mark.parametrize("busy_core", [False, True], ids=["idle", "one-core-busy"])
def test_background_mode_with_fast_steps_keeps_every_round_whole(tmp_path, workdir, busy_core):
    """Background mode, 2 peers, 0.05 s local steps, target 16 = 2 batches of 4 each, 8 steps (optionally with
    another process keeping a core busy). Each step's round runs while the next step computes, so a peer's round of
    step k ends while its group for step k + 1 awaits its trigger; a groupmate that triggered first sent its parts
    then, and they were turned away (BAD_GROUP_ID, engine fix 11): partial rounds, and the two peers apart from then
    on (beside a busy core 5 of 8 runs before the fix, 3 of them hung at exit). Every round is complete and every
    update applied (constant gradients: the parameters are exactly -8)."""
    _, finished = run_background_pair(
        tmp_path, workdir, run_id="fastbg", max_steps=8, sleep_per_step=0.05, busy_core=busy_core
    )
    for done in finished:
        assert done["global_step"] == 8
        assert done["values"] == pytest.approx([-8.0] * 4, abs=1e-5), done
        assert done["averaging_rounds"] == {"complete": 8, "partial": 0, "failed": 0}, done


def test_the_last_batch_of_a_step_is_announced_as_it_begins(tmp_path, workdir):
    """Background mode, 2 peers of equal speed (0.8 s a local step), target 16 = 2 batches of 4 each; peer a stalls
    1 s as step 2 begins (a fault at a named step), so b computes its share first and waits. a publishes the samples
    of its last batch of the step as that batch begins (SwarmProgressTracker.promise; so does a peer that fills a step
    that the peers' rounded shares left short): b leaves the step while a is still computing it, instead of waiting
    for a's final report (a report's trip, 0.1-0.5 s, lost by every waiting peer at every step). Every step takes
    exactly the target, every round is complete and every update applied (constant gradients: the parameters are
    exactly -4)."""
    sleep = 0.8
    boot = start_bootstrap(tmp_path)
    common = dict(
        workdir=str(workdir), run_id="promise", target=16, max_steps=4, batch_size=4, sleep_per_step=sleep,
        initial_peers=boot.initial_peers, toy_grad=1.0,
        opt={"min_peers": 2, "delay_optimizer_step": True, "delay_grad_averaging": True, "average_state_every": 1000},
    )  # fmt: skip
    try:
        a = start_peer(tmp_path, "a", faults=[{"kind": "stall", "at_step": 2, "seconds": 1.0}], **common)
        b = start_peer(tmp_path, "b", **common)
        done_a, done_b = a.finish(), b.finish()
    finally:
        boot.stop()
    for done in (done_a, done_b):
        assert done["global_step"] == 4
        assert done["values"] == pytest.approx([-4.0] * 4, abs=1e-5), done
        assert done["averaging_rounds"]["complete"] == 4, done
    assert samples_per_epoch([a, b]) == {step: 16 for step in range(4)}
    # each peer's last batch of step 2 was computed when that step() began, and its step() returned `sleep` before
    # its record. The peer whose last batch ended last (usually a, stalled; b when a's share, as the rates read, was
    # larger and b filled the step: `fills_shortfall`) announced that batch as it began, so the other left step 2
    # before it ended. Unannounced, the other waited for its final report: 0.13 s after that batch's end, when a
    # filled the step (once, before a filling batch was announced)
    [last, other] = sorted(
        ([row for row in peer.records("local") if row["epoch_before"] == 2 and row["epoch_after"] == 3][0]
         for peer in (a, b)),
        key=lambda row: -row["began"],
    )  # fmt: skip
    assert other["t"] - sleep < last["began"], (other, last)


PROGRESS_SLOW_S = 3.0  # seconds between a's reads of the swarm's progress while it waits at its share (default 0.1)


def run_told_pair(tmp_path: Path, workdir: Path, *, tells: bool) -> tuple[Peer, Peer, list[dict], dict[int, float]]:
    """Two peers of equal speed (0.3 s a local step), target 8 = one batch of 4 each, 4 steps; b stalls 1 s as step 3
    begins (a fault at a named step), so a computes its share first and waits for b's report, reading the swarm's
    progress only every PROGRESS_SLOW_S. Rounds are declared for 8 s (`matchmaking_time`), so that b's search outlasts
    a's wait: declared for 2 s, b's round failed once in two runs of the control, and b computed past its share.
    `tells=False`: b does not tell its groupmates as its round begins (an older peer). Returns both peers, their
    done.json, and how long a's local step that ended each step took, its compute left out: its wait at its share,
    then the round."""
    boot = start_bootstrap(tmp_path)
    common = dict(
        workdir=str(workdir), run_id="told", target=8, max_steps=4, batch_size=4, toy_grad=1.0, sleep_per_step=0.3,
        initial_peers=boot.initial_peers, mm=8.0, opt={"min_peers": 2, "average_state_every": 1000},
    )  # fmt: skip
    try:
        a = start_peer(tmp_path, "a", progress_recheck_s=PROGRESS_SLOW_S, **common)
        b = start_peer(tmp_path, "b", tells=tells, faults=[{"kind": "stall", "at_step": 3, "seconds": 1.0}], **common)
        dones = [a.finish(), b.finish()]
    finally:
        boot.stop()
    ended = [row for row in a.records("local") if row["epoch_after"] > row["epoch_before"]]
    return a, b, dones, {row["epoch_before"]: row["t"] - row["began"] - common["sleep_per_step"] for row in ended}


def test_a_peer_waiting_at_its_share_begins_the_round_as_a_groupmate_begins_it(tmp_path, workdir):
    """trahiv.engine.tell: b, stalled, computes its share of step 3 last and begins the step's round as its report
    completes the step; it tells a, which waits at its share and begins at once (about 1 s after it began to wait),
    not at its next read of the progress, PROGRESS_SLOW_S after it began to wait. Every step takes exactly the target
    and both peers end at the same values."""
    a, b, dones, waited = run_told_pair(tmp_path, workdir, tells=True)
    assert waited[3] < PROGRESS_SLOW_S - 1.0, waited
    for done in dones:
        assert done["global_step"] == 4, done
        assert done["values"] == pytest.approx([-4.0] * 4, abs=1e-5), done
    assert samples_per_epoch([a, b]) == {step: 8 for step in range(4)}


def test_a_peer_not_told_waits_for_its_next_read_of_the_progress(tmp_path, workdir):
    """The control: b does not tell (as a peer before trahiv.engine.tell). a learns that step 3 is complete only at
    its next read of the progress, PROGRESS_SLOW_S after it began to wait (b's round waits for a meanwhile)."""
    _, _, dones, waited = run_told_pair(tmp_path, workdir, tells=False)
    assert waited[3] > PROGRESS_SLOW_S - 0.5, waited
    assert all(done["global_step"] == 4 for done in dones), dones
