"""`AuxPeer`: the auxiliary peer, a CPU-only swarm member that computes no gradients.

It joins (or starts) the swarm's DHT, prints the `initial_peers` volunteers join with, and runs the collector that
gathers the trainers' metrics into a MetricsStore and the experiment trackers. Other duties plug in as *services*:
objects with `start(peer)` and `stop()`, added with `add_service()` before `start()`; they find the DHT, the config,
the store and the output directory on the peer (`peer.dht`, `peer.config`, `peer.store`, `peer.output_dir`).
Services start after the collector, in the order added, and stop in reverse order, before it.

In a moderated swarm (`config.auth`: the auth server and the user's token) the peer trades the token for an access
token before its DHT starts (`AuthError` with the server's reason if refused), signs its DHT requests with it and
renews it in the background, reporting no samples; `peer.auth` is then the `trahiv.auth.PeerAuth`, services
wrap their averagers with `gated(cls, peer.auth_gate())`, and `peer.revert_watcher` (`trahiv.revert.RevertWatcher`)
follows moderators' revert orders (the state keeper sets aside the checkpoints they revert).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from trahiv.auxiliary.collector import Collector
from trahiv.auxiliary.store import MetricsStore, default_store_url
from trahiv.auxiliary.trackers import Tracker, make_trackers
from trahiv.config import HivemindConfig
from trahiv.lifecycle import Lifecycle, join_swarm

logger = logging.getLogger("trahiv.auxiliary")

__all__ = ["AuxPeer", "AuxService"]


class AuxService(Protocol):
    """A duty of the aux peer (dashboard, checkpoints, auxiliary averaging...)."""

    def start(self, peer: AuxPeer) -> None: ...

    def stop(self) -> None: ...


class AuxPeer:
    """An auxiliary peer of swarm `config.opt.run_id`: `start()`, then `stop()` (or use it as a context manager)."""

    def __init__(
        self,
        config: HivemindConfig,
        *,
        output_dir: str | Path,
        store_url: str | None = None,
        report_to: Sequence[str] = ("tensorboard",),
        period: float = 2.0,
        max_steps: int | None = None,
        tracker_project: str | None = None,
        announce: Callable[[str], None] = print,
    ):
        if period <= 0:
            raise ValueError(f"period must be > 0 seconds, got {period}")
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        self.config = config
        self.output_dir = Path(output_dir).expanduser()
        self.store_url = store_url or default_store_url(self.output_dir)
        self.report_to = list(report_to)
        self.period, self.max_steps = period, max_steps
        self.tracker_project = tracker_project or config.opt.run_id
        self.announce = announce
        self.dht: Any = None
        self.auth: Any = None  # trahiv.auth.PeerAuth in a moderated swarm
        self.revert_watcher: Any = None  # trahiv.revert.RevertWatcher in a moderated swarm
        self.store: MetricsStore | None = None
        self.collector: Collector | None = None
        self.diloco_monitor: Any = None  # trahiv.auxiliary.diloco.DiLoCoMonitor: DiLoCo peers' outer steps and bytes
        self.initial_peers: list[str] = []
        self.services: list[AuxService] = []
        self._started: list[AuxService] = []
        self._lifecycle = Lifecycle()  # auth -> DHT -> token -> watchers (trahiv.lifecycle)
        self.lost: str | None = None  # what ended under this peer (its DHT process, its p2pd: trahiv.engine.liveness)

    @property
    def run_id(self) -> str:
        return self.config.opt.run_id

    def auth_gate(self) -> Any:
        """A `trahiv.auth.AuthGate` for this peer's averagers in a moderated swarm (only token holders); else None."""
        if self.auth is None:
            return None
        from trahiv.auth import AuthGate

        return AuthGate(self.run_id, self.auth.experiment_public_key)

    def add_service(self, service: AuxService) -> None:
        if self.dht is not None:
            raise RuntimeError("add services before AuxPeer.start()")
        self.services.append(service)

    # --- lifecycle ------------------------------------------------------------------------------------------

    def start(self) -> AuxPeer:
        """Open the store and trackers (bad settings fail here, before any process starts), join the swarm, print
        its join addresses, then start collecting and the services."""
        self.output_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.store = MetricsStore(self.store_url)
            trackers = self._open_trackers(self.store)
            from trahiv.metrics import add_metrics_validators
            from trahiv.swarm import _start_auth, join_addresses, show_swarm_events

            show_swarm_events()
            # auth (a refused peer stops here, with the server's reason) -> DHT -> token (published and renewed; an
            # aux peer contributes no samples) -> moderators' revert orders; `stop` undoes them in reverse order
            member = join_swarm(self._lifecycle, self.config.dht, auth=lambda: _start_auth(self.config),
                                run_id=self.run_id, on_engine_lost=self._engine_lost)  # fmt: skip
            self.auth, self.dht, self.revert_watcher = member.auth, member.dht, member.revert_watcher
            add_metrics_validators(self.dht, self.run_id)
            self.initial_peers = join_addresses(self.dht)
            self.announce(f"To join the training, use initial_peers = {self.initial_peers}")
            self.collector = Collector(self.dht, self.run_id, self.store, trackers, period=self.period)
            self.collector.start()
            from trahiv.auxiliary.diloco import DiLoCoMonitor  # [DiLoCo] (from the config or the peers' records)

            diloco = self.config.diloco is not None
            self.diloco_monitor = DiLoCoMonitor(self.dht, self.run_id, self.store, period=self.period, diloco=diloco)
            self.diloco_monitor.start()
            for service in self.services:
                service.start(self)
                self._started.append(service)
        except BaseException:
            self.stop()
            raise
        return self

    def _open_trackers(self, store: MetricsStore) -> list[Tracker]:
        opt = self.config.opt
        meta = {"run_id": self.run_id, "target_batch_size": str(opt.target_batch_size)}
        if self.max_steps is not None:
            meta["max_steps"] = str(self.max_steps)
        stored = store.meta()
        if stored.get("run_id", self.run_id) != self.run_id:
            raise ValueError(
                f"store {store.url} holds the history of run_id {stored['run_id']!r}, not {self.run_id!r}: "
                "choose another --store or --output-dir"
            )
        meta.setdefault("started_at", stored.get("started_at", f"{time.time():.3f}"))
        config = {"run_id": self.run_id, "target_batch_size": opt.target_batch_size, "max_steps": self.max_steps}
        trackers, remember = make_trackers(
            [name for name in self.report_to if name != "none"],
            output_dir=self.output_dir,
            project=self.tracker_project,
            run_name=self.run_id,
            config=config,
            meta=stored,
        )
        for key, value in {**meta, **remember}.items():
            store.set_meta(key, value)
        return trackers

    def alive(self) -> bool:
        return self.dht is not None and self.dht.is_alive() and self.lost is None

    def _engine_lost(self, reason: str) -> None:  # (trahiv.engine.liveness) the command stops: see `alive`
        self.lost = reason

    def stop(self) -> None:
        """Stop the services (reverse order), the collector (logging the steps not logged yet), the DHT, the store."""
        for service in reversed(self._started):
            try:
                service.stop()
            except Exception as e:
                logger.warning(f"Stopping {type(service).__name__} failed: {e!r}")
        self._started = []
        if self.diloco_monitor is not None:
            self.diloco_monitor.stop()
            self.diloco_monitor = None
        if self.collector is not None:
            self.collector.stop(timeout=max(5.0, 2 * self.period))
            self.collector = None
        self._lifecycle.close()  # the revert watcher, the token (no renewal while the DHT stops), the DHT
        self.revert_watcher = self.auth = self.dht = None
        if self.store is not None:
            self.store.close()
            self.store = None

    def __enter__(self) -> AuxPeer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
