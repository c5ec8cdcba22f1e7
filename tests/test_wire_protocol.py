"""trahiv's wire protocol keeps peers that cannot average together out of each other's groups
(trahiv.protocol.WIRE_PROTOCOL, trahiv.engine.averagers.VersionedSchema): a plain hivemind averager and trahiv
averagers of the same tensors under the same name, each in its own process on loopback, all stepping at once. trahiv's
rounds return the aggregate where hivemind's return a difference, so a group of both would leave each side with values
the other did not mean. A peer that finds the swarm on another version refuses to start with one message
(test_join_errors.py)."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import hivemind
import pytest
import torch
from hivemind.averaging.averager import DecentralizedAverager, compute_schema_hash
from swarm_helpers import samples_per_epoch, start_bootstrap, start_peer, step_together, wait_for

from trahiv import engine, protocol
from trahiv.engine import averagers as trahiv_averagers
from trahiv.engine.averagers import ReportingAverager, versioned_schema_hash

engine.apply()

PLAIN_VALUE = 100.0  # the plain hivemind averager's values; the two trahiv averagers hold 0 and 2


def schema_hash_of(tensors: list[torch.Tensor]) -> bytes:
    """The schema hash a trahiv averager of `tensors` is built with (not started)."""
    return ReportingAverager(tensors, dht=None, prefix="schema", client_mode=True, start=False).schema_hash


def test_the_schema_hash_carries_the_wire_protocol(monkeypatch):
    tensors = [torch.zeros(4), torch.zeros(2, 3)]
    hiveminds, ours = compute_schema_hash(tensors), schema_hash_of(tensors)
    assert ours == versioned_schema_hash(hiveminds, protocol.WIRE_PROTOCOL)
    assert len(ours) == len(hiveminds) and ours != hiveminds
    assert schema_hash_of([torch.ones(4), torch.ones(2, 3)]) == ours  # (shapes and dtypes, not values)
    monkeypatch.setattr(protocol, "WIRE_PROTOCOL", protocol.WIRE_PROTOCOL + 1)
    assert schema_hash_of(tensors) not in (ours, hiveminds)


def test_every_trahiv_averager_carries_it():
    import inspect

    from trahiv.auxiliary.diloco import DiLoCoMirror
    from trahiv.engine import averagers, diloco, exact, state

    classes = {
        cls
        for module in (averagers, diloco, exact, state)
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if cls.__module__.startswith("trahiv.") and issubclass(cls, DecentralizedAverager)
    } | {DiLoCoMirror}
    classes.discard(trahiv_averagers.OverlappedAccumulation)  # (a mixin of RobustGradientAverager, never built alone)
    assert len(classes) >= 10, classes
    assert all(issubclass(cls, trahiv_averagers.VersionedSchema) for cls in classes), classes


def mixed_round(stack: ExitStack) -> tuple[list[Any], list[torch.Tensor]]:
    """One round of a plain hivemind averager (values PLAIN_VALUE) and two trahiv averagers (0 and 2), same name and
    shapes: (each step's result or exception, each averager's values after it)."""
    dhts = [hivemind.DHT(start=True, nat_port_map=False)]
    dhts += [hivemind.DHT(start=True, nat_port_map=False, initial_peers=dhts[0].get_visible_maddrs()) for _ in "ab"]
    for dht in dhts:
        stack.callback(dht.shutdown)
    common = dict(prefix="wire", min_group_size=2, min_matchmaking_time=2.0, request_timeout=1.0, start=True)
    averagers = [
        DecentralizedAverager([torch.full((4,), PLAIN_VALUE)], dht=dhts[0], **common),
        ReportingAverager([torch.zeros(4)], dht=dhts[1], **common),
        ReportingAverager([torch.full((4,), 2.0)], dht=dhts[2], **common),
    ]
    for averager in averagers:
        stack.callback(averager.shutdown)
    results, _ = step_together(averagers, [8.0, 8.0, 8.0], join_s=30)
    values = []
    for averager in averagers:
        with averager.get_tensors() as tensors:
            values.append(tensors[0].clone())
    return results, values


def test_trahiv_averagers_never_share_a_group_with_a_plain_hivemind_one():
    with ExitStack() as stack:
        results, values = mixed_round(stack)
    plain, *ours = results
    assert isinstance(plain, Exception), results  # it found no group: every trahiv leader refused it
    assert torch.equal(values[0], torch.full((4,), PLAIN_VALUE)), values
    assert all(isinstance(result, dict) and len(result) == 2 for result in ours), results  # the two trahiv ones
    assert all(torch.equal(value, torch.ones(4)) for value in values[1:]), values  # their mean, nothing of 100


def test_with_hiveminds_schema_hash_they_meet(monkeypatch):
    """The control: trahiv's averagers with hivemind's own schema hash, the same round. (By hand: all three in one
    group, every averager at 34, the mean of 100, 0 and 2.)"""
    monkeypatch.setattr(trahiv_averagers, "versioned_schema_hash", lambda schema_hash, version: schema_hash)
    with ExitStack() as stack:
        results, values = mixed_round(stack)
    assert isinstance(results[0], dict) and len(results[0]) >= 2, results  # the plain one averaged with trahiv's
    assert not torch.equal(values[0], torch.full((4,), PLAIN_VALUE)), values


@pytest.mark.parametrize("theirs", [0, protocol.WIRE_PROTOCOL + 1], ids=["unnumbered", "newer"])
def test_the_message_names_the_versions(theirs):
    from trahiv.swarm import protocol_mismatch

    message = protocol_mismatch("run", "QmPeer", theirs, protocol.WIRE_PROTOCOL)
    assert ("an older trahiv" if theirs < protocol.WIRE_PROTOCOL else "a newer trahiv") in message
    assert "peer QmPeer" in message and f"this peer protocol {protocol.WIRE_PROTOCOL}" in message
    assert ("from before trahiv numbered them" in message) == (theirs == 0)


def plain_hivemind_dht(stack: ExitStack, tmp_path: Any) -> tuple[Any, Any]:
    """A bootstrap peer and, in this process, a plain hivemind DHT joined to it (both stopped with `stack`)."""
    boot = start_bootstrap(tmp_path)
    stack.callback(boot.stop)
    dht = hivemind.DHT(initial_peers=boot.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False,
                       start=True)  # fmt: skip
    stack.callback(dht.shutdown)
    return boot, dht


@pytest.mark.swarm
def test_a_plain_hivemind_peers_samples_count_in_no_step(tmp_path, workdir):
    """A plain hivemind.Optimizer under the same run_id (its progress tracker, in this process) claims the whole target
    of step 0 while a trahiv peer (its own process) trains: the trahiv peer's step 0 takes its own 16 samples, and the
    peer says once that such a peer is there. (Control, by hand: with trahiv's progress records under hivemind's key,
    `progress_prefix` returning the run_id, the trahiv peer counted the plain peer's record and stepped after its
    first batch: {0: 4, 1: 16}.)"""
    from hivemind.optim.progress_tracker import ProgressTracker

    with ExitStack() as stack:
        boot, dht = plain_hivemind_dht(stack, tmp_path)
        plain = ProgressTracker(dht, prefix="mixed", target_batch_size=16, start=True)
        stack.callback(plain.shutdown)
        plain.report_local_progress(0, 16)
        wait_for(lambda: dht.get("mixed_progress", latest=True), 30, "the plain peer's progress record")
        peer = start_peer(tmp_path, "a", workdir=str(workdir), run_id="mixed", initial_peers=boot.initial_peers,
                          target=16, max_steps=2, batch_size=4)  # fmt: skip
        stack.callback(peer.process.kill)
        peer.finish()
    assert samples_per_epoch([peer]) == {0: 16, 1: 16}
    warning = "1 peer trains under run_id 'mixed' with plain hivemind (progress records under mixed_progress, e.g. "
    assert peer.log().count(warning + str(dht.peer_id)) == 1, peer.log()[-3000:]


def test_progress_records_live_under_a_key_of_their_version(monkeypatch):
    from trahiv.auxiliary import diloco as aux_diloco

    keys = {protocol.progress_key("run"), protocol.progress_key("run", diloco=True)}
    assert keys == {f"run_wire{protocol.WIRE_PROTOCOL}_progress", f"run_wire{protocol.WIRE_PROTOCOL}_diloco_progress"}
    assert aux_diloco.progress_key("run") == protocol.progress_key("run", diloco=True)  # what the aux peer reads
    monkeypatch.setattr(protocol, "WIRE_PROTOCOL", protocol.WIRE_PROTOCOL + 1)
    assert not keys & {protocol.progress_key("run"), protocol.progress_key("run", diloco=True)}


@pytest.mark.swarm
def test_a_plain_hivemind_peers_state_is_not_loaded(tmp_path, workdir):
    """A plain hivemind.Optimizer under the same run_id (in this process) serves its state at step 5, in the layout
    trahiv's trainers use (one 4-value parameter, SGD): a trahiv peer that joins (its own process) rejects it, names
    the reason once, and starts from its own weights at step 0. Before, the state passed trahiv's checks and
    hivemind's load of its optimizer state (10 leaves where trahiv's SGD has 11) raised; hivemind's Optimizer retried
    at once, for good: 2,836 tracebacks in 28 s before the peer trained on (now 3 tries at most: test_engine.py).
    Control, by hand, with the wire protocol check switched off: the optimizer-layout check rejects it ("its optimizer
    state has 0 tensors and 10 values, this peer's optimizer 0 and 11"), once, and no load fails."""
    with ExitStack() as stack:
        boot, dht = plain_hivemind_dht(stack, tmp_path)
        weights = torch.nn.Parameter(torch.full((4,), 7.0))
        plain = hivemind.Optimizer(dht=dht, run_id="plainstate", params=[weights], target_batch_size=16,
                                   optimizer=lambda params: torch.optim.SGD(params, lr=1.0), batch_size_per_step=4,
                                   verbose=False)  # fmt: skip
        stack.callback(plain.shutdown)
        plain.state_averager.local_epoch = 5
        plain.state_averager.state_sharing_priority = 5
        wait_for(lambda: dht.get("plainstate_state_averager.all_averagers", latest=True), 30, "the plain peer's state")
        peer = start_peer(tmp_path, "a", workdir=str(workdir), run_id="plainstate", initial_peers=boot.initial_peers,
                          toy_grad=1.0,
                          target=16, max_steps=1, batch_size=4)  # fmt: skip
        stack.callback(peer.process.kill)
        ready = peer.ready()
        peer.finish()
    assert ready["start_step"] == 0, peer.log()[-3000:]
    rejected = f"Rejected the state served by peer {dht.peer_id}: it carries no wire protocol"
    assert peer.log().count(rejected) == 1 and "Failed to load state" not in peer.log(), peer.log()[-3000:]
