"""The auxiliary peer: metrics records, the collector, the store, TensorBoard, and `trahiv aux` with three trainers.

The swarm test shares one run (module fixture): `trahiv aux --average` starts first, as the swarm's entry point; three
toy trainers in client mode join through it, publish their metrics and average their gradients through it;
meanwhile an attacker writes a record for another peer's key, a record claiming another peer's ID, and a malformed
record. The tests then read the store, the trainers' own logs of what they published and of their weights, the aux
peer's log, and the TensorBoard event file; the last one restarts the aux peer on the same store.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from swarm_helpers import process_tree, start_peer, start_trahiv, stop, wait_exited, wait_for

from trahiv.auxiliary.collector import Collector, aggregate_step
from trahiv.auxiliary.store import MetricsStore, default_store_url
from trahiv.metrics import MetricsRecord, parse_metrics

PEER_IDS = ["12D3KooWMEGSxULAnyzgdnsfDLBV5wjy7CThowe4rVoRqrYEy5Rv", "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"]
RECORD = dict(
    peer_id=PEER_IDS[0], step=3, loss=2.5, step_samples=10, samples=100, samples_per_second=3.0, seconds=10.0,
    device="cpu", name=None, time=1.0e9,
)  # fmt: skip


def record(**changes) -> MetricsRecord:
    return MetricsRecord.parse_obj({**RECORD, **changes})


def subkey(index: int) -> bytes:
    return b"[owner:" + b"ssh-rsa AAAA%d" % index + b"]"


# --- the record's schema ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes",
    [
        {"loss": math.nan},
        {"seconds": math.inf},
        {"samples": -1},
        {"step": 3.0},  # strict: no conversions (hivemind's SchemaValidator compares the parsed value)
        {"samples_per_second": 3},
        {"samples": 2**60},
        {"name": "x" * 33},
        {"name": "bob\n"},
        {"device": ""},
        {"peer_id": "not a peer id"},
        {"extra": 1},
    ],
)
def test_record_schema_rejects(changes):
    with pytest.raises(ValueError):
        record(**changes)


def test_parse_metrics_drops_malformed_entries(caplog):
    entry = SimpleNamespace
    entries = {
        subkey(1): entry(value=RECORD),
        subkey(2): entry(value={**RECORD, "samples": -5}),
        subkey(3): entry(value="garbage"),
        b"no public key": entry(value=RECORD),
    }
    with caplog.at_level("WARNING", logger="trahiv.metrics"):
        parsed = parse_metrics(entries)
    assert list(parsed) == [subkey(1)] and parsed[subkey(1)].samples == 100
    assert caplog.text.count("Dropping a malformed metrics record") == 3
    assert parse_metrics(None) == {} and parse_metrics(["not", "a", "dict"]) == {}


# --- the store ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("url", ["sqlite://", "file"])
def test_store_api(tmp_path, url):
    store = MetricsStore(default_store_url(tmp_path) if url == "file" else url)
    store.add_step(1, 10.0, 2.5, 3, 30.0, 24)
    store.add_step(2, 11.0, math.nan, 3, 31.0, 24)
    store.add_step(1, 10.5, 2.4, 2, 29.0, 20)  # replaces step 1
    assert store.steps() == [
        {"step": 1, "time": 10.5, "loss": 2.4, "active_peers": 2, "samples_per_second": 29.0, "samples": 20},
        {"step": 2, "time": 11.0, "loss": None, "active_peers": 3, "samples_per_second": 31.0, "samples": 24},
    ]
    assert [row["step"] for row in store.steps(limit=1)] == [2]
    store.upsert_contributor("a", "alice", "cpu", 10, 1.0, last_seen=5.0)
    store.upsert_contributor("b", None, "cuda:X", 30, 2.0, last_seen=6.0)
    store.upsert_contributor("a", "alice", "cpu", 40, 3.0, last_seen=7.0)
    assert store.contributors() == [
        {"peer_id": "a", "name": "alice", "device": "cpu", "samples": 40, "seconds": 3.0, "first_seen": 5.0,
         "last_seen": 7.0},
        {"peer_id": "b", "name": None, "device": "cuda:X", "samples": 30, "seconds": 2.0, "first_seen": 6.0,
         "last_seen": 6.0},
    ]  # fmt: skip
    store.set_meta("run_id", "x")
    store.set_meta("run_id", "y")
    assert store.meta() == {"run_id": "y"}

    errors = []

    def read() -> None:  # the dashboard reads from web request threads while the collector writes
        try:
            for _ in range(100):
                rows = store.steps()
                assert [r["step"] for r in rows] == sorted(r["step"] for r in rows)
                store.contributors()
        except Exception as e:
            errors.append(e)

    readers = [threading.Thread(target=read) for _ in range(3)]
    for thread in readers:
        thread.start()
    for step in range(3, 103):
        store.add_step(step, float(step), 1.0, 1, 1.0, 1)
    for thread in readers:
        thread.join(30)
    assert not errors and len(store.steps()) == 102
    store.close()
    if url == "file":  # the history survives a restart
        assert len(MetricsStore(default_store_url(tmp_path)).steps()) == 102


def test_store_rejects_a_bad_url():
    with pytest.raises(ValueError, match="not a database URL"):
        MetricsStore("not a url")


# --- the collector, on records given directly ---------------------------------------------------------------------


class FakeDHT:
    def __init__(self):
        self.entries: dict[bytes, MetricsRecord] = {}

    def get(self, key, latest=False, return_future=False):
        value = {k: SimpleNamespace(value=r.dict()) for k, r in self.entries.items()}
        found = SimpleNamespace(value=value) if value else None
        if return_future:  # (hivemind's DHT answers through a future the caller may wait on with a timeout)
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.set_result(found)
            return future
        return found


class ListTracker:
    def __init__(self):
        self.points: list[tuple[int, dict]] = []

    def log(self, step, values):
        self.points.append((step, values))

    def close(self):
        pass


def test_aggregate_step_weights_the_loss_by_samples():
    agg = aggregate_step(
        4,
        [
            record(loss=1.0, step_samples=30, samples_per_second=3.0, time=5.0),
            record(peer_id=PEER_IDS[1], loss=3.0, step_samples=10, samples_per_second=1.0, time=6.0),
            record(peer_id=PEER_IDS[1], loss=None, step_samples=0, samples_per_second=0.0, time=7.0),
        ],
    )
    assert (agg.loss, agg.samples, agg.active_peers, agg.samples_per_second, agg.time) == (1.5, 40, 3, 4.0, 7.0)


def test_collector_sessions_ownership_and_settling(tmp_path, caplog):
    store, dht, tracker = MetricsStore("sqlite://"), FakeDHT(), ListTracker()
    collector = Collector(dht, "run", store, [tracker], settle=5.0)
    a, b = PEER_IDS
    dht.entries = {
        subkey(1): record(peer_id=a, step=1, step_samples=8, samples=8, seconds=2.0, loss=2.0, time=1.0),
        subkey(2): record(peer_id=b, step=1, step_samples=24, samples=24, seconds=2.0, loss=1.0, time=1.0),
    }
    collector.poll(now=0.0)
    assert store.steps()[0] == {"step": 1, "time": 1.0, "loss": 1.25, "active_peers": 2, "samples_per_second": 6.0,
                                "samples": 32}  # fmt: skip
    assert tracker.points == []  # not settled yet
    collector.poll(now=6.0)
    assert tracker.points == [(1, {"swarm/active_peers": 2.0, "swarm/samples_per_second": 6.0, "swarm/samples": 32.0,
                                   "swarm/loss": 1.25})]  # fmt: skip
    # another key claims peer a while a's own record lives: ignored
    with caplog.at_level("WARNING", logger="trahiv.auxiliary"):
        dht.entries[subkey(3)] = record(peer_id=a, step=2, step_samples=10**6, samples=10**6, time=2.0)
        collector.poll(now=7.0)
    assert "Ignoring metrics for peer" in caplog.text
    assert {c["peer_id"]: c["samples"] for c in store.contributors()} == {a: 8, b: 24}
    assert [s["step"] for s in store.steps()] == [1]
    # peer a restarts (new key, its old record expired, counters from zero): its totals add up
    del dht.entries[subkey(1)], dht.entries[subkey(3)]
    dht.entries[subkey(4)] = record(peer_id=a, step=2, step_samples=4, samples=4, seconds=1.0, time=3.0, name="al")
    collector.poll(now=8.0)
    rows = {c["peer_id"]: c for c in store.contributors()}
    assert (rows[a]["samples"], rows[a]["seconds"], rows[a]["name"]) == (12, 3.0, "al")
    collector.stop()
    assert [point[0] for point in tracker.points] == [1, 2]  # stop() logs what had not settled yet
    # a restarted collector on the same store continues the totals and never rewrites the history
    dht.entries[subkey(4)] = record(peer_id=a, step=3, step_samples=6, samples=10, seconds=2.0, time=4.0)
    again = Collector(dht, "run", store, [])
    assert again.history_until == 2
    again.poll(now=9.0)
    assert {c["peer_id"]: c["samples"] for c in store.contributors()}[a] == 18  # 12 + (10 - 4) since
    assert [s["step"] for s in store.steps()] == [1, 2, 3]


def test_a_stopped_collector_reads_the_records_once_more():
    """The trainers' last records, published as they leave, reach the store when the aux peer is stopped right after
    them (as `trahiv demo` stops it): stop() reads the records once more after the last periodic read."""
    store, dht = MetricsStore("sqlite://"), FakeDHT()
    a, b = PEER_IDS
    dht.entries = {subkey(1): record(peer_id=a, step=1, step_samples=8, samples=8, time=1.0)}
    collector = Collector(dht, "run", store, [], period=3600.0)
    collector.start()
    wait_for(lambda: collector.polls >= 1, 30, "the collector's first read")
    dht.entries = {  # published after that read, as the peers left
        subkey(1): record(peer_id=a, step=2, step_samples=8, samples=16, time=2.0),
        subkey(2): record(peer_id=b, step=2, step_samples=4, samples=4, time=2.0),
    }
    collector.stop()
    assert [(s["step"], s["active_peers"], s["samples"]) for s in store.steps()] == [(1, 1, 8), (2, 2, 12)]
    assert {c["peer_id"]: c["samples"] for c in store.contributors()} == {a: 16, b: 4}


def test_collector_never_rewrites_old_steps_from_late_records():
    store, dht = MetricsStore("sqlite://"), FakeDHT()
    collector = Collector(dht, "run", store, [], settle=0.0)
    a, b = PEER_IDS
    for step in range(1, 100):
        dht.entries = {subkey(1): record(peer_id=a, step=step, samples=step, time=float(step))}
        collector.poll(now=float(step))
    first = store.steps(limit=None)[0]
    dht.entries = {subkey(2): record(peer_id=b, step=1, step_samples=10**6, samples=10**6, time=100.0)}
    collector.poll(now=100.0)
    assert store.steps()[0] == first and len(store.steps()) == 99  # step 1 is long final: b counts for totals only
    assert {c["peer_id"]: c["samples"] for c in store.contributors()} == {a: 99, b: 10**6}


# --- bad input fails at start ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["--config", '{"opt": {"run_id": "r", "target_batch_size": 8}, "metrics": {"names": "x"}}'],
            "did you mean 'name'",
        ),
        (["--config", '{"opt": {"run_id": "r", "target_batch_size": 8}}', "--initial-peers", "/ip4/1.2.3.4"], "/p2p/"),
        (["--config", '{"opt": {"run_id": "r", "target_batch_size": 8}}', "--store", "nope"], "not a database URL"),
        (
            ["--config", '{"opt": {"run_id": "r", "target_batch_size": 8, "power_sgd_rank": 4}}', "--average"],
            "cannot help a PowerSGD swarm",
        ),
        (
            ["--config", '{"opt": {"run_id": "r", "target_batch_size": 8, "use_local_updates": true}}', "--average"],
            "averages parameters only",
        ),
    ],
)
def test_aux_cli_rejects_bad_input(tmp_path, capsys, extra, message):
    from trahiv.cli.main import main

    assert main(["aux", "--output-dir", str(tmp_path), "--report-to", "none", *extra]) == 2
    assert message in capsys.readouterr().err


def test_the_helper_builds_from_the_schema_most_trainers_published():
    import torch

    from trahiv.auxiliary.helper import agreed_schema
    from trahiv.swarm import _is_fingerprint, model_fingerprint

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    model[1].weight.requires_grad_(False)
    tensors = [model[0].weight, model[1].bias, model[0].bias]  # the optimizer's order, not the model's
    honest = model_fingerprint(model.named_parameters(), tensors)
    assert honest["schema"] == [["float32", [2, 3]], ["float32", [2]], ["float32", [2]]]
    assert honest["tensors"] == 3 and honest["parameters"] == 10 and _is_fingerprint(honest)
    assert _is_fingerprint(model_fingerprint(model.named_parameters()))  # (no schema: still a fingerprint)
    for bad in (
        [["float32", [2, 3]], ["float32", [2]]],  # a tensor missing
        [["float32", [2, 3]], ["float32", [2]], ["float32", [3]]],  # 11 values, not 10
        [["int64", [2, 3]], ["float32", [2]], ["float32", [2]]],  # not a trainable dtype
        [["float32", [2, -3]], ["float32", [2]], ["float32", [2]]],
        [[["float32"], [2, 3]], ["float32", [2]], ["float32", [2]]],
        "float32",
    ):
        assert not _is_fingerprint({**honest, "schema": bad}), bad
    forged = {**honest, "digest": "f" * 32, "schema": [["float16", [2, 3]], ["float32", [2]], ["float32", [2]]]}
    records = {"peer1": honest, "peer2": honest, "peer3": forged, "peer4": model_fingerprint(model.named_parameters())}
    assert agreed_schema(records) == (honest["schema"], ["peer1", "peer2"])
    assert agreed_schema({"peer4": records["peer4"]}) is None
    # trainers of another wire protocol (an older trahiv: no version in its records) share no group with this peer
    older = {key: value for key, value in honest.items() if key != "protocol"}
    newer = {**forged, "protocol": honest["protocol"] + 1}
    assert _is_fingerprint(older) and _is_fingerprint(newer) and not _is_fingerprint({**honest, "protocol": "1"})
    votes = {"peer1": older, "peer2": older, "peer3": newer, "peer4": newer, "peer5": honest}
    assert agreed_schema(votes) == (honest["schema"], ["peer5"])


def test_the_helper_gives_up_a_round_the_trainers_finished_without_it():
    """A gradient round whose group has not formed is given up as soon as the trainers' step passes it (they averaged
    without the helper), not after the averaging timeout; a round whose group formed is waited for."""
    from concurrent.futures import Future

    from trahiv.auxiliary.helper import AveragingHelper

    class Tracker:  # the trainers are at step 6; the next look at their progress finds them at step 7
        global_epoch, refreshes = 6, 0

        def refresh_now(self) -> None:
            self.global_epoch, self.refreshes = 7, self.refreshes + 1

    tracker = Tracker()
    helper = AveragingHelper()
    helper.tracker = tracker  # type: ignore[assignment]
    searching = Future()
    searching.stage = None  # type: ignore[attr-defined]  # (hivemind's StepControl: no group yet)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="moved on to step 7 without this peer"):
        helper._wait_for_round(searching, 6, timeout=60.0, give_up=True)
    assert tracker.refreshes >= 1 and time.monotonic() - started < 10

    from hivemind.averaging.control import AveragingStage

    in_group = Future()
    in_group.stage = AveragingStage.RUNNING_ALLREDUCE  # type: ignore[attr-defined]
    threading.Timer(1.5, in_group.set_result, ([],)).start()  # the round ends after the trainers' step moved on
    helper._wait_for_round(in_group, 6, timeout=60.0, give_up=True)
    assert in_group.done()


def test_aux_refuses_a_store_of_another_run(tmp_path, capsys):
    from trahiv.cli.main import main

    with MetricsStore(default_store_url(tmp_path)) as store:
        store.set_meta("run_id", "first_run")
    config = '{"opt": {"run_id": "second_run", "target_batch_size": 8}}'
    assert main(["aux", "--config", config, "--output-dir", str(tmp_path), "--report-to", "none"]) == 2
    assert "holds the history of run_id 'first_run', not 'second_run'" in capsys.readouterr().err


def test_optional_trackers_fail_clearly_when_missing(tmp_path):
    from trahiv.auxiliary.trackers import make_trackers

    for name in ("wandb", "trackio"):
        try:
            __import__(name)
            continue  # installed here: nothing to check (the tests never reach a tracker's servers)
        except ImportError:
            pass
        with pytest.raises(ValueError, match=f"pip install {name}"):
            make_trackers([name], output_dir=tmp_path, project="p", run_name="r", config={}, meta={})
    with pytest.raises(ValueError, match="unknown tracker"):
        make_trackers(["mlflow"], output_dir=tmp_path, project="p", run_name="r", config={}, meta={})


# --- `trahiv aux` with three trainers, an attacker, a restart ---------------------------------------------------------

RUN_ID, TARGET, MAX_STEPS = "aux_test", 48, 4
STATE_EVERY = 2  # parameter rounds as the trainers enter steps 2 and 4: led by the aux peer (trainers in client mode)
MALFORMED_ID = "QmMa1formedPeer1111111111111111111111111111111"


def start_aux(tmp: Path, name: str, output_dir: Path, *extra: str) -> SimpleNamespace:
    """`trahiv aux` (`start_trahiv`); returns once it printed its join addresses."""
    out = tmp / name
    out.mkdir(parents=True, exist_ok=True)
    opt = {"run_id": RUN_ID, "target_batch_size": TARGET, "matchmaking_time": 2.0, "averaging_timeout": 30.0,
           "average_state_every": STATE_EVERY}  # theirs  # fmt: skip
    config = {"dht": {"nat_port_map": False}, "opt": opt}
    argv = [
        "aux", "--config", json.dumps(config), "--output-dir", str(output_dir),
        "--period", "0.5", "--max-steps", str(MAX_STEPS), "--addresses-file", str(out / "addresses.json"), *extra,
    ]  # fmt: skip
    log = out / "log.txt"
    process = start_trahiv(argv, log, tmp)

    def addresses():
        if process.poll() is not None:
            raise AssertionError(f"trahiv aux exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        path = out / "addresses.json"
        return path.exists() and path.stat().st_size and json.loads(path.read_text())

    initial_peers = wait_for(addresses, 90, "trahiv aux to start")
    return SimpleNamespace(process=process, initial_peers=initial_peers, log=log)


def test_an_aux_peer_whose_p2p_daemon_dies_says_so_and_exits(tmp_path):
    """`trahiv aux` whose p2pd is killed (the OOM killer): one line naming it, exit code 1, nothing left running.
    Before, its DHT process lived on, so the command went on as an aux peer that no trainer could reach."""
    import psutil

    aux = start_aux(tmp_path, "aux", tmp_path / "out")
    try:
        tree = process_tree(aux.process.pid)
        dht = next(
            p for p in psutil.Process(aux.process.pid).children() if any("p2pd" in c.name() for c in p.children())
        )
        next(c for c in dht.children() if "p2pd" in c.name()).kill()
        assert aux.process.wait(timeout=30) == 1
    finally:
        stop(aux.process)
    assert re.search(r"The auxiliary peer stopped: its p2p daemon \(p2pd, pid \d+\) ended", aux.log.read_text())
    wait_exited(tree, 10, "the aux peer's processes")


def expected_steps(peers) -> dict[int, dict]:
    """Per collaborative step, what the trainers' own logs of their published records add up to."""
    by_step: dict[int, list[MetricsRecord]] = {}
    for peer in peers:
        for row in peer.records("metrics"):
            row = {k: v for k, v in row.items() if k != "kind"}
            by_step.setdefault(row["step"], []).append(MetricsRecord.parse_obj(row))
    return {step: vars(aggregate_step(step, records)) for step, records in by_step.items()}


