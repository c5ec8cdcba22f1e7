"""Byzantine peers in a real swarm (4 processes on 127.0.0.1, one of them corrupting what it sends): CenteredClip keeps
the honest peers on course, the plain mean does not, non-finite parts never reach anyone, and a forged progress
record does not move the collaborative step.

Each swarm runs once per module (`run_swarm` caches it); tests only inspect the records the peers left. To stay within
a few minutes, one CenteredClip run makes the attacks in turn, one per round of four; TRAHIV_TEST_EACH_ATTACK=1 runs one
swarm per attack instead (about 1 minute each on 2 cores)."""

from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hivemind
import pytest
from hivemind.dht.schema import RSASignatureValidator, SchemaValidator
from hivemind.optim.progress_tracker import LocalTrainingProgress, TrainingProgressSchema
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from swarm_helpers import Peer, start_bootstrap, start_peer

from trahiv.averaging.robust import WEIGHT_SLACK
from trahiv.protocol import progress_key, progress_prefix

pytestmark = pytest.mark.swarm

STEPS = 7
CLIP = {"name": "centered_clip", "tau": 0.02, "n_iters": 30}
MEAN = {"name": "mean"}
ATTACKS = {
    "scale": {"attack": "scale", "factor": 1e3},
    "nan": {"attack": "nan"},
    "sign_flip": {"attack": "sign_flip", "factor": 10.0},
    "noise": {"attack": "noise", "factor": 1.0},
}
TARGET = 64  # samples per collaborative step: 4 peers x 2 batches of 8
INFLATE_WEIGHT = {"attack": "inflate_weight", "factor": 1e3}  # flipped gradients claiming 1000x their samples
FORGED_EPOCH = 10**6
EACH_ATTACK = bool(os.environ.get("TRAHIV_TEST_EACH_ATTACK"))


@dataclass
class SwarmRun:
    honest: list[Peer]
    done: list[dict]
    byzantine: Peer | None

    def eval_losses(self) -> list[float]:
        return [done["eval_loss"] for done in self.done]


_runs: dict[tuple, SwarmRun] = {}


def run_swarm(tmp: Path, workdir: Path, aggregation: dict, attack: str | None = None, forge: bool = False) -> SwarmRun:
    """3 honest peers and a 4th (Byzantine with `attack`, "cycle" for all in turn and then flipped gradients with an
    inflated weight, each once, else honest) train STEPS collaborative steps with SGD (scale-sensitive, unlike Adam)."""
    key = (aggregation["name"], attack, forge)
    if key in _runs:
        return _runs[key]
    run_id = "_".join(str(part) for part in key)
    tmp.mkdir(parents=True, exist_ok=True)
    boot = start_bootstrap(tmp)
    common: dict[str, Any] = dict(
        workdir=str(workdir),
        run_id=run_id,
        target=TARGET,
        max_steps=STEPS,
        batch_size=8,
        optim="sgd",
        lr=0.5,
        scheduler="constant",
        eval_blocks=32,
        initial_peers=boot.initial_peers,
        opt={"min_peers": 4, "aggregation": aggregation},
    )
    try:
        honest = [start_peer(tmp, f"honest{i}", **common) for i in range(3)]
        byzantine = (
            [{**a, "min_group": 4} for a in [*ATTACKS.values(), INFLATE_WEIGHT]]  # none spent on a smaller group
            if attack == "cycle"
            else [ATTACKS["scale"], INFLATE_WEIGHT]
            if attack == "scale_and_inflate_weight"
            else ATTACKS[attack]
            if attack
            else None
        )
        # the cycle's attacks once each (rounds 1-5 of four peers), then honest: round after round, a swarm whose every
        # round held four peers made x1e3 again at step 6, one step before the end, and whether it did depended on
        # how many early rounds were smaller (a clean-clone run, 2026-11-28: eval loss +9%, every round complete)
        fourth = start_peer(tmp, "fourth", byzantine=byzantine, byzantine_once=attack == "cycle", **common)
        if forge:
            honest[0].wait_step(1)
            forge_progress_record(boot.initial_peers, run_id)
        done = [peer.finish() for peer in honest]
        done_fourth = fourth.finish(timeout=60) if attack is None else None
    finally:
        boot.stop()
        if attack is not None:
            fourth.process.kill()
    _runs[key] = SwarmRun(honest if attack else [*honest, fourth], done + ([done_fourth] if done_fourth else []),
                          fourth if attack else None)  # fmt: skip
    return _runs[key]


def forge_progress_record(initial_peers: list[str], run_id: str) -> None:
    """Store, under a fresh key, a progress record claiming the swarm is at step FORGED_EPOCH with a huge batch."""
    validator = RSASignatureValidator(RSAPrivateKey())
    dht = hivemind.DHT(
        initial_peers=initial_peers,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        nat_port_map=False,
        record_validators=[SchemaValidator(TrainingProgressSchema, prefix=progress_prefix(run_id)), validator],
        start=True,
    )
    try:
        record = LocalTrainingProgress(
            peer_id=dht.peer_id.to_bytes(),
            epoch=FORGED_EPOCH,
            samples_accumulated=10**9,
            samples_per_second=1e9,
            time=get_dht_time(),
            client_mode=False,
        )
        stored = dht.store(
            progress_key(run_id),
            subkey=validator.local_public_key,
            value=record.dict(),
            expiration_time=get_dht_time() + 300,
        )
        assert stored, "the forged record was not stored"
        time.sleep(3)  # long enough for every peer to fetch it
    finally:
        dht.shutdown()


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("byzantine")


