"""No silent averaging failures: averagers in their own processes on loopback, faults injected by an object.

- a complete round is reported complete, with every value averaged;
- a sender whose stream to one reducer breaks: the round is reported partial by that sender (which reducer, what
  fraction kept local values) and by the reducer (whose contribution is missing); the values kept are the local ones;
- a peer counted in the group that never starts: the others finish in seconds (payload-based deadlines), report it.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import multiprocessing as mp
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import AllreduceException
from swarm_helpers import local_dht, step_together

from trahiv import engine
from trahiv.averaging.partial import Deadlines, RoundReport
from trahiv.engine.averagers import PartialRoundRunner, ReportingAverager, ReportingMixin
from trahiv.engine.diloco import DiLoCoRoundRunner
from trahiv.engine.exact import ExactAverager

engine.apply()

SIZE = 3 * 40_000  # values averaged per peer (several parts per reducer with part_size_bytes below)
PART_BYTES = 2**15
# loopback, and trahiv's default floor: a 1 s floor timed out between two healthy peers on CI's busy 2 cores
FAST = Deadlines(assumed_bandwidth=50e6, floor=5.0, safety=4.0)


class Fault(enum.Enum):
    NONE = "none"
    BREAK_STREAM = "break_stream"  # stop sending to one reducer after its first part, with an error
    STALL = "stall"  # join the group, then never run the all-reduce
    SERVE_LATE_AND_LEAVE = "serve_late_and_leave"  # serve the parts it reduces 1 s late; leave once its round is over


class FaultyRunner(PartialRoundRunner):
    """Breaks this peer's stream to the next peer in the group after one part."""

    async def _generate_input_for_peer(self, peer_index: int):
        me = self.ordered_peer_ids.index(self.peer_id)
        sent = 0
        async for message in super()._generate_input_for_peer(peer_index):
            if peer_index == (me + 1) % self.group_size and sent == 1:
                raise AllreduceException("injected fault: stream broken")
            yield message
            sent += 1


class LateServingRunner(PartialRoundRunner):
    """Serves the last averaged part it reduces for another peer SERVE_DELAY_S late: its own round (every part it
    needs is in) ends before that part reaches the other peer."""

    async def rpc_aggregate_part(self, stream, context):
        parts = self.tensor_part_container.num_parts_by_peer[self.ordered_peer_ids.index(self.peer_id)]
        served = 0
        async for message in super().rpc_aggregate_part(stream, context):
            served += 1
            if served == parts:
                await asyncio.sleep(SERVE_DELAY_S)
            yield message


SERVE_DELAY_S = 1.0
RUNNERS = {Fault.BREAK_STREAM: FaultyRunner, Fault.SERVE_LATE_AND_LEAVE: LateServingRunner}


def faulty_averager(
    fault: Fault, runner: type[PartialRoundRunner] | None = None, base: type[ReportingAverager] = ReportingAverager
) -> type[ReportingAverager]:
    class FaultyAverager(base):  # type: ignore[valid-type,misc]
        runner_cls = runner or RUNNERS.get(fault, PartialRoundRunner)

        async def _run_allreduce_inplace_(self, tensors, group_info, **kwargs):
            if fault == Fault.STALL:
                await asyncio.sleep(60)  # counted in the group, never sends nor serves its part
            return await super()._run_allreduce_inplace_(tensors, group_info, **kwargs)

    return FaultyAverager