class Attackers:
    """Two DHT peers of an attacker's, started before the trainers and stopped after them: the swarm's membership stays
    the same while it trains (peers that join and leave mid-round are tests/test_faults.py's business; here, in
    clean-clone runs, a trainer once found no group for 60 s after these left, and once lost a parameter round's
    stream while they started). `attack` stores its records mid-training."""

    def __init__(self, initial_peers: list[str]):
        import hivemind
        from hivemind.dht.crypto import RSASignatureValidator
        from hivemind.utils.crypto import RSAPrivateKey

        from trahiv.metrics import add_metrics_validators

        dht_kwargs = dict(initial_peers=initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
        self.forger = hivemind.DHT(nat_port_map=False, **dht_kwargs)
        self.sloppy = hivemind.DHT(nat_port_map=False, **dht_kwargs)
        self.own_key = add_metrics_validators(self.forger, RUN_ID)
        self.sloppy_validator = RSASignatureValidator(RSAPrivateKey())  # signs its records, checks no schema
        self.sloppy.add_validators([self.sloppy_validator])

    def attack(self, victim: str) -> dict:
        """A record stored under the victim's key, a (validly signed) record of the attacker's claiming the victim's
        peer ID, and a malformed record stored by a peer that skips schema checks."""
        from hivemind.utils import get_dht_time

        from trahiv.metrics import METRICS_TTL, metrics_key

        forger, sloppy = self.forger, self.sloppy
        key, expiration = metrics_key(RUN_ID), get_dht_time() + METRICS_TTL

        def find_victim():
            found = forger.get(key, latest=True)
            return next((k for k, v in parse_metrics(found.value if found else None).items() if v.peer_id == victim), 0)

        victim_key = wait_for(find_victim, 30, "the attacker to find the victim's record")
        fake = dict(RECORD, peer_id=victim, step=1, samples=10**9, step_samples=10**9, time=get_dht_time())
        forged = forger.store(key, subkey=victim_key, value=fake, expiration_time=expiration)
        claimed = forger.store(key, subkey=self.own_key, value=fake, expiration_time=expiration)
        bad = dict(fake, peer_id=MALFORMED_ID, samples=-5)
        subkey = self.sloppy_validator.local_public_key
        malformed = sloppy.store(key, subkey=subkey, value=bad, expiration_time=expiration)
        after = forger.get(key, latest=True)
        victim_now = parse_metrics(after.value if after else None).get(victim_key)
        return {"forged": forged, "claimed": claimed, "malformed": malformed, "victim_record": victim_now}

    def shutdown(self) -> None:
        self.forger.shutdown()
        self.sloppy.shutdown()


@pytest.fixture(scope="module")
def swarm(tmp_path_factory, workdir):
    tmp = tmp_path_factory.mktemp("aux-swarm")
    output_dir = tmp / "aux-output"
    started = time.monotonic()
    aux = start_aux(tmp, "aux", output_dir, "--average")  # it also helps the trainers average (auxiliary mode)
    peers, attackers = [], None
    try:
        attackers = Attackers(aux.initial_peers)
        common = dict(
            workdir=str(workdir), run_id=RUN_ID, target=TARGET, max_steps=MAX_STEPS, initial_peers=aux.initial_peers,
            sleep_per_step=0.2, opt={"min_peers": 3, "min_peers_timeout": 90, "average_state_every": STATE_EVERY},
            dht={"client_mode": True},  # volunteers behind NAT: only the aux peer accepts connections and can reduce
        )  # fmt: skip
        peers = [
            start_peer(tmp, "a", batch_size=4, toy_grad=1.0, metrics={"name": "alice"}, **common),
            start_peer(tmp, "b", batch_size=2, toy_grad=2.0, metrics={"name": "bob"}, **common),
            start_peer(tmp, "c", batch_size=6, toy_grad=3.0, **common),  # (all > 0: their mean cannot cancel out)
        ]
        ids = [peer.ready(120)["peer_id"] for peer in peers]
        store = MetricsStore(default_store_url(output_dir))  # the aux peer's SQLite file, read while it writes
        # the collector writes a record's contributor row before its step row: wait for both
        wait_for(
            lambda: ids[0] in {c["peer_id"] for c in store.contributors()} and store.steps(), 90, "peer a's first step"
        )
        attacked_at_step = max(row["step"] for row in store.steps())
        attacks = attackers.attack(victim=ids[0])
        done = [peer.finish(180) for peer in peers]

        def caught_up():
            samples = {c["peer_id"]: c["samples"] for c in store.contributors()}
            steps = {row["step"] for row in store.steps()}
            return steps >= set(range(1, MAX_STEPS + 1)) and all(
                samples.get(i) == d["samples_contributed"] for i, d in zip(ids, done, strict=True)
            )

        wait_for(caught_up, 30, "the store to hold every step and each peer's samples")
        aux_alive = aux.process.poll() is None
        stop(aux.process)  # SIGTERM: the collector logs the steps not logged yet
        yield SimpleNamespace(
            tmp=tmp, output_dir=output_dir, peers=peers, ids=ids, done=done, store=store, attacks=attacks,
            attacked_at_step=attacked_at_step, aux=aux, aux_alive=aux_alive, aux_code=aux.process.returncode,
            training_seconds=time.monotonic() - started,
        )  # fmt: skip
        store.close()
    finally:
        stop(aux.process)
        for peer in peers:
            stop(peer.process)
        if attackers is not None:
            attackers.shutdown()


@pytest.mark.swarm
def test_store_matches_what_the_trainers_reported(swarm):
    expected = expected_steps(swarm.peers)
    assert set(range(1, MAX_STEPS + 1)) <= set(expected), "every trainer publishes a record at each step"
    rows = {row["step"]: row for row in swarm.store.steps()}
    for step in range(1, MAX_STEPS + 1):
        want, got = expected[step], rows[step]
        assert got["active_peers"] == want["active_peers"] == 3, (step, got, want)
        assert got["samples"] == want["samples"] >= TARGET, (step, got, want)
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-9, abs=1e-12), (step, got, want)
        assert got["samples_per_second"] == pytest.approx(want["samples_per_second"])
    # the toy model's losses differ by peer (loss = <w, c>): the swarm loss is their sample-weighted mean
    assert len({round(r.loss, 6) for p in swarm.peers for r in map(_record, p.records("metrics")) if r.step == 2}) > 1
    contributors = {c["peer_id"]: c for c in swarm.store.contributors()}
    assert set(contributors) == set(swarm.ids)
    for peer_id, done, name in zip(swarm.ids, swarm.done, ["alice", "bob", None], strict=True):
        row = contributors[peer_id]
        assert row["samples"] == done["samples_contributed"] > 0
        assert (row["name"], row["device"]) == (name, "cpu")
        assert 0 < row["seconds"] < swarm.training_seconds
    assert sum(c["samples"] for c in contributors.values()) == sum(r["samples"] for r in rows.values())
    meta = swarm.store.meta()
    assert (meta["run_id"], meta["target_batch_size"], meta["max_steps"]) == (RUN_ID, str(TARGET), str(MAX_STEPS))
    assert "To join the training, use initial_peers = ['/ip4/127.0.0.1/tcp/" in swarm.aux.log.read_text()


