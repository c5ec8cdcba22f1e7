"""The swarm protocol's decisions, as pure functions (no engine, no DHT): which progress records to trust, when a peer
has missed the swarm's round, how many peers are ready to train, how many samples each peer computes per step.
trahiv.engine.optimizer and trahiv.swarm act on them;
tests/test_protocol.py checks them in one process."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch

__all__ = [
    "WIRE_PROTOCOL",
    "Contribution",
    "expected_in_round",
    "fills_shortfall",
    "missed_round",
    "own_share_done",
    "peer_tiebreak",
    "progress_key",
    "progress_prefix",
    "ready_peers",
    "record_protocol",
    "seconds_to_target",
    "share_done",
    "share_of_target",
    "silent_too_long",
    "state_priority",
    "stopped_at_share",
    "tensors_digest",
    "trusted_epoch",
]

# The version of what trahiv peers tell each other, bumped whenever a peer of this trahiv could not train with one of
# the version before: 1 = gradient rounds return the aggregate itself (not hivemind's difference from the sender's
# values), robust reducers, the ring all-reduce; 2 = progress records under a key of their version
# (`progress_prefix`). Peers of different versions (and plain hivemind peers) never share a group: it is folded into
# every trahiv averager's schema hash, which hivemind's leaders compare with each join request's
# (trahiv.engine.averagers.VersionedSchema); they never count each other's samples (`progress_prefix`); a peer that
# finds the swarm's peers on another version refuses to start (trahiv.swarm.Swarm.check_model, from the version in
# their model records).
WIRE_PROTOCOL = 2


def record_protocol(record: dict) -> int:
    """The wire protocol a peer's model record announces (0: a trahiv from before the version was announced)."""
    return int(record.get("protocol", 0))


def progress_prefix(run_id: str) -> str:
    """The prefix of a swarm's progress records, one per wire protocol: hivemind's tracker keeps them under
    `{prefix}_progress` (its schema validator forbids any field of its own, so the version cannot travel inside a
    record), DiLoCo's under `{prefix}_diloco_progress`. Each step's target counts the samples of the records a peer
    reads, so a peer of another protocol (a plain hivemind peer under `{run_id}_progress`, a trahiv of another
    version), whose samples are in none of this swarm's rounds, must be in none of its views either."""
    return f"{run_id}_wire{WIRE_PROTOCOL}"


def progress_key(run_id: str, *, diloco: bool = False) -> str:
    """The DHT key of the progress records of this wire protocol's peers (`progress_prefix`)."""
    return f"{progress_prefix(run_id)}_{'diloco_' if diloco else ''}progress"


DIGEST_VALUES = 1 << 22  # values a digest of tensors hashes at most (every k-th one beyond: about 16 MB)


