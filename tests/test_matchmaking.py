"""Matchmaking on a busy machine: a leader that answers a join request late is asked again (trahiv.engine.fixes, 6).

Three averagers in their own processes on loopback: a leader and two followers in client mode. The leader holds its
first answer to one follower 1.5 s, longer than the followers' request_timeout (1 s); the other follower joins at once.
With hivemind 1.1.12 alone, the late follower never asks that leader again for this declaration: the leader assembles
its group without it when the declared time runs out (the aux peer's gradient rounds in CI, where a trainer then
stepped alone). With the fix it asks again at once and the group holds all three.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading
from contextlib import ExitStack
from typing import Any, AsyncIterator  # noqa: UP035  (hivemind finds streaming RPCs by typing.AsyncIterator)

import hivemind
import torch
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2

from trahiv import engine
from trahiv.engine.averagers import ReportingAverager

engine.apply()

FIRST_ANSWER_DELAY_S = 1.5
REQUEST_TIMEOUT_S = 1.0
LEADER_DECLARES_S = 4.0  # the leader assembles what it has once its declared time runs out


def leader_class(slow_peer: bytes, requests: Any) -> type[ReportingAverager]:
    class LateLeader(ReportingAverager):
        async def rpc_join_group(
            self, request: averaging_pb2.JoinRequest, context: P2PContext
        ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
            if context.remote_id.to_bytes() == slow_peer:
                with requests.get_lock():
                    requests.value += 1
                    first = requests.value == 1
                if first:
                    await asyncio.sleep(FIRST_ANSWER_DELAY_S)  # the event loop of a leader on a busy machine
            async for message in super().rpc_join_group(request, context):
                yield message

    return LateLeader


def run_round(stack: ExitStack) -> tuple[list[Any], int]:
    """One round: leader, prompt follower, late-answered follower; (step results, the late one's join requests)."""
    dhts = [hivemind.DHT(start=True, nat_port_map=False)]
    dhts += [hivemind.DHT(start=True, nat_port_map=False, initial_peers=dhts[0].get_visible_maddrs()) for _ in "ab"]
    for dht in dhts:
        stack.callback(dht.shutdown)
    requests = mp.Value("i", 0)
    common = dict(prefix="late_leader", min_group_size=2, request_timeout=REQUEST_TIMEOUT_S, start=True)
    averagers = [
        leader_class(dhts[2].peer_id.to_bytes(), requests)(
            [torch.zeros(4)], dht=dhts[0], min_matchmaking_time=LEADER_DECLARES_S, **common
        ),
        *(
            ReportingAverager(
                [torch.full((4,), float(rank))], dht=dhts[rank], min_matchmaking_time=6.0, client_mode=True, **common
            )
            for rank in (1, 2)
        ),
    ]
    for averager in averagers:
        stack.callback(averager.shutdown)
    results: list[Any] = [None] * 3

    def step(rank: int) -> None:
        try:
            results[rank] = averagers[rank].step(timeout=12, allow_retries=False)
        except Exception as e:
            results[rank] = e

    threads = [threading.Thread(target=step, args=(rank,), daemon=True) for rank in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return results, requests.value


def test_a_follower_asks_a_late_leader_again_and_gets_into_its_group():
    with ExitStack() as stack:
        results, requests = run_round(stack)
    assert requests >= 2, requests  # it timed out, then asked again
    assert all(isinstance(result, dict) and len(result) == 3 for result in results), results


def test_without_the_fix_the_late_follower_is_left_out():
    """The control: hivemind's own request, the same delays."""
    patched = Matchmaking._request_join_group
    Matchmaking._request_join_group = patched.__wrapped__  # the averager processes fork with hivemind's
    try:
        with ExitStack() as stack:
            results, requests = run_round(stack)
    finally:
        Matchmaking._request_join_group = patched
    # (it may ask once more, rejected: on a busy machine it can still be searching when the leader's first declaration
    # ends, and the leader then assembles or declares anew; clean-clone run M, 2026-11-25)
    assert requests >= 1, requests
    assert isinstance(results[0], dict) and len(results[0]) == 2, results  # the leader and the prompt follower
    assert not isinstance(results[2], dict), results
