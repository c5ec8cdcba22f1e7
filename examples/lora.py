"""LoRA fine-tuning with a swarm: PEFT adapters train and are averaged; the base model stays frozen and local.

    # tiny, on a CPU, offline (2-layer GPT-2 from a config):
    python examples/lora.py --tiny --output_dir out --max_steps 20 --use_cpu
    # a real model, joining a swarm (every peer must use the same model and the same LoRA settings):
    python examples/lora.py --model_name_or_path gpt2 --target_modules c_attn --output_dir out --max_steps 500 \
        --hivemind_config swarm.yaml   # {"dht": {"initial_peers": [...]}, "opt": {"run_id": ..., ...}}

Only the adapters cross the network: a few MB per round instead of the whole model.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import peft
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser, default_data_collator

import trahiv


@dataclass
class LoraArguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": "a Hub model id or a local folder"})
    tiny: bool = field(default=False, metadata={"help": "a 2-layer GPT-2 from a config: seconds on a CPU, offline"})
    r: int = field(default=8, metadata={"help": "LoRA rank"})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA scaling"})
    target_modules: str = field(default="c_attn", metadata={"help": "comma-separated module names (GPT-2: c_attn)"})
    block_size: int = field(default=64, metadata={"help": "tokens per training sample"})


def load(lora_args: LoraArguments):
    if lora_args.tiny:
        from transformers import GPT2LMHeadModel

        from trahiv.demo import corpus_text, tiny_gpt2_config, train_tokenizer

        tokenizer = train_tokenizer(corpus_text())
        return tokenizer, GPT2LMHeadModel(tiny_gpt2_config(vocab_size=len(tokenizer), n_embd=64, n_head=2))
    if not lora_args.model_name_or_path:
        raise SystemExit("give --model_name_or_path (e.g. gpt2) or --tiny")
    return (AutoTokenizer.from_pretrained(lora_args.model_name_or_path),
            AutoModelForCausalLM.from_pretrained(lora_args.model_name_or_path))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = HfArgumentParser((LoraArguments, trahiv.TrainingArguments))
    lora_args, training_args = parser.parse_args_into_dataclasses(argv)
    tokenizer, model = load(lora_args)
    config = peft.LoraConfig(
        r=lora_args.r,
        lora_alpha=lora_args.lora_alpha,
        target_modules=lora_args.target_modules.split(","),
        lora_dropout=0.0,
        fan_in_fan_out=model.config.model_type == "gpt2",  # GPT-2's Conv1D stores weights transposed
        task_type="CAUSAL_LM",
    )
    model = peft.get_peft_model(model, config)
    model.print_trainable_parameters()
    from trahiv.demo import corpus_text

    ids = torch.tensor(tokenizer(corpus_text())["input_ids"], dtype=torch.long)
    size = lora_args.block_size
    dataset = [{"input_ids": row, "labels": row} for row in ids[: len(ids) // size * size].view(-1, size)]
    collator = default_data_collator
    trainer = trahiv.Trainer(model=model, args=training_args, train_dataset=dataset, data_collator=collator)
    trainer.train()
    model.save_pretrained(training_args.output_dir)  # the adapters only
    return 0


if __name__ == "__main__":
    sys.exit(main())
