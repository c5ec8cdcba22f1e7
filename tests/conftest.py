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