def tensors_digest(tensors: Sequence[torch.Tensor]) -> str:
    """A fingerprint of tensors' values (BLAKE2b of their bytes; of every k-th value when there are more than
    DIGEST_VALUES): peers holding bit-identical tensors have equal digests (DiLoCo's outer parameters; the weights
    peers start from)."""
    stride = max(1, -(-sum(t.numel() for t in tensors) // DIGEST_VALUES))
    digest = hashlib.blake2b(digest_size=8)
    for tensor in tensors:
        values = tensor.detach().reshape(-1)[::stride].contiguous().cpu()  # (a GPU's tensors: the model's weights)
        digest.update(values.view(torch.uint8).numpy().data)
    return digest.hexdigest()


def trusted_epoch(epochs: list[int], local_epoch: int) -> int:
    """The highest step a progress record may report: one ahead of this peer's, or more where at least
    max(2, majority of the records) report at least that much. (A lone record further ahead is checked by downloading
    the swarm's state, at once: see SwarmOptimizer._should_load_state_from_peers.)"""
    quorum = max(2, len(epochs) // 2 + 1)
    ahead = sorted((epoch for epoch in epochs if epoch > local_epoch + 1), reverse=True)
    return ahead[quorum - 1] if len(ahead) >= quorum else local_epoch + 1


def missed_round(local_epoch: int, swarm_epoch: int, *, in_group: bool, newest_served: int) -> bool:
    """Whether a peer about to end step `local_epoch` should download the swarm's state instead of averaging: the
    swarm already moved on (`swarm_epoch` > `local_epoch`), this peer is in no group of that step's round (so it would
    average with nobody and step alone), and some peer serves a state at least that new. With nobody serving one (all
    peers in client mode, say) it steps with its own gradients rather than lose them."""
    return swarm_epoch > local_epoch and not in_group and newest_served >= swarm_epoch


def ready_peers(announced_ready: Iterable[str], tracked: Iterable[str], own: str) -> set[str]:
    """Peers that count toward `min_peers`: they announced that they train (their optimizer runs) and this peer sees
    their progress record (its first collaborative step will count their samples); this peer always counts."""
    return ({*announced_ready} & {*tracked, own}) | {own}


def state_priority(step: int, complete: bool, tiebreak: float) -> float:
    """The priority a trainer serves its state with: joiners download from the highest, and a peer that stepped alone
    (its round failed while others were there) re-syncs from any higher one. A state of a later step ranks higher; at
    one step, one whose round was complete ranks higher than one that stepped alone; `tiebreak` ([0, 0.25), from the
    peer ID) orders peers that are alike, so that two peers that both stepped alone do not swap states."""
    return step + (0.5 if complete else 0.0) + tiebreak


def peer_tiebreak(peer_id: bytes) -> float:
    """A fraction in [0, 0.25) fixed by the peer's ID."""
    return int.from_bytes(hashlib.sha256(peer_id).digest()[:4], "big") / 2**32 / 4


# --- samples per collaborative step --------------------------------------------------------------------------------


MIN_RATE = 1e-6  # samples per second: below this, a peer has not measured its throughput yet (hivemind reports 1e-20)


class Contribution(NamedTuple):
    """One trainer's progress record in the current step: who, samples so far, samples per second, and when it
    reported them (DHT time)."""

    peer: bytes
    samples: int
    rate: float
    time: float = 0.0


def share_of_target(target: int, own: Contribution, contributions: Sequence[Contribution]) -> float:
    """A peer's share of the step's samples: target x its throughput / the swarm's (equal shares while a peer has not
    measured its throughput yet)."""
    if not contributions or any(c.rate < MIN_RATE for c in contributions):
        return target / max(len(contributions), 1)
    return target * max(own.rate, 0.0) / sum(c.rate for c in contributions)


SHARE_SLACK = 0.25  # of a batch: how far a share may move (the reported rates change) before a done peer is not done
STOPPED_STEPS, STOPPED_MARGIN = 2, 0.3  # a peer silent for 2 of its local steps + 0.3 s stopped computing


def share_done(samples: int, batch: int, share: float, slack: float = 0.0) -> bool:
    """Whether a peer that accumulated `samples` (in batches of `batch`) computed its share of the step: its samples
    are the multiple of its batch nearest to the share (the nearest, not the next: rounding every peer's share up
    added half a batch per peer, 12-25% of a 4-peer step of 4 batches each). `slack` (a fraction of a batch) allows
    for a share that grew since the peer stopped (`stopped_at_share`)."""
    return samples > 0 and samples + batch / 2 + slack * batch > share


def own_share_done(samples: int, batch: int, share: float, *, alone: bool) -> bool:
    """Whether this peer stops computing for the step (then holds for the others' reports): `share_done`, with
    SHARE_SLACK when others share the step. Each peer computes the shares from the records as it read them, and a record
    that changed between two peers' reads (a new throughput, once a step) moves the shares by a fraction of a sample:
    peers whose shares straddled a rounding point by it (a: 9.7, b: 6.6 of 16 in one run, batches of 4; 10.1 for a
    would have made it 12 + 8 samples) both computed the batch in doubt, and the step took 20 samples for 16 (once in
    four clean-clone runs of tests/test_swarm.py). A peer within the slack of its rounding point stops instead, as the
    others judge it (`stopped_at_share`); if the total is short once the records settled, the same records rank the
    peers that compute the missing batches (`fills_shortfall`), once."""
    return share_done(samples, batch, share, 0.0 if alone else SHARE_SLACK)


def stopped_at_share(contribution: Contribution, batch: int, share: float, now: float) -> bool:
    """Whether a peer, as its latest record shows it, stopped computing for this step: it computed its share within
    SHARE_SLACK, or it has reported samples in this step and then nothing for STOPPED_STEPS of its local steps (plus
    STOPPED_MARGIN). Shares follow the rates in the records, which change with every report: a peer that stopped at
    4 samples for a share of 4.98 (batches of 2) had a share of 5.02 in the next records, the others waited for it to
    compute a batch it never would, and the step ended only when a wait gave up (benchmarks/convergence.py)."""
    c = contribution
    if share_done(c.samples, batch, share, SHARE_SLACK):
        return True
    return c.samples > 0 and c.rate >= MIN_RATE and now - c.time > STOPPED_STEPS * batch / c.rate + STOPPED_MARGIN


def seconds_to_target(contributions: Sequence[Contribution], target: int, batch: int, now: float) -> float:
    """How long the swarm should still need to reach `target` samples, as the records show it: the samples missing
    over the rates of the peers still computing their shares (`stopped_at_share`); 0 once the target is reached, or
    nobody computes (the shortfall is then filled: `fills_shortfall`)."""
    missing = target - sum(c.samples for c in contributions)
    computing = [
        c for c in contributions if not stopped_at_share(c, batch, share_of_target(target, c, contributions), now)
    ]
    if missing <= 0 or not computing:
        return 0.0
    return missing / max(sum(c.rate for c in computing), MIN_RATE)


def fills_shortfall(own: bytes, contributions: Sequence[Contribution], target: int, batch: int) -> bool:
    """The swarm's reports settled below `target` (every peer computed its rounded share): whether peer `own` computes
    one more batch. Peers are ranked by how far they are below their share (then by ID); the first ones, enough to
    cover the shortfall at `batch` samples each, compute. Every peer ranks the same records the same way, so the
    shortfall is filled once, not once per peer."""
    missing = target - sum(c.samples for c in contributions)
    if missing <= 0:
        return False
    ranked = sorted(contributions, key=lambda c: (c.samples - share_of_target(target, c, contributions), c.peer))
    for index, contribution in enumerate(ranked):
        if index * batch >= missing:
            return False
        if contribution.peer == own:
            return True
    return False


def silent_too_long(record_time: float, step_began: float, now: float, allowance: float) -> bool:
    """Whether a trainer whose latest progress record is from `record_time` is taken for gone (frozen or killed: its
    record outlives it) by a peer whose own step began at `step_began`: silent for more than `allowance` seconds,
    counted from the record or from the start of this peer's step, whichever is later. A peer that waited for the
    others' reports at the end of the last step reported nothing while it waited and averaged; counted from its last
    record, the others took it for gone as the next step began, before its first report of that step reached them,
    and computed its part of the step too (benchmarks/convergence.py: steps of 56-92 samples for a target of 32)."""
    return now - max(record_time, step_began) > allowance


def expected_in_round(own: bytes, records: Iterable[tuple[bytes, int]], epoch: int) -> list[bytes]:
    """The peers expected in the round of step `epoch` (a group holding them all assembles at once): this one, and
    every trainer whose fresh progress record (peer ID, step) is at that step or behind it: one behind is finishing
    the last step; further behind is a joiner still downloading the state, whose first round may be this one (a group
    that assembled before it looked left it to step alone, out of step: tests/test_faults.py's late joiner). A peer
    that does not come costs the group the time it declared, as every group did before early assembly."""
    return [own, *(peer for peer, step in records if step <= epoch)]
