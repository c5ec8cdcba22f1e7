"""One peer lifecycle: auth -> DHT -> token -> watchers (-> the caller announces), and the reverse on exit.

The trainer (`trahiv.swarm.Swarm`), the auxiliary peer (`trahiv.auxiliary.peer.AuxPeer`), `trahiv dht` and
`trahiv revert` each joined and left a swarm with their own copy of this sequence (and each its own cleanup when a
step in the middle failed). `join_swarm` is the one sequence, recorded in a `Lifecycle`:

    auth      trade the user token for an access token (before the DHT: a refused peer stops here)
    dht       start the DHT (signed requests with the access token)      stop: dht.shutdown()
    engine watch  with `on_engine_lost`: the DHT, its p2pd and the        stop: watch.close() (before the DHT and the
              caller's engine processes watched (trahiv.engine.liveness)       averagers stop on purpose)
    token     publish the access token in the DHT and renew it           stop: auth.close() (no renewal while the DHT
                                                                               stops; removes a temporary identity)
    watchers  follow moderators' revert orders (trahiv.revert)           stop: watcher.close()

`Lifecycle.close()` stops what started, in reverse order, each step once; a step that fails to start is not stopped
(it did not start) and the steps before it are: `join_swarm` undoes them before it re-raises. Callers add their own
steps after (the revert command's state mirror) and announce the join addresses last, after their DHT validators.
Light to import: hivemind and torch load only when `join_swarm` runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from trahiv.auth import PeerAuth
    from trahiv.config import DHTConfig
    from trahiv.engine.liveness import EngineWatch
    from trahiv.revert import RevertWatcher

__all__ = ["Lifecycle", "Membership", "join_swarm"]

logger = logging.getLogger("trahiv.lifecycle")
T = TypeVar("T")


class Lifecycle:
    """Steps started in order, stopped in reverse order (a context manager: leaving it stops them)."""

    def __init__(self) -> None:
        self._stops: list[tuple[str, Callable[[], None]]] = []

    @property
    def started(self) -> list[str]:
        """Names of the steps started and not stopped yet, in start order."""
        return [name for name, _ in self._stops]

    def enter(self, name: str, start: Callable[[], T], stop: Callable[[T], Any] | None = None) -> T:
        """Run `start()`; once it returned, `stop(its result)` runs at `close()`. If `start` raises, nothing of this
        step is recorded (the caller undoes the steps before)."""
        value = start()
        self._stops.append((name, (lambda: None) if stop is None else (lambda: stop(value))))
        return value

    def close(self, *, after: str | None = None) -> None:
        """Stop the started steps in reverse order (with `after`: only those started after step `after`). Stopping
        never raises: a failing stop is logged and the next one runs."""
        keep = 0
        if after is not None:
            keep = next((i + 1 for i, (name, _) in enumerate(self._stops) if name == after), len(self._stops))
        while len(self._stops) > keep:
            name, stop = self._stops.pop()
            try:
                stop()
            except Exception as e:  # leaving must go on: the next steps still hold processes and threads
                logger.warning(f"Stopping {name} failed: {e!r}")

    def __enter__(self) -> Lifecycle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@dataclass
class Membership:
    """What `join_swarm` started: the DHT, the access token (moderated swarm) and the revert-order watcher."""

    dht: Any
    auth: PeerAuth | None = None
    revert_watcher: RevertWatcher | None = None


def join_swarm(
    life: Lifecycle,
    dht_config: DHTConfig,
    *,
    auth: Callable[[], PeerAuth | None],
    run_id: str | None = None,
    contribution: Callable[[], tuple[int, int]] | None = None,
    watch_reverts: bool = True,
    on_engine_lost: Callable[[str], None] | None = None,
    engine_processes: Callable[[], Sequence[Any]] | None = None,
) -> Membership:
    """auth -> DHT -> token -> watchers, recorded in `life`; on failure, what started is stopped and the error raised.

    auth: starts this peer's access token (e.g. `trahiv.swarm._start_auth(config)`), or returns None in an open swarm.
    contribution: (samples, collaborative step) reported when the token is renewed (trainers only).
    watch_reverts: follow moderators' revert orders of run `run_id` (a moderated swarm only).
    on_engine_lost: called once, with a sentence saying what ended and how, if the DHT process, its p2pd or a process
    of `engine_processes()` (the DHT's by default; re-read as averagers start) ends before the watch is stopped."""
    from trahiv.swarm import start_dht

    try:
        peer_auth = life.enter("auth", auth, lambda a: a.close() if a is not None else None)
        extra = peer_auth.dht_kwargs() if peer_auth is not None else {}
        dht = life.enter("dht", lambda: start_dht(dht_config, **extra), _shutdown_dht)
        member = Membership(dht, peer_auth)
        if on_engine_lost is not None:
            life.enter("engine watch", lambda: _watch_engine(dht, engine_processes, on_engine_lost), _close)
        if peer_auth is None:
            return member
        life.enter("token", lambda: peer_auth.attach(dht, contribution), lambda _: peer_auth.close())
        if watch_reverts:
            if run_id is None:
                raise ValueError("join_swarm(watch_reverts=True) needs the run_id whose revert orders to follow")
            member.revert_watcher = life.enter("watchers", lambda: _watch_reverts(dht, run_id, peer_auth), _close)
        return member
    except BaseException:
        life.close()
        raise


def _watch_engine(
    dht: Any, processes: Callable[[], Sequence[Any]] | None, on_lost: Callable[[str], None]
) -> EngineWatch:
    from trahiv.engine.liveness import EngineWatch

    return EngineWatch(dht, processes or (lambda: []), on_lost).start()  # (the DHT and its p2pd: always)


def _watch_reverts(dht: Any, run_id: str, peer_auth: PeerAuth) -> RevertWatcher:
    from trahiv.revert import RevertWatcher

    return RevertWatcher(dht, run_id, peer_auth.experiment_public_key, peer_auth.client).start()


def _shutdown_dht(dht: Any) -> None:
    from trahiv.engine import fixes

    if dht.is_alive():
        dht.shutdown()  # hivemind's: SIGTERM after its grace period
        dht.join(1.0)
        fixes.free_locks_of_killed([dht])


def _close(thing: Any) -> None:
    thing.close()
