"""The swarm protocol's decisions, as pure functions (no engine, no DHT): which progress records to trust, when a peer
has missed the swarm's round, how many peers are ready to train. trahiv.engine.optimizer and trahiv.swarm act on them;
tests/test_protocol.py checks them in one process."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["missed_round", "ready_peers", "trusted_epoch"]


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
