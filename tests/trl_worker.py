"""A trainer peer with trahiv.trl.SFTTrainer and LoRA (`peft_config`): `python tests/trl_worker.py SPEC.json`.

As tests/peer_worker.py (whose Recorder writes ready.json and records.jsonl), with TRL's SFT: a text dataset, TRL's
tokenization and collator, PEFT applied by TRL. Writes done.json (with TRL's own logged metrics) and final.pt.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import datasets
import torch
import transformers

from trahiv.demo import corpus_text
from trahiv.trl import SFTConfig, SFTTrainer  # before peft and peer_worker: trahiv quiets bitsandbytes' notice


def text_dataset(rows: int) -> datasets.Dataset:
    paragraphs = [p.strip() for p in corpus_text().split("\n\n") if p.strip()]
    return datasets.Dataset.from_dict({"text": paragraphs[:rows]})


def main(spec_path: str) -> int:
    import peft
    from peer_worker import Recorder

    spec = json.loads(Path(spec_path).read_text())
    out, workdir = Path(spec["out"]), Path(spec["workdir"])
    opt = {"run_id": spec["run_id"], "target_batch_size": spec["target"], "matchmaking_time": 2.0,
           "averaging_timeout": 30.0, **spec.get("opt", {})}  # fmt: skip
    dht = {"initial_peers": spec.get("initial_peers", []), "nat_port_map": False, "client_mode": False}
    args = SFTConfig(
        output_dir=str(out / "output"),
        per_device_train_batch_size=spec["batch_size"],
        max_steps=spec["max_steps"],
        learning_rate=1e-2,
        max_length=64,
        bf16=False,
        use_cpu=True,
        logging_steps=1,
        report_to=[],
        disable_tqdm=True,
        save_strategy="no",
        hivemind_config={"dht": dht, "opt": opt},
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(workdir / "tokenizer")
    model = transformers.AutoModelForCausalLM.from_pretrained(workdir / "model")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True,
                           task_type="CAUSAL_LM")  # fmt: skip
    trainer = SFTTrainer(model=model, args=args, train_dataset=text_dataset(32), processing_class=tokenizer,
                         peft_config=lora)  # fmt: skip
    trainer.add_callback(Recorder(trainer, spec, out))
    trainer.train()
    logged = sorted({key for row in trainer.state.log_history for key in row})
    done = {"global_step": trainer.state.global_step, "logged": logged, "type": type(trainer).__mro__[1].__module__,
            "averaging_rounds": trainer.swarm.optimizer.averaging_rounds()}  # fmt: skip
    torch.save({n: p.detach() for n, p in trainer.model.named_parameters()}, out / "final.pt")
    (out / "done.json").write_text(json.dumps(done))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
