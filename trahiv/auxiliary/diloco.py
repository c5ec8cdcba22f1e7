"""The auxiliary peer in a DiLoCo swarm (trahiv.diloco): per-peer outer steps and bytes, and checkpoints of the outer
parameters.

- The swarm runs DiLoCo if the aux peer's config has a `diloco` section (the trainers' hivemind_config), or as soon as
  peers publish DiLoCo progress records (`trahiv.protocol.progress_key(run_id, diloco=True)`): `DiLoCoMonitor`
  (started by every AuxPeer) reads them every `period` seconds and keeps, per peer, its outer step, inner steps done,
  samples/s and cumulative `averaging_bytes_sent` / `averaging_bytes_received` in the MetricsStore (`diloco_peers()`;
  the dashboard's `/api/diloco`), and sets the store's metadata `mode` to `diloco`.
- `DiLoCoStateKeeper` replaces the state keeper (`trahiv aux --model ...`) in DiLoCo mode: trainers' checkpoints hold
  their own half-way inner parameters, so it saves the swarm's *outer* state instead, downloaded from a trainer's
  DiLoCo averager the way a joiner does (`{run_id}_diloco` prefix: outer parameters + outer momenta at one outer step,
  taken under the trainer's lock between two outer steps). `checkpoint-<N>` is outer step N (`checkpoint_every` counts
  outer steps); the model files hold the outer parameters, `optimizer_state.pt` the outer momenta (one tensor entry
  per parameter, `"role": "outer_momentum"`), and `trahiv_state.json` adds `"diloco": {"outer_step", "inner_steps",
  "global_step"}` (global_step = outer_step x inner_steps, the trainers' `state.global_step` right after that sync).
  It serves the newest one it holds, its outer step as its state-sharing priority: at start (unless `--no-resume`) it
  loads its newest checkpoint, so a whole DiLoCo swarm that stopped restarts from it (trainers started afterwards see
  an outer step served later than any training peer's and download it, `DiLoCoOptimizer.join`); a joiner of a running
  swarm downloads from a trainer (the peer at the highest outer step). In a moderated swarm a revert order to outer
  step N moves the checkpoints of later outer steps to `reverted-<order id>/` and serves the newest one left (or
  nothing), as in the synchronous mode.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import torch

from trahiv import engine, protocol
from trahiv.auxiliary.checkpoints import (
    SwarmState,
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)
from trahiv.auxiliary.keeper import StateKeeper
from trahiv.diloco import PeerProgress
from trahiv.engine.diloco import DiLoCoAverager
from trahiv.engine.gate import gated
from trahiv.engine.liveness import dht_answer

logger = logging.getLogger("trahiv.auxiliary.diloco")

__all__ = [
    "DiLoCoMirror",
    "DiLoCoMonitor",
    "DiLoCoStateKeeper",
    "diloco_peers",
    "is_diloco_state",
    "momentum_metadata",
    "progress_key",
]

MOMENTUM_ROLE = "outer_momentum"


def momentum_metadata(count: int) -> list[dict[str, Any]]:
    """The `optimizer_state.pt` metadata of a DiLoCo checkpoint: one tensor entry per outer momentum."""
    return [{"type": "tensor", "index": i, "role": MOMENTUM_ROLE} for i in range(count)]


def is_diloco_state(state: SwarmState) -> bool:
    """Whether a checkpoint's state is a DiLoCo swarm's outer state (its optimizer tensors are outer momenta)."""
    entries = state.optimizer_metadata
    return bool(entries) and all(entry.get("role") == MOMENTUM_ROLE for entry in entries)


def progress_key(run_id: str) -> str:
    return protocol.progress_key(run_id, diloco=True)


def _count(value: Any) -> int:
    return value if type(value) is int and 0 <= value < 2**62 else 0


def diloco_peers(dht: Any, run_id: str, timeout: float | None = None) -> list[dict[str, Any]]:
    """The DiLoCo progress records peers published (malformed ones dropped), as store rows; an error if the DHT does
    not answer within `timeout` seconds (None: the DHT's own request timeouts) or its process has ended."""
    found = dht_answer(dht, dht.get(progress_key(run_id), latest=True, return_future=True), timeout)
    entries = found.value if found is not None and isinstance(found.value, dict) else {}
    rows = []
    for entry in entries.values():
        value = getattr(entry, "value", None)
        record = PeerProgress.parse(value)
        if record is None or not isinstance(value, dict):
            continue
        rows.append(
            {
                "peer_id": record.peer,
                "outer_step": record.outer_step,
                "inner_done": record.inner_done,
                "inner_steps": record.inner_steps,
                "steps_per_second": record.steps_per_second,
                "bytes_sent": _count(value.get("averaging_bytes_sent")),
                "bytes_received": _count(value.get("averaging_bytes_received")),
                "last_seen": record.time,
            }
        )
    return rows


class DiLoCoMonitor:
    """Polls the DiLoCo progress records into the store (`start()` / `stop()`, or `poll()`)."""

    def __init__(self, dht: Any, run_id: str, store: Any, *, period: float = 2.0, diloco: bool = False):
        self.dht, self.run_id, self.store, self.period = dht, run_id, store, period
        self.diloco = diloco  # known from the config; otherwise set by the first record seen
        if diloco:
            store.set_meta("mode", "diloco")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> DiLoCoMonitor:
        self._thread = threading.Thread(target=self._run, name="trahiv-diloco-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop polling, then read the records once more (within `timeout`): a trainer's last record, published as it
        leaves, reaches the store even when the aux peer is stopped right after the trainers (`trahiv demo --diloco`
        stops it as they end: the store kept the outer step and bytes of a poll up to `period` old)."""
        self._stop.set()
        if self._thread is None:
            return
        self._thread.join(timeout)
        if self._thread.is_alive():  # a poll still waiting for the DHT: do not wait for a second one
            return
        try:
            self.poll(timeout=timeout)
        except Exception as e:  # (the DHT may be gone already: the store keeps the last poll's rows)
            logger.debug(f"Reading DiLoCo progress as the aux peer stops failed: {e!r}")

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.poll()
            except Exception as e:  # a DHT hiccup must never stop the aux peer
                logger.debug(f"Reading DiLoCo progress failed: {e!r}")

    def poll(self, timeout: float | None = None) -> list[dict[str, Any]]:
        rows = diloco_peers(self.dht, self.run_id, timeout)
        if rows and not self.diloco:
            self.diloco = True
            self.store.set_meta("mode", "diloco")
            logger.info(f"Swarm {self.run_id!r} runs DiLoCo: following its peers' outer steps")
        for row in rows:
            self.store.upsert_diloco_peer(**row)
        return rows


# --- checkpoints of the outer state -----------------------------------------------------------------------------


class DiLoCoMirror(DiLoCoAverager):
    """A DiLoCo averager that averages nothing and serves nothing: it downloads the outer state from the trainers
    (checked against the expected shapes: outer parameters, then as many momenta)."""

    def __init__(self, *, dht: Any, run_id: str, shapes: list[tuple], **kwargs: Any):
        self._shapes = shapes
        super().__init__(
            averaged_tensors=[torch.zeros(1)],
            dht=dht,
            prefix=f"{run_id}_diloco",
            progress_key=progress_key(run_id),
            allow_state_sharing=False,
            start=True,
            **kwargs,
        )

    def _expected_state_shapes(self) -> list[tuple] | None:
        return self._shapes + self._shapes

    def serve(self, state: SwarmState) -> None:
        """Serve `state` (outer parameters + momenta at outer step `state.step`) to peers that ask this one."""
        self.state_source = _Served(state)
        self.allow_state_sharing = True
        self.state_sharing_priority = float(state.step)

    def withdraw(self) -> None:
        """Serve nothing (a revert set aside the state served)."""
        self.allow_state_sharing = False
        self.state_source = None

    def download(self, timeout: float) -> tuple[Any, list[torch.Tensor]] | None:
        return self.load_state_from_peers(timeout=timeout)


class _Served:
    """What DiLoCoAverager.get_current_state serves (a trainer's DiLoCoOptimizer offers the same `outer_state`)."""

    def __init__(self, state: SwarmState):
        self.outer_params, self.momenta, self.step = state.parameters, state.optimizer_tensors, state.step

    def outer_state(self) -> tuple[dict[str, Any], list[torch.Tensor], None]:
        return {"epoch": self.step}, [*self.outer_params, *self.momenta], None


class DiLoCoStateKeeper(StateKeeper):
    """The state keeper of a DiLoCo swarm: checkpoints of the outer state every `checkpoint_every` outer steps."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.held: int | None = None  # the outer step of the newest checkpoint saved
        self.diloco_mirror: DiLoCoMirror | None = None

    def start_with(self, dht: Any, run_id: str, gate: Any = None) -> None:
        self._dht, self.run_id = dht, run_id
        served = self._newest_checkpoint() if self.config.resume else None  # bad checkpoints fail before any process
        if served is not None and not is_diloco_state(served[1]):
            raise ValueError(
                f"{served[0]} is a checkpoint of a synchronous swarm, not the outer state of a DiLoCo swarm: choose "
                "another checkpoint directory, or start without resuming (--no-resume)"
            )
        shapes = [tuple(p.shape) for _, p in self.named]
        with engine.children_ignore_sigint():
            self.diloco_mirror = gated(DiLoCoMirror, gate)(dht=dht, run_id=run_id, shapes=shapes)
        if served is not None:
            self.diloco_mirror.serve(served[1])
            self.held = served[1].step
            logger.info(f"Serving checkpoint {served[0]} (DiLoCo outer step {self.held}) to peers that join")
        self._thread = threading.Thread(target=self._loop, name="trahiv-diloco-keeper", daemon=True)
        self._thread.start()
        logger.info(f"Keeping checkpoints of the outer parameters of DiLoCo swarm {run_id!r}")

    def stop(self, timeout: float = 10.0) -> None:
        super().stop(timeout)
        if self.diloco_mirror is not None:
            self.diloco_mirror.shutdown()
            self.diloco_mirror = None

    @property
    def step(self) -> int | None:
        return self.held

    def _serve_newest_left(self) -> None:
        """A moderator reverted the swarm to an outer step before the one held (StateKeeper.apply_revert moved the later
        checkpoints to `reverted-<id>/`): serve the newest checkpoint left, or nothing; the next checkpoint is the first
        outer step after it."""
        remaining = latest_checkpoint(self.config.checkpoint_dir)
        state = None if remaining is None else load_checkpoint(remaining).swarm_state()
        self.held = None if state is None else state.step
        if self.diloco_mirror is not None:
            if state is not None:
                self.diloco_mirror.serve(state)
            else:
                self.diloco_mirror.withdraw()

    def poll(self) -> Path | None:
        """If the swarm's outer step crossed a multiple of `checkpoint_every`, download the outer state and save it."""
        if time.monotonic() < self._paused_until:  # a revert's grace period: peers may still be at later steps
            return None
        every, held = self.config.checkpoint_every, self.held
        newest = max((row["outer_step"] for row in diloco_peers(self._dht, self.run_id)), default=0)
        if newest < 1 or (held is not None and newest // every <= held // every):
            return None
        assert self.diloco_mirror is not None, "poll() before start()"
        raw = self.diloco_mirror.download(self.config.load_state_timeout)
        if raw is None:
            return None
        metadata, tensors = raw
        outer_step, inner_steps = metadata.get("epoch"), metadata.get("inner_steps")
        count = len(self.named)
        if type(outer_step) is not int or outer_step < 1 or len(tensors) != 2 * count:
            logger.warning(f"Ignoring a malformed DiLoCo state (outer step {outer_step!r}, {len(tensors)} tensors)")
            return None
        if held is not None and outer_step <= held:
            return None
        state = SwarmState(outer_step, list(tensors[:count]), momentum_metadata(count), list(tensors[count:]))
        self._check_model(state)
        steps = inner_steps if type(inner_steps) is int and inner_steps > 0 else None
        info = {"outer_step": outer_step, "inner_steps": steps, "global_step": outer_step * steps if steps else None}
        path = save_checkpoint(
            self.config.checkpoint_dir, state, self.model, run_id=self.run_id, source="diloco", extra={"diloco": info}
        )
        prune_checkpoints(self.config.checkpoint_dir, self.config.keep_checkpoints)
        self.diloco_mirror.serve(state)
        self.held = outer_step
        self.saved.append(path)
        logger.info(f"Saved checkpoint {path} (DiLoCo outer step {outer_step})")
        if self.config.push_to_hub:
            self._push(path)
        return path
