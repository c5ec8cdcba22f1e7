"""Fine-tune a causal language model, alone or with a swarm: transformers' run_clm pattern with trahiv's Trainer.

    # alone, tiny, on a CPU, offline (a 2-layer GPT-2 from a config, a tokenizer trained on trahiv's demo text):
    python examples/train_clm.py --tiny --output_dir out --max_steps 20 --use_cpu
    # a real model and your text, joining a swarm (the first peer leaves initial_peers out, the others copy the
    # address it prints):
    python examples/train_clm.py --model_name_or_path gpt2 --train_file my_text.txt --output_dir out \
        --per_device_train_batch_size 8 --max_steps 1000 --hivemind_config swarm.yaml

Every TrainingArguments flag works (`--learning_rate`, `--optim`, `--fp16`, ...); `--hivemind_config` takes a
JSON/YAML file or a JSON string. The auth token of a moderated swarm can stay out of the file: TRAHIV_AUTH_TOKEN.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser, default_data_collator

import trahiv

logger = logging.getLogger("train_clm")


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": "a Hub model id or a local folder"})
    tiny: bool = field(default=False, metadata={"help": "a 2-layer GPT-2 from a config: seconds on a CPU, offline"})


@dataclass
class DataArguments:
    train_file: str | None = field(default=None, metadata={"help": "a UTF-8 text file (default: trahiv's demo text)"})
    block_size: int = field(default=64, metadata={"help": "tokens per training sample"})


def load_model(model_args: ModelArguments):
    if model_args.tiny:
        from transformers import GPT2LMHeadModel

        from trahiv.demo import corpus_text, tiny_gpt2_config, train_tokenizer

        tokenizer = train_tokenizer(corpus_text())
        return tokenizer, GPT2LMHeadModel(tiny_gpt2_config(vocab_size=len(tokenizer), n_embd=64, n_head=2))
    if not model_args.model_name_or_path:
        raise SystemExit("give --model_name_or_path (e.g. gpt2) or --tiny")
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    return tokenizer, AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path)


def blocks(text: str, tokenizer, block_size: int) -> list[dict[str, torch.Tensor]]:
    """The text as consecutive blocks of `block_size` tokens (labels = inputs: the model shifts them)."""
    ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
    usable = len(ids) // block_size * block_size
    return [{"input_ids": row, "labels": row} for row in ids[:usable].view(-1, block_size)]


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(format="%(asctime)s %(name)s %(message)s", level=logging.INFO)
    parser = HfArgumentParser((ModelArguments, DataArguments, trahiv.TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(argv)
    logger.info("Training/evaluation parameters %s", training_args)  # (an auth token shows as <redacted>)
    tokenizer, model = load_model(model_args)
    if data_args.train_file:
        text = Path(data_args.train_file).read_text(encoding="utf-8")
    else:
        from trahiv.demo import corpus_text

        text = corpus_text()
    dataset = blocks(text, tokenizer, data_args.block_size)
    collator = default_data_collator
    trainer = trahiv.Trainer(model=model, args=training_args, train_dataset=dataset, data_collator=collator)
    result = trainer.train()
    trainer.save_model()
    logger.info("train_loss %.4f after %d steps", result.training_loss, trainer.state.global_step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
