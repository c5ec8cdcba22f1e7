"""Hooks on a running SwarmOptimizer for trahiv.connectivity: the silence watch (never silent when a peer never
averages) and skipping parameter rounds that cannot form. They wrap hivemind 1.1.12 Optimizer internals
(`_average_gradients_and_load_into_optimizer`, `_load_local_gradients_into_optimizer`, `_update_global_epoch`,
`_maybe_schedule_state_averaging`, `TrainingStateAverager.step`)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from trahiv.connectivity import PeerView, SilenceWatch, parameter_helpers, unreachable_peers

logger = logging.getLogger("trahiv.connectivity")

__all__ = ["attach_silence_watch", "skip_state_rounds_that_cannot_form"]


def attach_silence_watch(optimizer: Any, rounds: int = 3) -> SilenceWatch:
    """Feed a SilenceWatch from a SwarmOptimizer: after each collaborative step, did gradient averaging succeed, and
    which other trainers were in the swarm (from their progress records)."""
    watch = SilenceWatch(rounds, client_mode=bool(optimizer.client_mode))
    if optimizer.auxiliary or not optimizer.use_gradient_averaging:
        return watch  # parameter averaging only (use_local_updates): rounds are rare, not watched
    outcome: dict[str, Any] = {"averaged": False, "others": {}, "called": False, "stepping": None}
    local = threading.local()  # did this thread's round fall back to local gradients
    lock = threading.Lock()  # in background mode (delay_grad_averaging) rounds end in hivemind's thread

    def others_now() -> dict[str, bool]:
        own = optimizer.dht.peer_id.to_base58()
        return {p: bool(r.client_mode) for p, r in optimizer.tracker.active_peers.items() if p != own}

    average = optimizer._average_gradients_and_load_into_optimizer
    load_local = optimizer._load_local_gradients_into_optimizer
    update_epoch = optimizer._update_global_epoch

    def observe(averaged: bool, seen: dict[str, bool]) -> None:
        others = [PeerView(peer, client) for peer, client in seen.items()]
        with lock:
            unreachable: list[str] = []
            if watch.due(averaged, others):  # split swarm? peers whose records this peer sees, unreachable
                servers = [peer.peer_id for peer in others if not peer.client_mode]
                unreachable = unreachable_peers(optimizer.dht, servers)
            watch.observe(averaged, others, unreachable)

    def averaged(*args: Any, **kwargs: Any) -> Any:  # hivemind falls back to local gradients inside, on failure
        local.fell_back = False
        seen = others_now()  # who was there when the round was due
        result = average(*args, **kwargs)
        if outcome["stepping"] == threading.get_ident():  # within the step
            outcome.update(averaged=not local.fell_back, others=seen, called=True)
        else:  # a round ending in the background, after its step (delay_grad_averaging): observed now
            observe(not local.fell_back, {**seen, **others_now()})
        return result

    def loaded_local(*args: Any, **kwargs: Any) -> Any:
        local.fell_back = True
        return load_local(*args, **kwargs)

    def updated_epoch(*args: Any, **kwargs: Any) -> Any:
        outcome.update(averaged=False, others={}, called=False, stepping=threading.get_ident())
        try:
            result = update_epoch(*args, **kwargs)
        finally:
            outcome["stepping"] = None
        if optimizer.delay_grad_averaging and not outcome["called"]:
            return result  # its round ends in the background: observed there (`averaged`)
        observe(outcome["averaged"], {**outcome["others"], **others_now()})  # (one that just left withdrew its record)
        return result

    optimizer._average_gradients_and_load_into_optimizer = averaged
    optimizer._load_local_gradients_into_optimizer = loaded_local
    optimizer._update_global_epoch = updated_epoch
    return watch


HELPER_LOOKUP_PERIOD = 5.0  # seconds between two looks for a parameter helper's announcement


def skip_state_rounds_that_cannot_form(optimizer: Any) -> None:
    """Parameter averaging needs a group leader that accepts connections: a trainer not in client mode, or an
    auxiliary peer that announced itself as a parameter helper (`trahiv aux --average`, trahiv.connectivity). With
    every trainer in client mode and no helper, hivemind 1.1.12 still tried every `average_state_every` steps: 30 s
    lost each time and an ERROR with a traceback (`Averaging step failed: could not find a group`). Such rounds are
    skipped, said once (INFO)."""
    if optimizer.auxiliary:
        return
    step, schedule = optimizer.state_averager.step, optimizer._maybe_schedule_state_averaging
    said = {"skipped": False}
    helper = {"present": False, "next_look": 0.0}

    def helper_present(deciding: bool) -> bool:
        # an answer "no helper" is looked up again before a round is skipped on it: a trainer that looked as the
        # helper started skipped the helper's first parameter round on an answer 3 s old (a clean-clone run)
        if time.monotonic() >= helper["next_look"] or (deciding and not helper["present"]):
            helper["next_look"] = time.monotonic() + HELPER_LOOKUP_PERIOD
            try:
                helper["present"] = bool(parameter_helpers(optimizer.dht, optimizer.run_id))
            except Exception as e:  # a DHT hiccup: keep the last answer
                logger.debug(f"Looking for a parameter helper failed: {e!r}")
        return bool(helper["present"])

    def cannot_form(deciding: bool = False) -> bool:
        records = optimizer.tracker.active_peers.values()
        all_clients = bool(records) and optimizer.client_mode and all(record.client_mode for record in records)
        return all_clients and not helper_present(deciding)

    def state_step(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("averaging_round") and cannot_form(deciding=True):
            control = kwargs.pop("averaging_control", None)
            if control is not None and not control.done():
                control.cancel()
            kwargs.update(averaging_round=False, averaging_opts=None)
            if not said["skipped"]:
                said["skipped"] = True
                logger.info(
                    "Skipping parameter averaging: every trainer is in client mode and no auxiliary peer leads "
                    "parameter rounds (`trahiv aux --average` does), so no group can form; trainers stay in step "
                    "through complete gradient rounds"
                )
        return step(*args, **kwargs)

    def maybe_schedule() -> None:
        if not cannot_form():
            schedule()

    optimizer.state_averager.step = state_step
    optimizer._maybe_schedule_state_averaging = maybe_schedule
