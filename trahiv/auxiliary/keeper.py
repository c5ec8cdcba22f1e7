"""The auxiliary peer's state keeper: it follows the swarm's training state, saves it as checkpoints, and serves it.

- Every `checkpoint_every` collaborative steps it downloads the swarm's state (model, optimizer state, step) from the
  peer serving the newest one, the way a joining trainer does (`load_state_from_peers`), and saves a checkpoint
  (`trahiv.auxiliary.checkpoints`), keeping the newest `keep_checkpoints`; optionally uploads it to the HF Hub.
- It serves the state it holds to peers that join, as a trainer's state averager does: its state-sharing priority is
  the step of that state, so joiners prefer trainers (which are newer) and fall back on it.
- At start it loads its newest checkpoint and serves it: a whole swarm that stopped restarts from that step. Start
  the auxiliary peer, then the trainers: before training, a trainer sees a peer serving a newer step than its own
  and downloads that state (`Swarm.catch_up`), so training continues at the checkpoint's collaborative step with
  its optimizer state and learning-rate schedule.
- In a moderated swarm, when a moderator reverts the swarm to step N (`trahiv revert`, a valid order signed by the
  experiment key), it moves its checkpoints of later steps to `checkpoint_dir/reverted-<order id>/`, serves its newest
  remaining checkpoint (or nothing), and saves no new checkpoint during the revert's grace period.

The keeper needs the swarm's model (`model`: a local folder or a cached Hub name, read with `from_pretrained` and
local files only; a folder with only `config.json` gives the architecture). It computes nothing: no gradients, CPU.
It accepts any optimizer the trainers use, since it keeps the optimizer state in hivemind's flat form.

Helping the trainers average is a separate service (`trahiv.auxiliary.helper`, `trahiv aux --average`), not
`hivemind.Optimizer(auxiliary=True)`: in hivemind 1.1.12 that optimizer brings its own `{run_id}_state_averager` to
the peer, with the same RPC names and the same state declaration (DHT subkey = the peer ID) as this keeper's server.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trahiv import engine
from trahiv.auxiliary.checkpoints import (
    SwarmState,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    push_to_hub,
    save_checkpoint,
    swarm_parameters,
)
from trahiv.auxiliary.state import StateKeeperConfig, load_model
from trahiv.engine.gate import gated
from trahiv.engine.state import StateMirror
from trahiv.swarm import newest_served_step  # (importing trahiv.swarm applies the engine fixes)

if TYPE_CHECKING:
    from trahiv.auxiliary.peer import AuxPeer

logger = logging.getLogger("trahiv.auxiliary.keeper")

__all__ = ["StateKeeper"]

# A peer's state declaration outlives it by up to hivemind's declare_state_period (30 s): after a download that got
# nothing newer, the same declared step is not asked for again before this many seconds.
RETRY_SECONDS = 30.0


class StateKeeper:
    """An AuxPeer service: `start(peer)` / `stop()`; or `start_with(dht, run_id)` without an AuxPeer."""

    serves_state = True  # its mirror holds the trainers' `{run_id}_state_averager` RPC names on this peer's p2pd

    def __init__(self, config: StateKeeperConfig, *, model: torch.nn.Module | None = None):
        self.config = config
        self.model = model if model is not None else load_model(config.model, config.model_class)
        self.model.eval()
        self.named = swarm_parameters(self.model)
        self.run_id = ""
        self.mirror: StateMirror | None = None
        self.saved: list[Path] = []
        self.pushed: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._upload: threading.Thread | None = None
        self._uploading = Path()
        self._dht: Any = None
        self._failed_step, self._retry_at = -1, 0.0
        self._watcher: Any = None  # trahiv.revert.RevertWatcher of a moderated swarm
        self.applied_revert = 0  # the newest revert order followed (orders older than the peer are not)
        self._paused_until = 0.0  # no download during a revert's grace period (peers still in the old state serve it)

    # --- lifecycle ------------------------------------------------------------------------------------------

    def start(self, peer: AuxPeer) -> None:
        self._watcher = peer.revert_watcher
        if self._watcher is not None:
            self.applied_revert = self._watcher.baseline_id
        self.start_with(peer.dht, peer.run_id, gate=peer.auth_gate())

    def start_with(self, dht: Any, run_id: str, gate: Any = None) -> None:
        """`gate`: a `trahiv.auth.AuthGate` in a moderated swarm (state served only to peers with valid tokens)."""
        self._dht, self.run_id = dht, run_id
        served = self._newest_checkpoint() if self.config.resume else None  # bad checkpoints fail before any process
        with engine.children_ignore_sigint():
            self.mirror = gated(StateMirror, gate)(dht=dht, run_id=run_id)
        if served is not None:
            self.mirror.serve(served[1])
            logger.info(f"Serving checkpoint {served[0]} (collaborative step {served[1].step}) to peers that join")
        self._thread = threading.Thread(target=self._loop, name="trahiv-state-keeper", daemon=True)
        self._thread.start()

    def _newest_checkpoint(self) -> tuple[Path, SwarmState] | None:
        """The newest checkpoint in checkpoint_dir and its state, checked against this run and model."""
        newest = latest_checkpoint(self.config.checkpoint_dir)
        if newest is None:
            return None
        checkpoint = load_checkpoint(newest)
        if checkpoint.run_id and checkpoint.run_id != self.run_id:
            raise ValueError(
                f"{newest} is a checkpoint of run {checkpoint.run_id!r}, not {self.run_id!r}: choose another "
                "checkpoint directory, or start without resuming (--no-resume)"
            )
        state = checkpoint.swarm_state()
        self._check_model(state)
        return newest, state

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        for thread in (self._thread, self._upload):
            if thread is not None:
                thread.join(timeout)
        if self.mirror is not None:
            self.mirror.shutdown()
            self.mirror = None

    @property
    def step(self) -> int | None:
        """The collaborative step of the state this peer holds (None before the first)."""
        state = self.mirror.state if self.mirror is not None else None
        return None if state is None else state.step

    # --- following the swarm --------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.wait(self.config.poll_interval):
            try:
                if not self.follow_revert():
                    self.poll()
            except Exception as e:  # a bad download or a full disk must not stop the aux peer
                logger.warning(f"Could not save the swarm's state: {e!r}", exc_info=True)

    def follow_revert(self) -> bool:
        """Apply a new revert order of the swarm's moderators, if any (True if one was applied)."""
        signed = self._watcher.pending(self.applied_revert) if self._watcher is not None else None
        if signed is None:
            return False
        self.apply_revert(signed.order.revert_id, signed.order.step, grace=self._watcher.grace)
        return True

    def apply_revert(self, revert_id: int, step: int, grace: float = 0.0) -> list[Path]:
        """The swarm was reverted to `step`: move the checkpoints of later steps to `checkpoint_dir/reverted-<id>/`,
        serve the newest remaining checkpoint (or nothing), download nothing for `grace` seconds; return the new
        paths of the moved checkpoints."""
        self.applied_revert = max(self.applied_revert, revert_id)
        folder = Path(self.config.checkpoint_dir)
        later = [path for path in list_checkpoints(folder) if int(path.name.rsplit("-", 1)[1]) > step]
        moved = []
        for path in later:
            target = folder / f"reverted-{revert_id}" / path.name
            target.parent.mkdir(exist_ok=True)
            os.replace(path, target)
            moved.append(target)
        held = self.step
        if held is not None and held > step:
            self._serve_newest_left()
        self._paused_until = time.monotonic() + grace
        self._failed_step = -1
        now = self.step
        logger.warning(
            f"Revert order #{revert_id}: the swarm returns to step {step}; "
            + (f"moved {len(moved)} later checkpoint(s) to {folder / f'reverted-{revert_id}'}; " if moved else "")
            + (f"serving step {now}" if now is not None else "serving no state")
        )
        return moved

    def _serve_newest_left(self) -> None:
        """After a revert set aside the state served: serve the newest checkpoint left, or nothing."""
        remaining = latest_checkpoint(self.config.checkpoint_dir)
        if self.mirror is not None:
            if remaining is not None:
                self.mirror.serve(load_checkpoint(remaining).swarm_state())
            else:
                self.mirror.withdraw()

    def poll(self) -> Path | None:
        """If the swarm crossed a multiple of `checkpoint_every` since the state held here, download and save it."""
        if self.mirror is None:
            raise RuntimeError("StateKeeper.poll() before start()")
        if time.monotonic() < self._paused_until:
            return None
        every, held = self.config.checkpoint_every, self.step
        served = newest_served_step(self._dht, self.run_id)
        if served < 1 or (held is not None and served // every <= held // every):
            return None
        if served == self._failed_step and time.monotonic() < self._retry_at:
            return None  # the peers that declared this step did not serve it (they may have left): wait
        self._failed_step, self._retry_at = served, time.monotonic() + RETRY_SECONDS  # until this one succeeds
        raw = self.mirror.download(self.config.load_state_timeout)
        state = None if raw is None else SwarmState.from_peer(*raw, len(self.named))
        if state is None or (held is not None and state.step <= held):
            return None
        self._check_model(state)
        self.mirror.serve(state)
        path = save_checkpoint(self.config.checkpoint_dir, state, self.model, run_id=self.run_id)
        uploading = [self._uploading] if self._upload is not None and self._upload.is_alive() else []
        prune_checkpoints(self.config.checkpoint_dir, self.config.keep_checkpoints, protect=uploading)
        self.saved.append(path)
        self._failed_step = -1
        logger.info(f"Saved checkpoint {path} (collaborative step {state.step})")
        if self.config.push_to_hub:
            self._push(path)
        return path

    def _check_model(self, state: SwarmState) -> None:
        if len(state.parameters) != len(self.named):
            raise ValueError(
                f"the swarm's state has {len(state.parameters)} trainable tensors, model {self.config.model!r} "
                f"{len(self.named)}: give the auxiliary peer the trainers' model (PEFT swarms are not supported)"
            )
        for (name, param), value in zip(self.named, state.parameters, strict=True):
            if tuple(param.shape) != tuple(value.shape):
                raise ValueError(
                    f"the swarm's state does not fit model {self.config.model!r}: tensor {name} has shape "
                    f"{tuple(param.shape)} here, {tuple(value.shape)} in the swarm. Give the auxiliary peer the "
                    "trainers' model (with all parameters trainable)."
                )

    def _push(self, path: Path) -> None:
        """Upload in the background; if an upload is still running, this checkpoint is skipped (a later one goes)."""
        if self._upload is not None and self._upload.is_alive():
            logger.info(f"An upload is still running: {path.name} is not uploaded")
            return

        def upload() -> None:
            token = self.config.hub_token or os.environ.get("HF_TOKEN")
            repo = str(self.config.hub_repo)
            try:
                started = time.monotonic()
                url = push_to_hub(path, repo, token=token, private=self.config.hub_private)
                self.pushed.append(url)
                logger.info(f"Uploaded {path.name} to {repo} in {time.monotonic() - started:.1f} s: {url}")
            except Exception as e:
                logger.warning(f"Uploading {path.name} to the Hub repo {repo} failed: {e!r}")

        self._uploading = path
        self._upload = threading.Thread(target=upload, name="trahiv-hub-upload", daemon=True)
        self._upload.start()
