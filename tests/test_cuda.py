"""The CUDA paths, with two peer processes on one GPU (skipped without one): fp16 with the Trainer's GradScaler,
bf16 weights, bitsandbytes' 8-bit optimizer on the GPU, QLoRA (a 4-bit base model with LoRA adapters), DiLoCo under
fp16 (also streaming, overlapped). Each swarm must end with its peers holding the same trainable weights (streaming:
the same outer parameters). CI has no GPU: these run on a lent GPU machine (README, GPU checks); the memory
calculator is checked against a GPU's allocations too."""

from __future__ import annotations

import math

import pytest
import torch
from swarm_helpers import start_bootstrap, start_peer, stop

pytestmark = [
    pytest.mark.swarm,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture
def swarm(tmp_path, workdir, monkeypatch):
    """Runs two cuda_worker.py peers of one mode (spawned: CUDA does not survive a fork); returns their done.json."""
    monkeypatch.setenv("TRAHIV_TEST_NO_FORK", "1")
    bootstrap = start_bootstrap(tmp_path)
    peers = []

    def run(mode: str, max_steps: int, target: int, batch_size: int = 8, **per_peer: dict) -> dict[str, dict]:
        for name in ("a", "b"):
            spec = {"mode": mode, "workdir": str(workdir), "run_id": f"cuda-{mode}", "initial_peers":
                    bootstrap.initial_peers, "max_steps": max_steps, "target": target, "batch_size": batch_size,
                    **per_peer.get(name, {})}  # fmt: skip
            peers.append(start_peer(tmp_path, name, worker="cuda_worker.py", **spec))
        return {peer.name: peer.finish(timeout=300) for peer in peers}

    yield run
    for peer in peers:
        stop(peer.process)
    bootstrap.stop()


def test_fp16_averages_unscaled_gradients_and_drops_an_overflowed_step(swarm):
    """Every gradient is 0.5, lr 1, 3 steps: w = -1.5 on both peers. Peer a's third forward pass overflows: its
    scaler halves the scale and skips that step; gradient clipping (10) sees unscaled norms (1.0)."""
    done = swarm("fp16_toy", max_steps=3, target=16, batch_size=4, a={"overflow_at": 3})
    for name, peer in done.items():
        assert peer["global_step"] == 3 and peer["devices"] == ["cuda"], (name, peer)
        assert peer["scaler"] == "torch.amp.grad_scaler.GradScaler", peer
        assert peer["values"] == pytest.approx([-1.5] * 4, abs=1e-6), (name, peer)
        finite = [n for n in peer["grad_norms"] if math.isfinite(n)]
        assert finite and all(n == pytest.approx(1.0) for n in finite), (name, peer["grad_norms"])
    assert done["a"]["scale"] == done["b"]["scale"] / 2, done


def trained_together(done: dict[str, dict], steps: int = 4) -> tuple[dict, dict]:
    """Both peers reached `steps` on the GPU with finite losses and ended with the same trainable weights."""
    a, b = done["a"], done["b"]
    assert a["global_step"] == b["global_step"] == steps, (a, b)
    assert a["sha256"] == b["sha256"], "the peers ended with different weights"
    for peer in (a, b):
        assert peer["devices"] == ["cuda"], peer
        assert peer["losses"] and all(math.isfinite(x) for x in peer["losses"]), peer
    return a, b


def test_fp16_gpt2_trains_with_unscaled_clipping(swarm):
    for peer in trained_together(swarm("fp16", max_steps=4, target=32)):
        assert peer["scaler"] == "torch.amp.grad_scaler.GradScaler", peer
        finite = [n for n in peer["grad_norms"] if math.isfinite(n)]
        assert finite and max(finite) < 100, f"gradient norms of scaled gradients? {peer['grad_norms']}"


def test_bitsandbytes_8bit_adamw_keeps_its_states_on_the_gpu(swarm):
    for peer in trained_together(swarm("bnb8bit", max_steps=4, target=32)):
        assert peer["optimizer"].startswith("bitsandbytes.optim"), peer
        assert peer["states"].get("state1:torch.uint8:cuda", 0) > 0, peer["states"]
        assert peer["losses"][-1] < peer["losses"][0], peer["losses"]


def test_bf16_weights_train_with_8bit_averaging(swarm):
    for peer in trained_together(swarm("bf16", max_steps=4, target=32)):
        assert peer["states"].get("exp_avg:torch.bfloat16:cuda", 0) > 0, peer
        assert peer["losses"][-1] < peer["losses"][0], peer["losses"]


def test_qlora_averages_the_adapters_of_a_4bit_model(swarm):
    for peer in trained_together(swarm("qlora", max_steps=4, target=32)):  # (the adapters: the trainable weights)
        assert peer["base_weight"] == "Params4bit", peer
        assert 0 < peer["trainable"] < 100_000, peer  # the adapters only
        assert peer["lora_b_abs"] > 0, "the adapters did not train (peft starts lora_B at zero)"


def test_diloco_with_fp16(swarm):
    for peer in trained_together(swarm("diloco_fp16", max_steps=4, target=32)):  # (the last step is a sync)
        assert peer["scaler"] == "torch.amp.grad_scaler.GradScaler", peer
        assert peer["outer_step"] == 2 and peer["syncs"]["averaged"] == 2, peer


def test_diloco_streaming_fragments_overlapped_with_fp16(swarm):
    """2 fragments (a sync point every 2 of H = 4 inner steps), each sync running while the next inner steps train on
    the GPU. The peers end with the same outer parameters; their models differ by design (each fragment keeps the inner
    steps made since its own last sync)."""
    done = swarm("diloco_streaming_fp16", max_steps=8, target=32)
    a, b = done["a"], done["b"]
    assert a["outer_sha256"] == b["outer_sha256"], "the peers ended with different outer parameters"
    for peer in (a, b):
        assert peer["global_step"] == 8 and peer["devices"] == ["cuda"], peer
        assert peer["losses"] and all(math.isfinite(x) for x in peer["losses"]), peer
        assert peer["outer_step"] == 4 and peer["syncs"]["averaged"] == 4, peer
        assert peer["overlapped_steps"] >= 1, peer


# One fp32 AdamW step of a GPT-2 on the GPU, in a fresh process: the peak of allocated GPU memory (the CUDA context and
# the allocator's cache are not counted). A first, short step creates the gradients and Adam states; the second, with
# the gradients kept, is the step whose peak the calculator predicts. On a GPU dropout keeps bool masks, as the formula
# assumes (tests/test_memory.py measures the same on the CPU, where they are float32).
MEASURE_GPU = """
import json, sys, torch
from transformers import GPT2Config, GPT2LMHeadModel

torch.manual_seed(0)
config = GPT2Config.from_json_file(sys.argv[1])
config._attn_implementation = "eager"  # the attention the formula describes
batch, seq, checkpointing, fp16 = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1", sys.argv[5] == "fp16"
model = GPT2LMHeadModel(config).cuda().train()
if checkpointing:
    model.gradient_checkpointing_enable()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
scaler = torch.amp.GradScaler("cuda", enabled=fp16)  # fp16 as the Trainer trains: fp32 weights, autocast
for rows, length in [(1, 16), (batch, seq)]:
    inputs = torch.randint(0, config.vocab_size, (rows, length), device="cuda")
    with torch.autocast("cuda", dtype=torch.float16, enabled=fp16):
        loss = model(input_ids=inputs, labels=inputs).loss
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=False)
torch.cuda.synchronize()
print(json.dumps({"params": sum(p.numel() for p in model.parameters()), "bytes": torch.cuda.max_memory_allocated()}))
"""


@pytest.mark.parametrize(
    ("checkpointing", "precision"), [(False, "fp32"), (True, "fp32"), (False, "fp16")], ids=["plain", "ckpt", "fp16"]
)
def test_memory_calculator_matches_a_gpu_training_step(tmp_path, checkpointing, precision):
    """GPT-2 small's shape (124M parameters, 12 layers of 768), batch 8 x 512, AdamW: predicted within 15%. fp16 is
    measured as the Trainer trains (fp32 weights and gradients, autocast); the calculator counts fp16 weights and
    gradients with fp32 master weights: the same 16 bytes per parameter with Adam."""
    import json
    import subprocess
    import sys

    from swarm_helpers import ENV
    from transformers import GPT2Config

    from trahiv.memory import MemoryOptions, estimate, resolve_model

    GPT2Config(n_positions=512, activation_function="gelu_pytorch_tanh").save_pretrained(tmp_path)
    config = str(tmp_path / "config.json")
    command = [sys.executable, "-c", MEASURE_GPU, config, "8", "512", str(int(checkpointing)), precision]
    done = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    shape = resolve_model(tmp_path / "config.json")
    assert shape.n_params == measured["params"]
    options = MemoryOptions(batch_size=8, seq_len=512, gradient_checkpointing=checkpointing, precision=precision)
    predicted = estimate(shape, options).total
    print(f"predicted {predicted / 2**20:.0f} MiB, measured {measured['bytes'] / 2**20:.0f} MiB")
    assert predicted == pytest.approx(measured["bytes"], rel=0.15)