def _record(row: dict) -> MetricsRecord:
    return MetricsRecord.parse_obj({k: v for k, v in row.items() if k != "kind"})


@pytest.mark.swarm
def test_forged_and_malformed_records_are_dropped(swarm):
    attacks = swarm.attacks
    assert attacks["forged"] is False, "a record under another peer's key must be refused by every DHT node"
    assert attacks["victim_record"] is not None and attacks["victim_record"].samples < 10**9
    assert attacks["claimed"] is True  # validly signed by the attacker's own key: the collector must ignore it
    contributors = {c["peer_id"]: c for c in swarm.store.contributors()}
    assert MALFORMED_ID not in contributors
    assert all(c["samples"] < 10**9 for c in contributors.values())
    assert all(row["samples"] < 10**6 for row in swarm.store.steps())
    assert swarm.aux_alive, "the aux peer must keep running"
    assert swarm.attacked_at_step < MAX_STEPS, "the aux peer went on recording steps after the attack"
    assert "Ignoring metrics for peer" in swarm.aux.log.read_text()
    assert swarm.aux_code == 0, swarm.aux.log.read_text()[-3000:]


@pytest.mark.swarm
def test_tensorboard_event_file_has_the_scalars(swarm):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(swarm.output_dir / "tensorboard"))
    events.Reload()
    rows = {row["step"]: row for row in swarm.store.steps()}
    assert {"swarm/loss", "swarm/active_peers", "swarm/samples", "swarm/samples_per_second"} <= set(
        events.Tags()["scalars"]
    )
    loss = {e.step: e.value for e in events.Scalars("swarm/loss")}
    assert sorted(loss) == sorted(rows), "one point per collaborative step, each logged once"
    for step, value in loss.items():
        assert value == pytest.approx(rows[step]["loss"], rel=1e-5, abs=1e-6)
    assert {e.step: e.value for e in events.Scalars("swarm/active_peers")} == {s: 3.0 for s in rows}