def local_values(rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    return [torch.randn(SIZE // 3, generator=gen) + 10 * rank for _ in range(3)]


def run_round(
    stack: ExitStack,
    faults: list[Fault],
    allreduce_timeout: float = 60.0,
    auxiliary: int | None = None,
    runner: type[PartialRoundRunner] | None = None,
    base: type[ReportingAverager] = ReportingAverager,
):
    """One averaging round of len(faults) peers (peer `auxiliary` in hivemind's auxiliary mode, all with `runner` if
    given, averagers of class `base`); returns (seconds, results, reports, averagers) per peer."""
    first = stack.enter_context(local_dht())
    peers = [first] + [stack.enter_context(local_dht(first.get_visible_maddrs())) for _ in faults[1:]]
    averagers = []
    for rank, (dht, fault) in enumerate(zip(peers, faults, strict=True)):
        averager = faulty_averager(fault, runner, base)(
            local_values(rank), dht=dht, prefix="partial", target_group_size=len(faults), min_group_size=len(faults),
            min_matchmaking_time=2.0, request_timeout=1.0, part_size_bytes=PART_BYTES,
            allreduce_timeout=allreduce_timeout, deadlines=Deadlines(**vars(FAST)), auxiliary=rank == auxiliary,
            start=True,
        )  # fmt: skip
        stack.callback(averager.shutdown)
        averagers.append(averager)

    def leave(rank: int) -> None:
        if faults[rank] == Fault.SERVE_LATE_AND_LEAVE:
            averagers[rank].shutdown()

    stalled = {rank for rank, fault in enumerate(faults) if fault == Fault.STALL}  # its step ends at its shutdown
    results, seconds = step_together(averagers, [45] * len(faults), after=leave, unjoined=stalled)
    finished = [rank for rank in range(len(faults)) if rank not in stalled]
    deadline = time.monotonic() + 10  # reports cross from the averager processes
    while not all(averagers[rank].round_reports() or averagers[rank].reports for rank in finished):
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for averager in averagers:
        averager.round_reports()
    reports = [list(averager.reports) for averager in averagers]
    return seconds, results, reports, averagers


def tensors_of(averager: ReportingAverager) -> torch.Tensor:
    with averager.get_tensors() as tensors:
        return torch.cat([t.clone() for t in tensors])


def test_deadlines_follow_payload_and_measured_bandwidth():
    deadlines = Deadlines(assumed_bandwidth=1e6, floor=2.0, safety=3.0)
    assert deadlines.round_timeout(1_000_000, 4) == pytest.approx(4.0 + 3.0 * 1.5)
    deadlines.observe(payload=1_000_000, group_size=4, seconds=0.15)  # 1.5 MB in 0.15 s: 10 MB/s
    assert deadlines.bandwidth == pytest.approx(1e7)
    assert deadlines.chunk_timeout(2**19, 4) == pytest.approx(2.0 + 3.0 * 2 * 2**19 * 3 / 1e7)
    deadlines.observe_timeout()
    assert deadlines.bandwidth == pytest.approx(5e6)
    with pytest.raises(ValueError, match="floor"):
        Deadlines(floor=0)


def test_report_describes_peers_and_fractions():
    report = RoundReport(("a", "b"), 1000, 1.0, 10, local_fallback={"b": 250}, missing_senders={"b": 500})
    assert report.status == "partial" and not report.complete and report.averaged_fraction == 0.75
    assert "peer b did not return 25.0%" in report.describe() and "missing from 50.0%" in report.describe()
    assert RoundReport(("a", "b"), 1000, 1.0, 10).complete
    assert RoundReport(("a", "b"), 1000, 1.0, 10, error="x").status == "failed"


def _report_many(reporter: ReportingMixin, count: int, sent: mp.Event, drained: mp.Event) -> None:
    """An averager process's side: `count` reports, while the process that reads them does not read."""
    peers = tuple(f"12D3KooW{i:044d}" for i in range(8))  # (a report of 8 peers: ~1 KB pickled)
    for i in range(count):
        reporter._send_report(RoundReport(peers, 1000, 0.5, 10, local_fallback={peers[i % 8]: i}))
    sent.set()
    drained.wait(60)  # (its thread forwards the reports while it lives)


def test_reports_never_block_the_averager_process_when_nobody_reads():
    """A report goes through a pipe: written from the averager's event loop, the 65th KB blocked it mid-round until the
    trainer read, and a 4-peer swarm whose trainers read the parameter rounds' reports only when logging hung at step
    880 (each averager stuck in a round, each trainer waiting for it). Now the averager process sends 500 reports (over
    64 KB) without a reader, and every one arrives, in order, once read; while the pipe has room a report is readable
    as soon as it is sent."""

    class Reporter(ReportingMixin):
        pass

    reporter, context = Reporter(), mp.get_context("fork")
    reporter._init_reporting(None)
    first = RoundReport(("a", "b"), 1000, 0.5, 10)
    reporter._send_report(first)  # while the pipe has room, a report is there as soon as it is sent (the trainer
    assert reporter.round_reports() == [first]  # reads its gradient round's report right after the step returns)

    sent, drained = context.Event(), context.Event()
    child = context.Process(target=_report_many, args=(reporter, 500, sent, drained), daemon=True)
    child.start()
    try:
        assert sent.wait(20), "the averager process blocked on its reports while nobody read them"
        reports: list[RoundReport] = []
        deadline = time.monotonic() + 20
        while len(reports) < 500 and time.monotonic() < deadline:
            reports += reporter.round_reports()
            time.sleep(0.01)
        assert [sum(r.local_fallback.values()) for r in reports] == list(range(500))
        assert reporter.round_counts == {"complete": 1, "partial": 500, "failed": 0}
    finally:
        drained.set()
        child.join(10)
        if child.is_alive():
            child.kill()


def test_complete_round_is_reported_complete():
    with ExitStack() as stack:
        _, results, reports, averagers = run_round(stack, [Fault.NONE] * 3)
        expected = torch.stack([torch.stack(local_values(r)) for r in range(3)]).mean(0).reshape(-1)
        for rank in range(3):
            assert isinstance(results[rank], dict), results[rank]
            assert [r.status for r in reports[rank]] == ["complete"], reports[rank]
            assert torch.allclose(tensors_of(averagers[rank]), expected, atol=1e-5)
            assert averagers[rank].round_counts == {"complete": 1, "partial": 0, "failed": 0}


def test_auxiliary_peer_reduces_a_share_and_sends_nothing():
    """hivemind 1.1.12 drops the group's modes before the all-reduce: its auxiliary peers send their own tensors with
    weight 0 and receive the average. trahiv passes the modes on: the aux peer reduces a share of every tensor, sends
    nothing of its own and receives nothing (its tensors stay as they were)."""
    with ExitStack() as stack:
        _, results, reports, averagers = run_round(stack, [Fault.NONE] * 3, auxiliary=2)
        expected = torch.stack([torch.stack(local_values(r)) for r in range(2)]).mean(0).reshape(-1)
        for rank in range(3):
            assert isinstance(results[rank], dict), results[rank]
            assert [(r.status, len(r.peers)) for r in reports[rank]] == [("complete", 3)], reports[rank]
        for rank in range(2):
            assert torch.allclose(tensors_of(averagers[rank]), expected, atol=1e-5)
        assert torch.equal(tensors_of(averagers[2]), torch.cat(local_values(2)))


def stream_end_recorder(path: Path, hivemind_sender: bool) -> type[PartialRoundRunner]:
    """A runner that appends to `path`, for every stream it served as a reducer, how the stream ended: "closed by the
    sender" (cancelled while it waited after its last part) or "ended by the reducer" (it stopped waiting), and how
    long after its last part (`linger`, against its `reducer_timeout`). With `hivemind_sender`, its sending side is
    hivemind's (reads until the reducer closes, or until its own read timeout)."""

    class StreamEndRecorder(PartialRoundRunner):
        async def rpc_aggregate_part(self, stream, context):
            parts, ended, last = 0, "ended by the reducer", time.monotonic()
            try:
                async for message in super().rpc_aggregate_part(stream, context):
                    yield message
                    parts, last = parts + 1, time.monotonic()
            except (asyncio.CancelledError, GeneratorExit):
                ended = "closed by the sender"
                raise
            finally:
                linger = time.monotonic() - last
                line = {"ended": ended, "parts": parts, "linger": linger, "timeout": self.reducer_timeout}
                with open(path, "a") as f:
                    f.write(json.dumps(line) + "\n")

        async def _exchange_with_reducer(self, peer_id):
            if hivemind_sender:
                return await AllReduceRunner._communicate_with_peer(self, peer_id)
            return await super()._exchange_with_reducer(peer_id)

    return StreamEndRecorder


@pytest.mark.parametrize("hivemind_sender", [False, True], ids=["trahiv", "hivemind"])
def test_the_sender_closes_the_stream_once_it_has_every_part(tmp_path, hivemind_sender):
    """A reducer's p2pd resets the stream when the reducer's handler returns, and a reset drops what the sender's
    p2pd had not yet passed on (seen on busy CPUs: "sent 21 parts, but we expected 27", a partial round). trahiv's
    reducer keeps the stream open after its last part until the sender, which knows how many parts to expect, closes
    it. Control: hivemind's sender waits for the reducer to close instead, so the stream lingers for a whole timeout
    (the reducer's wait and hivemind's read timeout are both `reducer_timeout`: on a busy machine either side may be
    the one that gives up)."""
    path = tmp_path / "ends.jsonl"
    with ExitStack() as stack:
        _, results, reports, _ = run_round(stack, [Fault.NONE] * 3, runner=stream_end_recorder(path, hivemind_sender))
        for rank in range(3):
            assert isinstance(results[rank], dict), results[rank]
            assert [r.status for r in reports[rank]] == ["complete"], reports[rank]
        deadline = time.monotonic() + 20  # handlers end after the round (when closed, or when they time out)
        while time.monotonic() < deadline and len(path.read_text().splitlines() if path.exists() else []) < 6:
            time.sleep(0.1)
    ends = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(ends) == 3 * 2 and all(end["parts"] > 0 for end in ends), ends  # every reducer served both others
    if hivemind_sender:
        assert all(end["linger"] > 0.9 * end["timeout"] for end in ends), ends
    else:
        assert {end["ended"] for end in ends} == {"closed by the sender"}, ends
        assert all(end["linger"] < 0.5 * end["timeout"] for end in ends), ends


REFUSED_CALLS = 1000  # parts for an unknown group, one after the other (without the wait: 2-8% lost their answer)


def refusals_answered(stack: ExitStack) -> dict[str, int]:
    """A reducer in its own process, not in any group, and REFUSED_CALLS parts for an unknown group sent to it from this
    process, one call after the other (each reads the first answer, as a sender does): what each call got back."""
    from hivemind.proto import averaging_pb2

    server = stack.enter_context(local_dht())
    client = stack.enter_context(local_dht(server.get_visible_maddrs()))
    reducer = ReportingAverager([torch.zeros(4)], dht=server, prefix="refused", start=True)
    stack.callback(reducer.shutdown)
    handle = ReportingAverager._get_handle_name("refused", "rpc_aggregate_part")
    answers: dict[str, int] = {}

    async def one(part):  # a sender's stream: its part, then its end
        yield part

    async def calls() -> None:
        p2p = await client.replicate_p2p()
        for _ in range(REFUSED_CALLS):
            part = averaging_pb2.AveragingData(code=averaging_pb2.PART_FOR_AVERAGING, group_id=b"x" * 20)
            try:
                stream = await p2p.iterate_protobuf_handler(server.peer_id, handle, one(part), type(part))
                answer = averaging_pb2.MessageCode.Name((await asyncio.wait_for(anext(stream), 10)).code)
            except Exception as e:  # the stream ended without an answer (StopAsyncIteration, BrokenPipeError)
                answer = type(e).__name__
            answers[answer] = answers.get(answer, 0) + 1

    asyncio.run(calls())
    return answers


def test_a_refused_part_always_gets_its_answer():
    """A reducer that refuses a part (here BAD_GROUP_ID: a group it does not run) reads the sender's stream to its end
    and waits for the sender to close it (at most 2 s) before its handler returns
    (`trahiv.engine.fixes.until_the_sender_ends`): returning at once, the answer was lost with the stream in 2-8% of the
    calls (idle and beside busy cores); reading to the end of stream alone, once in about 17,000 calls."""
    with ExitStack() as stack:
        assert refusals_answered(stack) == {"BAD_GROUP_ID": REFUSED_CALLS}


def test_without_the_wait_some_refusals_are_lost(monkeypatch):
    """The control: the handler returns as soon as it answered (hivemind's own way)."""
    from trahiv.engine import fixes

    async def no_wait(stream) -> None:
        return None

    monkeypatch.setattr(fixes, "until_the_sender_ends", no_wait)  # (the reducer's process forks with it)
    with ExitStack() as stack:
        answers = refusals_answered(stack)
    assert sum(answers.values()) == REFUSED_CALLS and answers.get("BAD_GROUP_ID", 0) < REFUSED_CALLS, answers


def test_broken_stream_is_reported_partial_and_keeps_local_values(capfd):
    with ExitStack() as stack:
        # the averager processes (forked) write trahiv's warnings to stderr, where capfd reads them
        handler = logging.StreamHandler(sys.stderr)
        logging.getLogger("trahiv.averaging").addHandler(handler)
        stack.callback(logging.getLogger("trahiv.averaging").removeHandler, handler)
        seconds, _, reports, averagers = run_round(stack, [Fault.BREAK_STREAM, Fault.NONE, Fault.NONE])
        assert max(seconds) < 20, seconds
        ids = [a.peer_id.to_base58() for a in averagers]
        broken = reports[0][-1]
        assert broken.status == "partial", broken
        assert set(broken.local_fallback) == {broken.peers[(broken.peers.index(ids[0]) + 1) % 3]}
        victim = ids.index(next(iter(broken.local_fallback)))
        fraction = sum(broken.local_fallback.values()) / broken.total_values
        assert 0.2 < fraction < 0.5, fraction  # that reducer's share of the values (about a third)
        # the values that reducer did not return are exactly the local ones
        mine, local = tensors_of(averagers[0]), torch.cat(local_values(0))
        assert int((mine == local).sum()) == sum(broken.local_fallback.values())
        # the reducer reports the sender whose contribution it lacks
        reducer_report = reports[victim][-1]
        assert reducer_report.status == "partial" and ids[0] in reducer_report.missing_senders, reducer_report
        assert averagers[0].round_counts["complete"] == 0
        # the sender says so as its stream breaks (hivemind's writing task failed silently: the reducer's deadline
        # was the first sign)
        victim_id = broken.peers[(broken.peers.index(ids[0]) + 1) % 3]
        assert f"Sending parts to {victim_id} failed after 1 of " in capfd.readouterr().err


def test_peer_stalled_in_the_group_costs_seconds_not_the_allreduce_timeout():
    with ExitStack() as stack:
        seconds, results, reports, averagers = run_round(stack, [Fault.STALL, Fault.NONE, Fault.NONE])
        stalled = averagers[0].peer_id.to_base58()
        for rank in (1, 2):
            assert seconds[rank] < 20, seconds  # the engine alone waits the whole allreduce_timeout (60 s here)
            report = reports[rank][-1]
            assert report.status == "partial", report
            assert stalled in report.local_fallback and stalled in report.missing_senders, report
            assert 0.2 < report.local_fallback[stalled] / report.total_values < 0.5
            assert averagers[rank].round_counts["partial"] == 1


class ExactReportingAverager(ReportingAverager, ExactAverager):
    """Every peer ends with the same bits (trahiv.engine.exact), as DiLoCo's averager and the gradient rounds do."""


def test_a_diloco_round_zeroes_the_share_nobody_returned_on_every_peer_that_missed_it():
    """DiLoCo's all-reduce (`DiLoCoRoundRunner`): a peer counted in the group that never starts (its search for a
    group ended as the group assembled) leaves its share unaveraged for both others. They set it to zero, the same
    on both, so both take the same outer step: their tensors stay identical, bit for bit (with their own values
    there, the two would differ in that share, and DiLoCo's digests would send one to download the other's)."""
    with ExitStack() as stack:
        _, _, reports, averagers = run_round(
            stack, [Fault.STALL, Fault.NONE, Fault.NONE], runner=DiLoCoRoundRunner, base=ExactReportingAverager
        )
        stalled = averagers[0].peer_id.to_base58()
        first, second = tensors_of(averagers[1]), tensors_of(averagers[2])
        assert torch.equal(first, second)
        for rank, tensors in ((1, first), (2, second)):
            report = reports[rank][-1]
            assert report.status == "partial" and stalled in report.local_fallback, report
            assert int((tensors == 0).sum()) == report.local_fallback[stalled] > 0.2 * report.total_values
            assert "(set to zero)" in report.describe(), report.describe()
        # the rest is the two peers' average
        expected = (torch.cat(local_values(1)) + torch.cat(local_values(2))) / 2
        averaged = first != 0
        assert torch.allclose(first[averaged], expected[averaged], atol=1e-5)


def test_a_peer_that_leaves_right_after_its_round_still_serves_the_parts_it_reduced():
    """A peer's round ends once it holds its own averaged parts; the parts it reduces for the others may still be on
    their way. A peer shut down right then (Ctrl+C after a step) used to take them with it: its groupmate's round was
    partial, that share of its values kept local (its parameters then differ from the leaver's). The leaving averager
    now waits for its streams. Here it serves 1 s late and shuts down as soon as its round is over."""
    with ExitStack() as stack:
        seconds, results, reports, averagers = run_round(stack, [Fault.SERVE_LATE_AND_LEAVE, Fault.NONE])
        leaver, stayer = averagers
        assert isinstance(results[0], dict) and isinstance(results[1], dict), results
        assert seconds[1] - seconds[0] > SERVE_DELAY_S / 2, seconds  # the leaver's round did end first
        assert not leaver.is_alive() and leaver.exitcode == 0, leaver.exitcode  # it left by itself, not terminated
        assert [r.status for r in reports[1]] == ["complete"], reports[1]
        expected = (torch.cat(local_values(0)) + torch.cat(local_values(1))) / 2
        assert torch.allclose(tensors_of(stayer), expected, atol=1e-5)


def test_delayed_optimizer_step_runs_without_delayed_state_averaging():
    """hivemind 1.1.12 asserted 'Delayed optimizer step requires delayed averaging' at the first collaborative step
    with delay_optimizer_step (delay_state_averaging is refused in trahiv); the state averager now handles it."""
    from trahiv.config import HivemindConfig
    from trahiv.swarm import Swarm

    config = HivemindConfig.model_validate(
        {"dht": {"nat_port_map": False}, "opt": {"run_id": "delayed", "target_batch_size": 2, "batch_size_per_step": 1,
                                                 "delay_optimizer_step": True, "delay_grad_averaging": True}}
    )  # fmt: skip
    swarm = Swarm(config, announce=lambda _: None)
    try:
        param = torch.nn.Parameter(torch.zeros(4))
        optimizer = swarm.make_optimizer([{"params": [param]}], lambda g: torch.optim.SGD(g, lr=1.0), None, 1)
        deadline = time.monotonic() + 30
        while optimizer.local_epoch < 3 and time.monotonic() < deadline:
            param.grad = torch.ones(4)
            optimizer.step(batch_size=1)
        assert optimizer.local_epoch >= 3
        time.sleep(0.5)  # the last delayed step lands in the background
        assert float(param.detach().max()) < 0  # SGD steps with gradient +1 moved the parameters down
    finally:
        swarm.shutdown()


def test_a_running_averaging_step_is_not_garbage_collected():
    """hivemind 1.1.12 starts each averaging step in the averager process with `asyncio.create_task` and keeps no
    reference to it; a step waiting on a future that only its own frame holds is a garbage cycle, and the collector
    destroyed one mid-round in a clean-clone run ("Task was destroyed but it is pending!": the round hung for
    averaging_timeout). trahiv's step (ReportingMixin._step) holds itself while it runs."""
    import gc
    import weakref
    from types import SimpleNamespace

    from trahiv.engine.averagers import ReportingMixin

    class Waiting:
        async def _step(self, *, step, future_for_init):
            await asyncio.get_running_loop().create_future()  # (hivemind awaits its matchmaking and trigger futures)

    class Averager(ReportingMixin, Waiting):
        pass

    async def main() -> bool:
        step = SimpleNamespace(done=lambda: False)
        task = asyncio.get_running_loop().create_task(object.__new__(Averager)._step(step=step, future_for_init=None))
        alive = weakref.ref(task)
        del task  # as hivemind does: nothing holds the task
        await asyncio.sleep(0.01)  # the step runs up to its wait
        gc.collect()
        survived = alive() is not None and not alive().done()  # type: ignore[union-attr]
        if survived:
            alive().cancel()  # type: ignore[union-attr]
            await asyncio.sleep(0.01)
        return survived

    assert asyncio.run(main())