@pytest.fixture(scope="module")
def baseline(tmp, workdir) -> SwarmRun:
    run = run_swarm(tmp / "baseline", workdir, MEAN)
    losses = run.eval_losses()
    assert max(losses) - min(losses) < 1e-4, losses  # every peer holds the same model
    assert losses[0] < run.done[0]["eval_loss_begin"] - 0.05, "the honest swarm did not learn: the test is void"
    return run


def assert_honest_and_close(run: SwarmRun, baseline: SwarmRun) -> None:
    """Finite weights, every step taken, and an eval loss close to the honest swarm's. SGD at lr 0.5 learns steadily
    here (at lr 1.0 the eval loss jumped up and down by 0.5 from step 4 on, and two honest swarms ended 7% apart):
    the bounds leave room for the rounds a peer misses, while the attacks they guard against end far away (x1000
    gradients with the mean: an eval loss in the thousands; NaN: no number)."""
    expected, start = baseline.eval_losses()[0], baseline.done[0]["eval_loss_begin"]
    for peer, done in zip(run.honest, run.done, strict=True):
        checksums = [row["checksum"] for row in peer.records("step")]
        assert checksums and all(math.isfinite(c) for c in checksums), f"{peer.name} held NaN/inf: {checksums}"
        assert done["global_step"] == STEPS
        assert done["eval_loss"] == pytest.approx(expected, rel=0.06), (done["eval_loss"], expected)
        assert start - done["eval_loss"] > 0.3 * (start - expected), "the honest peers barely learned"


def attacked_rounds(run: SwarmRun, attack: str | None = None) -> int:
    """Rounds the Byzantine peer corrupted (with `attack`) in a group of all 4 peers."""
    assert run.byzantine is not None
    path = run.byzantine.out / "attacks.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return sum(row["group_size"] == 4 and attack in (None, row["attack"]) for row in rows)


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_centered_clip_withstands_a_byzantine_peer(tmp, workdir, baseline, attack):
    run = run_swarm(
        tmp / f"clip_{attack if EACH_ATTACK else 'cycle'}", workdir, CLIP, attack if EACH_ATTACK else "cycle"
    )
    assert attacked_rounds(run, attack) >= 1, f"no round was averaged with {attack}: the test is void"
    assert_honest_and_close(run, baseline)


def test_the_mean_is_broken_by_a_scaled_gradient(tmp, workdir, baseline):
    # one swarm for this test and the next: the Byzantine peer alternates x1e3 gradients and inflated weights
    run = run_swarm(tmp / "mean_scale", workdir, MEAN, "scale_and_inflate_weight")
    assert attacked_rounds(run, "scale") >= 1
    loss, expected = run.eval_losses()[0], baseline.eval_losses()[0]
    assert not loss < 1.2 * expected, f"x1000 gradients did not hurt the mean ({loss} vs {expected})"


def test_nan_parts_excluded_with_the_mean_and_forged_progress_ignored(tmp, workdir, baseline):
    run = run_swarm(tmp / "mean_nan_forged", workdir, MEAN, "nan", forge=True)
    assert attacked_rounds(run) >= 2
    assert_honest_and_close(run, baseline)
    assert run.byzantine is not None
    byzantine_id = json.loads((run.byzantine.out / "ready.json").read_text())["peer_id"]
    for peer in run.honest:
        log = peer.log()
        excluded = set(re.findall(r"Excluding peer (\S+) from this averaging round: it sent non-finite", log))
        assert excluded == {byzantine_id}, f"NaN parts not reported by sender: {excluded}"
        assert "Ignoring the progress record" in log, "the forged record was never seen"
        steps = [row["epoch_after"] for row in peer.records("local")]
        assert max(steps) == STEPS and all(b - a in (0, 1) for a, b in zip(steps, steps[1:], strict=False)), steps


def test_an_inflated_weight_is_clamped_to_the_reported_samples(tmp, workdir, baseline):
    """A peer claiming 1000x the weight of its samples is clamped, by every honest reducer and in every such round, to
    what it reported (extrapolated at its reported rate, x1.25), and never above what a whole step holds (x1.25): here
    at most 81 for the 8,000 it claims. Its flipped gradient still counts with that weight in the plain mean: against
    that, CenteredClip (tested above)."""
    run = run_swarm(tmp / "mean_scale", workdir, MEAN, "scale_and_inflate_weight")
    assert attacked_rounds(run, "inflate_weight") >= 1
    assert run.byzantine is not None
    byzantine_id = json.loads((run.byzantine.out / "ready.json").read_text())["peer_id"]
    pattern = rf"Clamping the weight of peer {byzantine_id} from (\S+) to (\S+): more than the samples it reported"
    for peer, done in zip(run.honest, run.done, strict=True):
        clamps = [(float(a), float(b)) for a, b in re.findall(pattern, peer.log())]
        assert clamps, f"{peer.name} never clamped the inflated weight"
        for claimed, clamped in clamps:
            true_samples = claimed / INFLATE_WEIGHT["factor"]
            assert 0.5 * true_samples <= clamped <= WEIGHT_SLACK * TARGET + 1, (claimed, clamped)  # not 1000x
        assert done["global_step"] == STEPS
