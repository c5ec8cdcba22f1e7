"""The swarm protocol's decisions, as pure functions (no engine, no DHT): which progress records to trust, when a peer
has missed the swarm's round, how many peers are ready to train. trahiv.engine.optimizer and trahiv.swarm act on them;
tests/test_protocol.py checks them in one process."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

__all__ = ["missed_round", "peer_tiebreak", "ready_peers", "state_priority", "trusted_epoch"]


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
