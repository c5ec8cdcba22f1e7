"""A trainer peer on a CUDA GPU for tests/test_cuda.py: `python tests/cuda_worker.py SPEC.json`.

SPEC["mode"] picks what runs on the GPU, as a user's Trainer script would:
- fp16_toy:  fp16 (the Trainer's GradScaler) on a model whose every gradient is exactly 0.5, SGD lr 1; with
             SPEC["overflow_at"], that forward pass of this peer returns an infinite loss (its step overflows)
- fp16:      fp16 on the tiny GPT-2 with AdamW and gradient clipping
- bf16:      the tiny GPT-2 loaded in bf16, its optimizer on the GPU, gradients and parameters averaged in 8 bits
- bnb8bit:   bitsandbytes' 8-bit AdamW with its states on the GPU (offload_optimizer False)
- qlora:     the tiny GPT-2 loaded in 4 bits (nf4, bitsandbytes) with LoRA adapters, bf16 autocast
- diloco_fp16: DiLoCo (2 inner steps) with fp16 on the tiny GPT-2
- diloco_streaming_fp16: the same with 2 fragments synced in turn, each sync overlapped with the next inner steps
It writes SPEC["out"]/done.json: steps, losses, logged gradient norms, the scaler's scale, the trainable parameters'
sha256 (peers must end identical), and what the optimizer states and base weights are.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch
import transformers
from test_fp16_scaler import Toy  # every gradient exactly 0.5; an infinite loss at its `overflow_at`-th forward pass

from trahiv import Trainer, TrainingArguments
from trahiv.demo import BlockDataset


def build(spec: dict) -> tuple[torch.nn.Module, dict]:
    mode, model_dir = spec["mode"], Path(spec["workdir"]) / "model"
    if mode == "fp16_toy":
        return Toy(spec.get("overflow_at")), {"fp16": True, "optim": "sgd", "learning_rate": 1.0,
                                             "lr_scheduler_type": "constant", "max_grad_norm": 10.0}  # fmt: skip
    if mode in ("fp16", "diloco_fp16", "diloco_streaming_fp16"):
        return transformers.AutoModelForCausalLM.from_pretrained(model_dir), {"fp16": True}
    if mode == "bf16":  # weights in bf16 (no autocast): the states stay on the GPU, gradients travel in 8 bits
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
        return model, {}
    if mode == "bnb8bit":
        return transformers.AutoModelForCausalLM.from_pretrained(model_dir), {"optim": "adamw_bnb_8bit"}
    if mode == "qlora":
        import peft

        quantization = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
        )
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=quantization)
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True)
        return peft.get_peft_model(model, lora), {"bf16": True}
    raise ValueError(f"unknown mode {mode!r}")


def sha256(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for _, p in model.named_parameters():
        if p.requires_grad:
            digest.update(p.detach().float().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    model, kwargs = build(spec)
    opt = {"run_id": spec["run_id"], "target_batch_size": spec["target"], "matchmaking_time": 2.0,
           "averaging_timeout": 30.0, "min_peers": 2, **spec.get("opt", {})}  # fmt: skip
    if spec["mode"] == "bnb8bit":
        opt["offload_optimizer"] = False  # bitsandbytes' CUDA kernels update the states on the GPU
    if spec["mode"] == "bf16":  # (hivemind cannot offload bf16 parameters; fp16 codecs refuse bf16)
        opt.update(offload_optimizer=False, grad_compression="uniform8bit", state_averaging_compression="uniform8bit")
    config = {"dht": {"initial_peers": spec["initial_peers"], "nat_port_map": False, "client_mode": False}, "opt": opt}
    if spec["mode"] == "diloco_fp16":
        config["diloco"] = {"inner_steps": 2, "compression": "fp16"}
    if spec["mode"] == "diloco_streaming_fp16":
        config["diloco"] = {"inner_steps": 4, "fragments": 2, "overlap": True, "compression": "fp16"}
    toy = spec["mode"] == "fp16_toy"
    args = TrainingArguments(
        output_dir=str(out / "output"), per_device_train_batch_size=spec["batch_size"], max_steps=spec["max_steps"],
        weight_decay=0.0, logging_steps=1, report_to=[], disable_tqdm=True, save_strategy="no",
        dataloader_drop_last=toy, hivemind_config=config, **{"learning_rate": 3e-3, **kwargs},
    )  # fmt: skip
    if toy:
        dataset: list | BlockDataset = [{"input_ids": torch.tensor([1, 2])} for _ in range(256)]
    else:
        dataset = BlockDataset.load(Path(spec["workdir"]) / "blocks.pt")
    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    trainer.train()
    diloco = spec["mode"].startswith("diloco")
    swarm_opt = trainer.swarm.diloco if diloco else trainer.swarm.optimizer
    inner = getattr(swarm_opt, "opt", None) or getattr(swarm_opt, "inner", None)
    states = {}
    for group in getattr(inner, "param_groups", []):
        for p in group["params"]:
            for key, value in inner.state.get(p, {}).items():
                if torch.is_tensor(value) and value.numel() > 1:
                    states.setdefault(f"{key}:{value.dtype}:{value.device.type}", 0)
                    states[f"{key}:{value.dtype}:{value.device.type}"] += 1
    scaler = trainer.accelerator.scaler
    done = {
        "global_step": trainer.state.global_step,
        "losses": [row["loss"] for row in trainer.state.log_history if "loss" in row],
        "grad_norms": [row["grad_norm"] for row in trainer.state.log_history if "grad_norm" in row],
        "scaler": None if scaler is None else f"{type(scaler).__module__}.{type(scaler).__name__}",
        "scale": None if scaler is None else float(scaler.get_scale()),
        "sha256": sha256(trainer.model),
        "devices": sorted({p.device.type for p in trainer.model.parameters()}),
        "trainable": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        "optimizer": f"{type(inner).__module__}.{type(inner).__name__}",
        "states": states,
        "base_weight": type(dict(trainer.model.named_parameters()).get(
            "base_model.model.transformer.h.0.attn.c_attn.base_layer.weight", torch.empty(0))).__name__,
        "lora_b_abs": sum(float(p.detach().abs().sum()) for n, p in trainer.model.named_parameters() if "lora_B" in n),
        "samples_contributed": getattr(swarm_opt, "samples_contributed", None),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "max_memory_allocated": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None,
    }  # fmt: skip
    if diloco:
        done.update(outer_step=swarm_opt.outer_step, syncs=dict(swarm_opt.syncs), outer_sha256=swarm_opt.outer_digest,
                    overlapped_steps=swarm_opt.overlapped_steps)  # fmt: skip
    if toy:
        done["values"] = trainer.model.w.detach().cpu().tolist()
    (out / "done.json").write_text(json.dumps(done))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
