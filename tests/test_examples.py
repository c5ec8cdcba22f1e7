"""examples/: the scripts a user copies run as documented (tiny, offline, on a CPU), each as one swarm peer; the
volunteer notebook joins a running bootstrap peer, executed with nbclient."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from swarm_helpers import ENV, start_bootstrap

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]
EXAMPLES = Path(__file__).parents[1] / "examples"
COMMON = ["--tiny", "--use_cpu", "--report_to", "none", "--disable_tqdm", "true", "--max_steps", "2",
          "--per_device_train_batch_size", "4", "--logging_steps", "1"]  # fmt: skip


def swarm(run_id: str) -> str:
    return json.dumps({"dht": {"nat_port_map": False}, "opt": {"run_id": run_id, "target_batch_size": 8}})


def run_example(script: str, tmp_path: Path, *extra: str) -> str:
    out = tmp_path / "out"
    command = [sys.executable, str(EXAMPLES / script), "--output_dir", str(out), *COMMON, *extra]
    result = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=200, cwd=tmp_path)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    assert "To join the training, use initial_peers" in log and "'collaborative_step': 2" in log, log[-4000:]
    assert "Traceback" not in log and "Task was destroyed" not in log, log[-4000:]
    return log


def test_train_clm(tmp_path):
    log = run_example("train_clm.py", tmp_path, "--hivemind_config", swarm("ex-clm"))
    assert "train_loss" in log and (tmp_path / "out" / "model.safetensors").exists()


def test_lora(tmp_path):
    log = run_example("lora.py", tmp_path, "--hivemind_config", swarm("ex-lora"))
    assert "trainable params: 4,096" in log  # rank 8 on the 2 layers' c_attn of the 64-wide tiny GPT-2
    assert (tmp_path / "out" / "adapter_model.safetensors").exists()


def test_qlora_sft(tmp_path):
    log = run_example("qlora_sft.py", tmp_path, "--bf16", "false", "--max_length", "64", "--hivemind_config",
                      swarm("ex-sft"))  # fmt: skip
    assert "mean_token_accuracy" in log and (tmp_path / "out" / "adapter_model.safetensors").exists()


def test_join_swarm_notebook(tmp_path, monkeypatch):
    import nbclient
    import nbformat

    boot = start_bootstrap(tmp_path)
    try:
        for key, value in {"TRAHIV_INITIAL_PEERS": json.dumps(boot.initial_peers), "TRAHIV_RUN_ID": "ex-notebook",
                           "TRAHIV_MAX_STEPS": "2", "TRAHIV_TARGET_BATCH_SIZE": "16"}.items():  # fmt: skip
            monkeypatch.setenv(key, value)
        for key, value in ENV.items():
            monkeypatch.setenv(key, value)
        notebook = nbformat.read(EXAMPLES / "join_swarm.ipynb", as_version=4)
        client = nbclient.NotebookClient(notebook, timeout=180, kernel_name="python3",
                                         resources={"metadata": {"path": str(tmp_path)}})  # fmt: skip
        client.execute()
    finally:
        boot.stop()
    outputs = "".join(out.get("text", "") for cell in notebook.cells for out in cell.get("outputs", []))
    assert "To join the training, use initial_peers" in outputs, outputs[-3000:]
    assert "collaborative steps: 2" in outputs and "loss by step:" in outputs, outputs[-3000:]
