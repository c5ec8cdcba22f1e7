"""A gradient round's groupmates are told as it begins, so that a peer waiting at its share begins too, at once.

A peer that computed its share of a step waits for the others' progress reports, which it reads from the DHT every
`PROGRESS_RECHECK_PERIOD` (trahiv.engine.optimizer), and begins the step's gradient round when they reach the target.
Each peer reads at its own moments: the first to see the step complete begins its round, the others up to a period
(and a read) later, and a ring round goes at the pace of its last peer to begin. In benchmarks/averaging_round.py
(4 peers, 100 Mbit/s links) trahiv's 8-bit rounds took 1.20x the bound against 1.15x for the bare ring with a common
start, the difference the peers' start skew (~0.09 s); a read made once the first peer's round filled the links took
10-60 ms more.

As its gradient round begins, an averager tells each groupmate, with one small message carrying the group's ID
(`TellsGroupmates`), before its tensors go (they fill the links' queues). A groupmate that found that group and
awaits its step's trigger marks the step: one byte that trahiv adds to the shared buffer of hivemind's `StepControl`
(`told`), which its trainer looks at while it waits at its share (SwarmOptimizer._until_told). The trainer then takes
the step as complete (`SwarmProgressTracker.told_complete`): the groupmate began because the reports it read reached
the target. This peer's weight caps for the round use the records as it last read them (`reported_sample_caps`
extrapolates them at the rates they report). A message counts only where its group is this step's found group, and
only a member knows the group's ID (its leader draws it at random); it does not trigger anything in the averager,
whose owner still does. A groupmate that never hears it (an older peer without the handler, a lost message) reads at
its period, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import torch
from hivemind.averaging.allreduce import AveragingMode
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2

from trahiv.engine import fixes

logger = logging.getLogger("trahiv.averaging")

__all__ = ["TOLD", "TellsGroupmates", "install", "told"]

TOLD = 18  # the byte trahiv adds to hivemind's StepControl buffer (bytes 0-17 in hivemind 1.1.12): a groupmate began
TELL_TIMEOUT = 2.0  # seconds a groupmate may take to acknowledge the message (it is only a hint: no retry)
TELL_FIRST_S = 0.05  # seconds the round waits for the acknowledgements before it sends its tensors
TELLING: set[asyncio.Task] = set()  # (in an averager process) messages on their way, marks awaiting their group
TOLD_WAIT_S, TOLD_POLL_S = 1.0, 0.01  # a message for a group not found yet, while this averager searches: waited for
TOLD_GROUPS_KEPT = 8  # groups whose rounds this averager was told of, kept so that it does not tell them again


def install() -> None:
    """Give every StepControl made from now on a shared buffer one byte longer, for `told` (idempotent)."""
    from hivemind.averaging.control import StepControl

    if getattr(StepControl.__init__, "_trahiv_told", False):
        return
    init = StepControl.__init__

    def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        init(self, *args, **kwargs)
        buffer = torch.zeros([TOLD + 1], dtype=torch.uint8)
        buffer[:TOLD] = self._shared_buffer[:TOLD]
        self._shared_buffer = buffer.share_memory_()  # (the trainer's copy and the averager's: one buffer)

    __init__._trahiv_told = True  # type: ignore[attr-defined]
    fixes._replace(StepControl, "__init__", __init__)


def told(control: Any) -> bool:
    """Whether a groupmate told this step's averager that the round of the group it found began."""
    buffer = getattr(control, "_shared_buffer", None)
    return buffer is not None and len(buffer) > TOLD and bool(buffer[TOLD])


