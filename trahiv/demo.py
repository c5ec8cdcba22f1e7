"""The demo's ingredients, all local: a tokenizer trained on the shipped text, a small GPT-2 built from a config, and
the text cut into fixed-length blocks. Used by `trahiv demo`, the tests and the benchmarks."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import torch

__all__ = ["BlockDataset", "corpus_text", "prepare_workdir", "tiny_gpt2_config"]

BLOCK_SIZE = 64
VOCAB_SIZE = 512


def corpus_text() -> str:
    return resources.files("trahiv").joinpath("data/demo_corpus.txt").read_text(encoding="utf-8")


def tiny_gpt2_config(vocab_size: int = VOCAB_SIZE, n_layer: int = 2, n_embd: int = 128, n_head: int = 4):
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=vocab_size, n_positions=BLOCK_SIZE, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip


def train_tokenizer(text: str, vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE tokenizer trained on `text` (no download), wrapped as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(text.split("\n\n"), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def prepare_workdir(workdir: str | Path, seed: int = 0) -> Path:
    """Write tokenizer/, model/ (config + initial weights, loadable with from_pretrained), blocks.pt and shards/."""
    from transformers import GPT2LMHeadModel

    workdir = Path(workdir)
    text = corpus_text()
    tokenizer = train_tokenizer(text)
    tokenizer.save_pretrained(workdir / "tokenizer")
    torch.manual_seed(seed)
    GPT2LMHeadModel(tiny_gpt2_config(vocab_size=len(tokenizer))).save_pretrained(workdir / "model")
    ids = tokenizer(text)["input_ids"]
    usable = len(ids) // BLOCK_SIZE * BLOCK_SIZE
    blocks = torch.tensor(ids[:usable], dtype=torch.long).view(-1, BLOCK_SIZE)
    # overlapping windows (stride half a block) give the demo more distinct samples from a small text
    shifted = torch.tensor(ids[BLOCK_SIZE // 2 :][: usable - BLOCK_SIZE], dtype=torch.long).view(-1, BLOCK_SIZE)
    torch.save(torch.cat([blocks, shifted]), workdir / "blocks.pt")
    write_shards(text, workdir / "shards")
    return workdir


def write_shards(text: str, folder: Path, shards: int = 4) -> Path:
    """The text as JSON-lines shards, one paragraph per record: what trahiv.data streams in the demo."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
    for index in range(shards):
        with open(folder / f"part-{index:02d}.jsonl", "w", encoding="utf-8") as f:
            for paragraph in paragraphs[index::shards]:
                f.write(json.dumps({"text": paragraph}) + "\n")
    return folder


class BlockDataset(torch.utils.data.Dataset):
    """Fixed-length token blocks for causal LM training (labels = inputs; the model shifts them)."""

    def __init__(self, blocks: torch.Tensor):
        self.blocks = blocks

    @classmethod
    def load(cls, path: str | Path) -> BlockDataset:
        return cls(torch.load(path))

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict[str, Any]:
        block = self.blocks[index]
        return {"input_ids": block, "labels": block.clone()}
