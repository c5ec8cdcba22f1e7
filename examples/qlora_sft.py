"""QLoRA supervised fine-tuning with TRL's SFTTrainer, in a swarm: a 4-bit base model, LoRA adapters averaged.

    # tiny, on a CPU, offline (2-layer GPT-2 from a config, no quantization, trahiv's demo text):
    python examples/qlora_sft.py --tiny --output_dir out --max_steps 10 --use_cpu --bf16 false
    # real size, on a GPU (Colab/Kaggle T4 included): a 4-bit model from the Hub, a text dataset, a swarm:
    python examples/qlora_sft.py --model_name_or_path Qwen/Qwen2.5-0.5B --dataset_name stanfordnlp/imdb \
        --output_dir out --per_device_train_batch_size 4 --gradient_accumulation_steps 4 --max_steps 200 \
        --learning_rate 2e-4 --optim paged_adamw_8bit --fp16 true --bf16 false --hivemind_config swarm.yaml

Every peer must use the same base model and LoRA settings (trahiv refuses a peer whose trainable tensors differ).
Needs `pip install 'trahiv[trl]'`; the 4-bit path needs a CUDA GPU (bitsandbytes).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import datasets
import peft
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, HfArgumentParser

from trahiv.trl import SFTConfig, SFTTrainer


@dataclass
class ScriptArguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": "a Hub model id or a local folder"})
    tiny: bool = field(default=False, metadata={"help": "a 2-layer GPT-2 from a config, no 4-bit: a CPU, offline"})
    dataset_name: str | None = field(default=None, metadata={"help": "a Hub dataset with a 'text' column"})
    load_in_4bit: bool = field(default=True, metadata={"help": "QLoRA: load the base model in 4 bits (CUDA)"})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank"})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA scaling"})


def load_model(script: ScriptArguments, args: SFTConfig):
    if script.tiny:
        from transformers import GPT2LMHeadModel

        from trahiv.demo import corpus_text, tiny_gpt2_config, train_tokenizer

        tokenizer = train_tokenizer(corpus_text())
        model = GPT2LMHeadModel(tiny_gpt2_config(vocab_size=len(tokenizer), n_embd=64, n_head=2))
        return tokenizer, model, ["c_attn"]
    if not script.model_name_or_path:
        raise SystemExit("give --model_name_or_path (e.g. Qwen/Qwen2.5-0.5B) or --tiny")
    quantization = None
    if script.load_in_4bit:
        if not torch.cuda.is_available():
            raise SystemExit("--load_in_4bit needs a CUDA GPU: pass --load_in_4bit false to train in full precision")
        compute = torch.bfloat16 if args.bf16 else torch.float16
        quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                          bnb_4bit_compute_dtype=compute, bnb_4bit_use_double_quant=True)  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(script.model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(script.model_name_or_path, quantization_config=quantization)
    if quantization is not None:  # adapters in float32 on a frozen 4-bit base (trahiv offloads float32 adapters)
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=args.gradient_checkpointing)
    return tokenizer, model, "all-linear"


def load_data(script: ScriptArguments) -> datasets.Dataset:
    if script.dataset_name:
        return datasets.load_dataset(script.dataset_name, split="train")
    from trahiv.demo import corpus_text

    paragraphs = [p.strip() for p in corpus_text().split("\n\n") if p.strip()]
    return datasets.Dataset.from_dict({"text": paragraphs})


def main(argv: list[str] | None = None) -> int:
    parser = HfArgumentParser((ScriptArguments, SFTConfig))
    script, args = parser.parse_args_into_dataclasses(argv)
    tokenizer, model, targets = load_model(script, args)
    lora = peft.LoraConfig(r=script.lora_r, lora_alpha=script.lora_alpha, lora_dropout=0.05, target_modules=targets,
                           fan_in_fan_out=model.config.model_type == "gpt2", task_type="CAUSAL_LM")  # fmt: skip
    trainer = SFTTrainer(model=model, args=args, train_dataset=load_data(script), processing_class=tokenizer,
                         peft_config=lora)  # fmt: skip
    trainer.train()
    trainer.save_model()  # the adapters
    return 0


if __name__ == "__main__":
    sys.exit(main())