class TellsGroupmates:
    """Mixin for a trahiv averager (in its process): tells the groupmates as a round begins (`tell_groupmates`), and
    marks the step whose found group a groupmate says began (`rpc_trahiv_round_began`)."""

    _matchmaking: Any
    _p2p: Any
    peer_id: PeerID
    prefix: str

    async def tell_groupmates(self, group_info: Any) -> None:
        """Tell every other member of `group_info` that this averager's round of it begins, unless a groupmate told
        this averager first (it told them all). The messages go before the round's tensors, which fill the links'
        queues: sent beside them, they arrived after every groupmate had begun (4 peers over 100 Mbit/s links with
        200 ms tbf queues, benchmarks/averaging_round.py). Waits for the acknowledgements up to TELL_FIRST_S."""
        if group_info.group_id in self.__dict__.get("_trahiv_told_groups", ()):
            return
        tasks = [
            asyncio.create_task(self._tell(peer, group_info.group_id))
            for peer, gathered in zip(group_info.peer_ids, group_info.gathered, strict=True)
            if peer != self.peer_id and self._reachable(gathered)
        ]
        for task in tasks:
            TELLING.add(task)
            task.add_done_callback(TELLING.discard)
        if tasks:
            await asyncio.wait(tasks, timeout=TELL_FIRST_S)

    def _reachable(self, gathered: bytes) -> bool:
        """Whether a groupmate can be asked anything: not a client (hivemind's gathered data `[bandwidth, mode,
        user data]`). A client accepts no incoming stream; a message to it would wait for a dial that fails."""
        try:
            return AveragingMode(self.serializer.loads(gathered)[1]) != AveragingMode.CLIENT  # type: ignore[attr-defined]
        except Exception:
            return False

    async def _tell(self, peer: PeerID, group_id: bytes) -> None:
        try:
            stub = type(self).get_stub(self._p2p, peer, namespace=self.prefix)  # type: ignore[attr-defined]
            message = averaging_pb2.AveragingData(group_id=group_id)
            await asyncio.wait_for(stub.rpc_trahiv_round_began(message), TELL_TIMEOUT)
        except Exception as e:  # a hint: a peer without the handler, or gone, reads the progress at its period
            logger.debug(f"{self} - could not tell {peer} that round {group_id.hex()[:8]} began: {e!r}")

    async def rpc_trahiv_round_began(
        self, request: averaging_pb2.AveragingData, context: P2PContext
    ) -> averaging_pb2.AveragingData:
        """A groupmate began its round of `request.group_id`: if this averager found that group and its step awaits
        the trigger, mark the step (`told`). A group this averager's search has not found yet (the leader's message
        with it may be on its way) is waited for in the background, up to TOLD_WAIT_S while the search goes on, and the
        message acknowledged at once: the teller holds its tensors until the acknowledgements come (`tell_groupmates`),
        and an acknowledgement sent only once the group was found held it for all of TELL_FIRST_S, its ring then
        beginning last (benchmarks/averaging_round.py, stop 64). Only a member of the group knows its ID (the leader
        draws it at random)."""
        if self._found(request.group_id)[0] is None and self._matchmaking.is_looking_for_group:
            task = asyncio.create_task(self._mark_once_found(request.group_id, context.remote_id))
            TELLING.add(task)
            task.add_done_callback(TELLING.discard)
        else:
            self._mark(request.group_id, context.remote_id)
        return averaging_pb2.AveragingData()

    def _found(self, group_id: bytes) -> tuple[Any, Any]:
        """(the step, its `begun` event) of the group this averager's search found with this ID, or (None, None)."""
        found: dict[bytes, tuple[Any, Any]] = getattr(self._matchmaking, "_trahiv_found_groups", {})
        return found.get(group_id, (None, None))

    async def _mark_once_found(self, group_id: bytes, teller: PeerID) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + TOLD_WAIT_S
        while self._found(group_id)[0] is None and self._matchmaking.is_looking_for_group and loop.time() < deadline:
            await asyncio.sleep(TOLD_POLL_S)
        self._mark(group_id, teller)

    def _mark(self, group_id: bytes, teller: PeerID) -> None:
        control, begun = self._found(group_id)
        if control is not None and not begun.is_set() and not control.done():
            with contextlib.suppress(Exception):  # (a buffer without the byte: a StepControl made before `install`)
                if not told(control):
                    control._shared_buffer[TOLD] = 1
                    logger.debug(f"{self} - {teller} began round {group_id.hex()[:8]}")
            kept = self.__dict__.setdefault("_trahiv_told_groups", {})  # (an ordered set)
            kept[group_id] = None
            while len(kept) > TOLD_GROUPS_KEPT:
                del kept[next(iter(kept))]
