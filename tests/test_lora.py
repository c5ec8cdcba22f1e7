"""PEFT LoRA in a swarm: only the adapters are optimized and averaged; the base model never changes."""

from __future__ import annotations

import pytest
import torch
import transformers
from swarm_helpers import start_bootstrap, start_peer

pytestmark = pytest.mark.swarm


def test_lora_peers_average_only_adapters(tmp_path, workdir):
    boot = start_bootstrap(tmp_path)
    common = dict(
        workdir=str(workdir),
        run_id="lora",
        target=48,
        max_steps=4,
        lora=True,
        lr=1e-2,
        initial_peers=boot.initial_peers,
        opt={"min_peers": 2, "average_state_every": 1},
    )
    try:
        a = start_peer(tmp_path, "a", batch_size=8, **common)
        b = start_peer(tmp_path, "b", batch_size=4, **common)
        ready = a.ready()
        a.finish(), b.finish()
    finally:
        boot.stop()
    final_a, final_b = (torch.load(p.out / "final.pt") for p in (a, b))
    initial = transformers.AutoModelForCausalLM.from_pretrained(workdir / "model").state_dict()
    adapters = [name for name in final_a if "lora_" in name]
    assert len(adapters) == 2 * 2  # lora_A and lora_B in each of the 2 layers' c_attn
    assert ready["averaged_tensors"] == len(adapters), "something besides the adapters is averaged"
    for name, value in final_a.items():
        if "lora_" in name:
            assert torch.allclose(value, final_b[name], atol=1e-6), f"{name} differs between peers"
        else:
            base_name = name.removeprefix("base_model.model.").replace(".base_layer", "")
            assert torch.equal(value, initial[base_name]), f"base weight {name} changed"
            assert torch.equal(final_b[name], initial[base_name])
    lora_b = [name for name in adapters if "lora_B" in name]
    assert all(final_a[name].abs().sum() > 0 for name in lora_b), "the adapters did not train (lora_B still zero)"
