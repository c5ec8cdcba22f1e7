"""Verbs on a running collaborative optimizer and on served state, for the rest of trahiv: download a checked state,
replace the state at a step (a revert, a checkpoint), set the step, serve a state without training (`StateMirror`).

Each touches hivemind 1.1.12's TrainingStateAverager / Optimizer internals (named where they are used).
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable
from itertools import chain
from typing import Any, Protocol

import torch
from hivemind.compression import CompressionInfo
from hivemind.compression.base import TensorRole
from hivemind.optim.state_averager import TrainingStateAverager, load_optimizer_state
from hivemind.p2p import PeerID
from hivemind.utils.mpfuture import MPFuture

from trahiv.engine import fixes
from trahiv.engine.averagers import CheckedStateDownload

logger = logging.getLogger("trahiv.engine.state")

__all__ = [
    "ServedState",
    "StateMirror",
    "catch_up_scheduler",
    "download_state",
    "leave_rounds",
    "load_state",
    "reset_scheduler",
    "set_step",
]


class ServedState(Protocol):
    """What a StateMirror serves (trahiv.auxiliary.checkpoints.SwarmState is one)."""

    step: int
    parameters: list[torch.Tensor]
    optimizer_tensors: list[torch.Tensor]

    @property
    def tensors(self) -> list[torch.Tensor]: ...

    def peer_metadata(self, group_bits: str) -> dict[str, Any]: ...


def set_step(opt: Any, step: int) -> None:
    """Set the collaborative step of an optimizer that has not trained yet (resume from this peer's checkpoint), and
    its LR schedule with it."""
    opt.state_averager.local_epoch = step
    catch_up_scheduler(opt)


def catch_up_scheduler(opt: Any) -> None:
    """Bring hivemind's LR scheduler to the optimizer's collaborative step (TrainingStateAverager._update_scheduler)."""
    opt.state_averager._update_scheduler()


def leave_rounds(opt: Any) -> None:
    """Leave the averaging rounds scheduled with the old state (one already running is let finish, briefly), and
    finish delayed updates."""
    for name in ("scheduled_grads", "scheduled_state"):
        control = getattr(opt, name)
        if control is not None and not control.done():
            if control.triggered:
                try:
                    control.result(timeout=10.0)
                except Exception as e:
                    logger.debug(f"An averaging round ended with {e!r}")
            else:
                control.cancel()
        setattr(opt, name, None)
    opt.state_averager.step(wait_for_delayed_updates=True)


def download_state(
    opt: Any,
    accept: Callable[[str, Any], bool],
    check: Callable[[dict, list[torch.Tensor], int], str | None],
    *,
    what: str,
    attempts: int = 4,
) -> tuple[dict, list[torch.Tensor]] | None:
    """A state served by a peer that `accept(peer_id, declared_priority)`, checked: the averager's checks (its wire
    protocol, shapes against this optimizer's, finite values, an optimizer state that fits this optimizer: its
    `state_rejection`), then `check(metadata, tensors, num_parameters)` (a reason to refuse, or None). Up to
    `attempts` refused states, each from another peer."""
    averager = opt.state_averager
    timeout = min(float(opt.load_state_timeout), 120.0)
    num_parameters = sum(len(group["params"]) for group in averager.optimizer.param_groups)
    skip: set[str] = set()
    for _ in range(attempts):
        found = opt.dht.get(f"{opt.run_id}_state_averager.all_averagers", latest=True)
        declared = found.value if found is not None and isinstance(found.value, dict) else {}
        allowed = 0
        for peer, entry in declared.items():
            peer_id = str(PeerID(peer))
            if accept(peer_id, getattr(entry, "value", None)):
                allowed += peer_id not in skip
            else:
                skip.add(peer_id)
        if not allowed:
            return None
        future: MPFuture = MPFuture()
        request = dict(timeout=timeout, future=future, skip=sorted(skip))
        averager._outer_pipe.send(  # CheckedStateDownload._load_state_from_peers, one peer at a time
            ("_load_state_from_peers", [], request)
        )
        loaded = future.result(timeout=timeout)
        if loaded is None:
            return None
        metadata, tensors, peer = loaded
        reason = averager.state_rejection(metadata, tensors) or check(metadata, tensors, num_parameters)
        if reason is None:
            return metadata, tensors
        logger.warning(f"{what}: rejected the state served by peer {peer}: {reason}")
        skip.add(peer)
    return None


def load_state(opt: Any, metadata: dict, tensors: list[torch.Tensor], *, step: int) -> None:
    """Replace parameters, optimizer state, step and LR schedule by the downloaded ones; drop accumulated gradients.
    (hivemind's own download refuses a state older than the local one, and its schedule only steps forward.)"""
    averager = opt.state_averager
    parameters = tuple(p for group in averager.optimizer.param_groups for p in group["params"])
    main = tuple(chain(parameters, averager.extra_tensors))
    with fixes.changing_state(), opt.tracker.pause_updates():
        with torch.no_grad(), averager.lock_averaged_tensors:
            load_optimizer_state(averager.optimizer, metadata["optimizer_metadata"], tensors[len(main) :])
            for local, loaded in zip(main, tensors[: len(main)], strict=True):
                local.copy_(loaded)
        if averager.offload_optimizer:
            averager._apply_optimizer_parameters_()
        if not averager.reuse_tensors:
            averager._load_local_tensors_into_averager_()
        averager.local_epoch = step
        reset_scheduler(averager.scheduler, step)
        if opt.use_gradient_averaging:
            opt.grad_averager.reset_accumulated_grads_()
        tracker = opt.tracker
        tracker.global_progress.epoch, tracker.global_progress.samples_accumulated = step, 0
        tracker.report_local_progress(step, 0)
        tracker.fetched_global_progress_this_epoch.clear()
    opt._should_check_synchronization_on_update = False
    if not opt.client_mode:
        averager.state_sharing_priority = step
        if opt.use_gradient_averaging:
            opt.grad_averager.state_sharing_priority = step
    opt.tracker.refresh_now()


def reset_scheduler(scheduler: Any, step: int) -> None:
    """Set an LR scheduler to where hivemind's would be at collaborative step `step` (it only ever steps forward)."""
    if scheduler is None:
        return
    if not hasattr(scheduler, "last_epoch") or not hasattr(scheduler, "_step_count"):
        raise TypeError(f"cannot rewind LR scheduler {type(scheduler).__name__}: it has no last_epoch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()": intended here
        scheduler.last_epoch, scheduler._step_count = step - 1, step
        scheduler.step()


class StateMirror(CheckedStateDownload):
    """A state averager that averages nothing: it downloads the swarm's state (checked like a trainer's download) and
    serves the state it holds under the trainers' `{run_id}_state_averager` prefix, in their format."""

    def __init__(self, *, dht: Any, run_id: str, **kwargs: Any):
        self._lock = threading.Lock()
        self._state: ServedState | None = None
        super().__init__(
            averaged_tensors=[torch.zeros(1)],  # never averaged: this peer only downloads and serves state
            dht=dht,
            prefix=f"{run_id}_state_averager",
            allow_state_sharing=False,
            start=True,
            **kwargs,
        )

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        return TrainingStateAverager._get_handle_name(namespace, method_name)  # the trainers' RPC names

    @property
    def state(self) -> ServedState | None:
        with self._lock:
            return self._state

    def serve(self, state: ServedState) -> None:
        """Hold `state` and offer it to peers, with its step as priority."""
        with self._lock:
            self._state = state
        if not self.client_mode:
            self.allow_state_sharing = True
            self.state_sharing_priority = state.step

    def withdraw(self) -> None:
        """Hold and offer no state any more."""
        with self._lock:
            self._state = None
        if not self.client_mode:
            self.allow_state_sharing = False

    def get_current_state(self) -> tuple[Any, list[torch.Tensor], list[Any]]:
        """What a peer downloading from this one receives (runs in this process, on the averager's request)."""
        state = self.state
        if state is None:
            return None, [], []  # the peer asks the next one
        roles = [TensorRole.PARAMETER] * len(state.parameters) + [TensorRole.OPTIMIZER] * len(state.optimizer_tensors)
        tensors = state.tensors
        infos = [
            CompressionInfo.from_tensor(t, key=i, role=role)
            for i, (t, role) in enumerate(zip(tensors, roles, strict=True))
        ]
        return state.peer_metadata(self.get_group_bits()), tensors, infos

    def _expected_state_shapes(self) -> list[tuple] | None:
        state = self.state
        return None if state is None else [tuple(t.shape) for t in state.tensors]

    def download(self, timeout: float) -> tuple[Any, list[torch.Tensor]] | None:
        """The newest state another peer serves, as (metadata, tensors) (None if nobody serves one that passes the
        checks)."""
        return self.load_state_from_peers(timeout=timeout)