@pytest.mark.swarm
def test_aux_peer_helps_average_the_gradients(swarm):
    """`--average` with three trainers in client mode (behind NAT: they cannot lead a group nor reduce, so without a
    helper they could not average at all): the aux peer leads every gradient round and reduces all of it (weight 0),
    and the trainers' update is exactly the sample-weighted mean of their constant gradients (toy model: 1, 2, 3)."""
    log = swarm.aux.log.read_text()
    assert "Averaging helper ready: 1 tensors, 4 values" in log, log[-3000:]
    helped = re.findall(r"Averaging helper, step (\d+): complete averaging round with (\d) peers", log)
    steps = {int(step) for step, size in helped if size == "4"}  # the three trainers and the aux peer
    assert len(steps) >= MAX_STEPS - 1, log[-3000:]  # (the first step may form its group before the aux joins)
    # parameter rounds: no trainer can lead one (all in client mode): the aux peer leads them, with all three
    led = re.findall(r"Averaging helper, step (\d+) \(parameters\): complete averaging round with (\d) peers", log)
    assert led == [(str(step), "4") for step in range(STATE_EVERY, MAX_STEPS + 1, STATE_EVERY)], log[-3000:]
    for peer in swarm.peers:
        assert "Skipping parameter averaging" not in peer.log() and "could not find a group" not in peer.log()
    grads = {"a": 1.0, "b": 2.0, "c": 3.0}
    peers = dict(zip("abc", swarm.peers, strict=True))
    for step in sorted(steps):
        weights = {}
        for name, peer in peers.items():
            rows = [r for r in peer.records("local") if r["epoch_before"] == step]
            weights[name] = rows[-1]["pre_samples"] + rows[-1]["batch"]  # samples accumulated when averaging
        delta = -sum(weights[n] * grads[n] for n in peers) / sum(weights.values())
        for peer in peers.values():
            before, after = peer.params_at().get(step, {"values": [0.0] * 4})["values"], peer.params_at()[step + 1]
            assert after["values"] == pytest.approx([v + delta for v in before], abs=1e-5), (step, weights)


@pytest.mark.swarm
def test_restarted_aux_peer_keeps_the_history(swarm):
    before_steps, before_contributors = swarm.store.steps(), swarm.store.contributors()
    again = start_aux(swarm.tmp, "aux-again", swarm.output_dir, "--duration", "1")
    try:
        assert again.process.wait(timeout=60) == 0, again.log.read_text()[-3000:]
    finally:
        stop(again.process)
    with MetricsStore(default_store_url(swarm.output_dir)) as store:
        assert store.steps() == before_steps and len(before_steps) >= MAX_STEPS
        assert store.contributors() == before_contributors
        assert store.meta()["run_id"] == RUN_ID
