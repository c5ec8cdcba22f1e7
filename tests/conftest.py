from __future__ import annotations

import os
import signal

import psutil
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def reap_children():
    """Whatever a test left running (peers, DHTs, p2pd) is killed when the session ends."""
    yield
    for child in psutil.Process().children(recursive=True):
        try:
            if "torch_shm_manager" in " ".join(child.cmdline()):
                continue  # torch's shared-memory manager: this process still talks to it while exiting
            child.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    """Tokenizer, initial GPT-2 weights and token blocks made from the shipped text, shared by the swarm tests."""
    from trahiv.demo import prepare_workdir

    return prepare_workdir(tmp_path_factory.mktemp("demo-data"))


# The slowest files first (worker-seconds measured with `-n 2 --dist loadfile`, run GA of docs/history.md): with
# pytest-xdist each file runs on one worker, and a long file started last would run alone at the end while the other
# worker idles.
SLOWEST_FIRST = (
    "test_diloco.py", "test_faults.py", "test_swarm.py", "test_cli.py", "test_matchmaking.py", "test_nat.py",
    "test_engine.py", "test_byzantine.py", "test_ring.py", "test_auth.py", "test_partial_rounds.py", "test_aux.py",
    "test_examples.py", "test_optim8bit.py", "test_errors.py", "test_connectivity.py", "test_revert.py",
    "test_diloco_aux.py", "test_aux_checkpoints.py", "test_diloco_revert.py", "test_data.py", "test_memory.py",
    "test_wire_protocol.py", "test_doctor.py", "test_trl.py", "test_aux_auth.py", "test_diloco_resume.py",
)  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's own order is kept


PEER_LOG_LINES = 150  # the last lines of each peer's log shown with a failure (a matchmaking trail: up to 60)
PEER_LOG_CHARS = 80_000  # at most this much of all the logs of one failed test


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> object:
    """A failed test shows the end of each peer log (`log.txt`) and bootstrap log its processes wrote under its
    `tmp_path`: a timing race seen once in a clean-clone run otherwise leaves only the assertion to read."""
    outcome = yield
    report = outcome.get_result()
    tmp_path = getattr(item, "funcargs", {}).get("tmp_path")
    if call.when != "call" or not report.failed or tmp_path is None:
        return
    sections, left = [], PEER_LOG_CHARS
    for log in sorted([*tmp_path.rglob("log.txt"), *tmp_path.rglob("bootstrap.log")]):
        lines = log.read_text(errors="replace").splitlines()[-PEER_LOG_LINES:]
        text = "\n".join(lines)[-left:]
        sections.append(f"--- {log.relative_to(tmp_path)} (last {len(lines)} lines)\n{text}")
        left -= len(text)
        if left <= 0:
            break
    if sections:
        report.sections.append(("peer logs", "\n".join(sections)))
