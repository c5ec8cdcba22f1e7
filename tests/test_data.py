"""trahiv.data: streamed, shuffled, packed blocks from local shards (no network: HF offline)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
import torch

from trahiv.data import DataStreamError, StreamingTextDataset, infer_format, pack_blocks, stream_dataset
from trahiv.demo import corpus_text, train_tokenizer

REPO = Path(__file__).resolve().parents[1]
SHARDS, DOCS_PER_SHARD = 4, 100
NUM_DOCS = SHARDS * DOCS_PER_SHARD
BLOCK = 32


def _sentences() -> list[str]:
    text = " ".join(corpus_text().split())  # one line per document, also in .txt files
    return [s for s in re.split(r"(?<=[.!?]) ", text) if s]


def _documents(count: int) -> list[str]:
    """Numbered documents: 'doc 00042: <a sentence of the shipped text>'."""
    sentences = _sentences()
    return [f"doc {i:05d}: {sentences[i % len(sentences)]}" for i in range(count)]


def _write_jsonl(path: Path, rows: Iterable[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(corpus_text())


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return _documents(NUM_DOCS)


@pytest.fixture(scope="module")
def shards(tmp_path_factory, docs) -> Path:
    """SHARDS .jsonl files of DOCS_PER_SHARD numbered documents each (doc i in shard i // DOCS_PER_SHARD)."""
    root = tmp_path_factory.mktemp("shards")
    for s in range(SHARDS):
        rows = ({"id": i, "text": docs[i]} for i in range(s * DOCS_PER_SHARD, (s + 1) * DOCS_PER_SHARD))
        _write_jsonl(root / f"part-{s:02d}.jsonl", rows)
    return root


def _take(dataset: StreamingTextDataset, count: int | None = None) -> list[dict[str, torch.Tensor]]:
    """The first `count` blocks of one start (all if None); closes the iterator."""
    iterator = iter(dataset)
    try:
        return [block for _, block in zip(range(count or sys.maxsize), iterator, strict=False)]
    finally:
        iterator.close()


def _doc_ids(blocks: list[dict[str, torch.Tensor]], tokenizer) -> list[int]:
    """Document numbers in stream order (byte-level BPE decodes the concatenated blocks back to the texts)."""
    if not blocks:
        return []
    text = tokenizer.decode(torch.cat([b["input_ids"] for b in blocks]).tolist())
    return [int(number) for number in re.findall(r"doc (\d{5}):", text)]


def _expected_stream(texts: list[str], tokenizer) -> list[int]:
    stream: list[int] = []
    for text in texts:
        stream += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return stream


def _assert_packed(blocks: list[dict[str, torch.Tensor]], texts: list[str], tokenizer) -> None:
    expected = _expected_stream(texts, tokenizer)
    assert len(blocks) == len(expected) // BLOCK
    for block in blocks:
        assert block["input_ids"].shape == (BLOCK,) and block["input_ids"].dtype == torch.long
        assert torch.equal(block["labels"], block["input_ids"])
        assert torch.equal(block["attention_mask"], torch.ones(BLOCK, dtype=torch.long))
    assert torch.cat([b["input_ids"] for b in blocks]).tolist() == expected[: len(blocks) * BLOCK]


# --- packing and formats ------------------------------------------------------------------------------------------


def test_pack_blocks_joins_with_eos_and_drops_the_remainder():
    assert list(pack_blocks([[1, 2, 3], [4], [5, 6, 7, 8]], block_size=3, eos_token_id=0)) == [
        [1, 2, 3],
        [0, 4, 0],
        [5, 6, 7],
    ]  # the remainder [8, 0] is dropped
    assert list(pack_blocks([], block_size=3, eos_token_id=0)) == []


def test_infer_format():
    assert infer_format(["a/part-0.jsonl", "a/part-1.JSONL.gz"]) == "json"
    assert infer_format(["x.parquet"]) == "parquet"
    assert infer_format(["x.txt.zst"]) == "text"
    with pytest.raises(ValueError, match="format: the files mix"):
        infer_format(["a.jsonl", "b.parquet"])
    with pytest.raises(ValueError, match="format: cannot infer"):
        infer_format(["a.csv"])


def test_unshuffled_stream_is_the_tokenized_documents_joined_by_eos(shards, docs, tokenizer):
    dataset = stream_dataset(str(shards), tokenizer=tokenizer, block_size=BLOCK, seed=0, shuffle=False)
    _assert_packed(_take(dataset), docs, tokenizer)  # shards are read in name order, each in file order


def test_parquet_file(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = _documents(120)
    pq.write_table(pa.table({"id": list(range(120)), "content": texts}), tmp_path / "data.parquet", row_group_size=50)
    dataset = stream_dataset(
        str(tmp_path / "*.parquet"), tokenizer=tokenizer, block_size=BLOCK, seed=0, text_column="content", shuffle=False
    )
    _assert_packed(_take(dataset), texts, tokenizer)


def test_text_file_gives_one_document_per_non_empty_line(tmp_path, tokenizer):
    texts = _documents(80)
    (tmp_path / "corpus.txt").write_text("\n\n".join(texts) + "\n", encoding="utf-8")
    dataset = stream_dataset(str(tmp_path / "corpus.txt"), tokenizer=tokenizer, block_size=BLOCK, seed=0, shuffle=False)
    _assert_packed(_take(dataset), texts, tokenizer)


def test_gzipped_jsonl_shards(tmp_path, tokenizer):
    import gzip

    texts = _documents(60)
    for part in range(2):
        with gzip.open(tmp_path / f"part-{part}.jsonl.gz", "wt", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": text}) + "\n" for text in texts[part * 30 : (part + 1) * 30])
    dataset = stream_dataset(str(tmp_path), tokenizer=tokenizer, block_size=BLOCK, seed=0, shuffle=False)
    _assert_packed(_take(dataset), texts, tokenizer)


# --- order: peers and restarts ------------------------------------------------------------------------------------


def _peer(shards: Path, tokenizer, seed: int, nonce: int | None) -> StreamingTextDataset:
    return stream_dataset(
        str(shards), tokenizer=tokenizer, block_size=BLOCK, seed=seed, restart_nonce=nonce,
        shuffle_buffer=50, max_start_skip=10, interleave_shards=2,
    )  # fmt: skip


def test_two_peers_see_different_orders_and_together_cover_the_data(shards, tokenizer):
    first = _doc_ids(_take(_peer(shards, tokenizer, seed=1, nonce=0)), tokenizer)
    second = _doc_ids(_take(_peer(shards, tokenizer, seed=2, nonce=0)), tokenizer)
    for ids in (first, second):
        assert len(ids) == len(set(ids)), "a document came twice in one pass"
        assert len(ids) >= NUM_DOCS - 1  # skipped documents come at the end; the last one may be cut off
        assert ids != sorted(ids)
    assert first[:20] != second[:20]
    assert set(first) | set(second) == set(range(NUM_DOCS))


def test_a_restart_does_not_begin_with_the_same_prefix(shards, tokenizer):
    def prefix(dataset: StreamingTextDataset) -> list[int]:
        return _doc_ids(_take(dataset, 20), tokenizer)[:10]

    run = prefix(_peer(shards, tokenizer, seed=7, nonce=1))
    assert prefix(_peer(shards, tokenizer, seed=7, nonce=1)) == run  # a fixed nonce makes a start reproducible
    restarted = prefix(_peer(shards, tokenizer, seed=7, nonce=2))
    assert restarted != run and len(set(restarted) & set(run)) < 5
    fresh = [prefix(_peer(shards, tokenizer, seed=7, nonce=None)) for _ in range(2)]  # random nonce per process
    assert fresh[0] != fresh[1]
    dataset = _peer(shards, tokenizer, seed=7, nonce=1)
    assert prefix(dataset) == run and prefix(dataset) != run  # the next iter() of one object is a new start


# --- background producer ------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_malformed_shard_raises_in_the_consumer(tmp_path, docs, tokenizer):
    _write_jsonl(tmp_path / "a.jsonl", ({"id": i, "text": docs[i]} for i in range(50)))
    (tmp_path / "b.jsonl").write_text('{"id": 50, "text": "fine"}\n{"id": 51, "text": "broken\n', encoding="utf-8")
    dataset = stream_dataset(str(tmp_path), tokenizer=tokenizer, block_size=BLOCK, seed=0, shuffle_buffer=8)
    with pytest.raises(DataStreamError, match=r"streaming .* failed: \w+") as info:
        _take(dataset)
    assert info.value.__cause__ is not None


@pytest.mark.timeout(60)
def test_a_missing_text_column_raises_in_the_consumer(shards, tokenizer):
    dataset = stream_dataset(str(shards), tokenizer=tokenizer, block_size=BLOCK, seed=0, text_column="body")
    with pytest.raises(DataStreamError, match="text_column 'body' is not among the dataset's columns"):
        _take(dataset, 1)


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "trahiv-data-prefetch"]


@pytest.mark.timeout(60)
def test_dropping_the_iterator_stops_the_producer(shards, tokenizer):
    dataset = stream_dataset(str(shards), tokenizer=tokenizer, block_size=BLOCK, seed=0, prefetch=2)
    iterator = iter(dataset)
    next(iterator)
    assert _prefetch_threads(), "no producer thread"
    del iterator
    deadline = time.monotonic() + 10
    while _prefetch_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _prefetch_threads()


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"block_size": 0}, "block_size"),
        ({"shuffle_buffer": -1}, "shuffle_buffer"),
        ({"prefetch": 0}, "prefetch"),
        ({"max_start_skip": -1}, "max_start_skip"),
        ({"seed": "peer"}, "seed"),
        ({"format": "csv"}, "format"),
        ({"data_files": ["x.jsonl"]}, "data_files"),
    ],
)
def test_bad_options_raise_value_error_naming_the_field(shards, tokenizer, options, field):
    kwargs = {"tokenizer": tokenizer, "block_size": BLOCK, "seed": 0, **options}
    with pytest.raises(ValueError, match=field):
        stream_dataset(str(shards), **kwargs)


def test_missing_local_path_fails_at_once(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="path"):
        stream_dataset(str(tmp_path / "nothing" / "*.jsonl"), tokenizer=tokenizer, block_size=BLOCK, seed=0)
    with pytest.raises(ValueError, match="path"):
        stream_dataset(str(tmp_path / "nothing"), tokenizer=tokenizer, block_size=BLOCK, seed=0)


# --- memory -------------------------------------------------------------------------------------------------------

_MEMORY_PROBE = r"""
import json, resource, sys, psutil
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from trahiv.data import stream_dataset

# word-level tokenizer on long words: fast, so the probe measures the stream's memory, not BPE speed
backend = Tokenizer(models.WordLevel({"<unk>": 0, "<eos>": 1}, unk_token="<unk>"))
backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="<unk>")

def drain(path):
    dataset = stream_dataset(path, tokenizer=tokenizer, block_size=64, seed=1, shuffle_buffer=int(sys.argv[3]))
    return sum(1 for _ in dataset)

drain(sys.argv[2])  # warm up: imports, reader and tokenizer thread pools are not growth
base = psutil.Process().memory_info().rss
blocks = drain(sys.argv[1])
# VmHWM (this process's peak RSS); ru_maxrss would also count the parent's RSS at fork, before exec
peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"blocks": blocks, "base": base, "peak": peak}))
"""


def _write_random_shards(root: Path, total_bytes: int, shards: int) -> int:
    """`shards` .jsonl files of ~5 KB documents made of 50-letter words; returns the number of documents."""
    import random

    rng = random.Random(0)
    words = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=50)) for _ in range(1000)]
    root.mkdir(parents=True)
    count = 0
    for s in range(shards):
        with open(root / f"part-{s:03d}.jsonl", "w", encoding="utf-8") as f:
            written = 0
            while written < total_bytes // shards:
                line = json.dumps({"id": count, "text": f"doc-{count} " + " ".join(rng.choices(words, k=100))}) + "\n"
                written += f.write(line)
                count += 1
    return count


@pytest.mark.timeout(120)
def test_memory_stays_bounded_on_a_dataset_much_larger_than_the_buffer(tmp_path, capsys):
    size, buffer = 200_000_000, 2_000
    docs = _write_random_shards(tmp_path / "big", size, shards=8)
    _write_random_shards(tmp_path / "warm", 2_000_000, shards=8)
    data_bytes = sum(f.stat().st_size for f in (tmp_path / "big").iterdir())
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "true"}
    args = [sys.executable, "-c", _MEMORY_PROBE, str(tmp_path / "big"), str(tmp_path / "warm"), str(buffer)]
    result = subprocess.run(args, capture_output=True, text=True, timeout=110, cwd=REPO, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    probe = json.loads(result.stdout.strip().splitlines()[-1])
    growth = probe["peak"] - probe["base"]
    with capsys.disabled():
        print(
            f"\n[memory] {data_bytes / 1e6:.0f} MB of jsonl ({docs} docs of ~5 KB, 8 shards), shuffle_buffer={buffer} "
            f"docs (~{buffer * 5 / 1e3:.0f} MB): peak RSS growth {growth / 1e6:.1f} MB over {probe['blocks']} blocks"
        )
    assert probe["blocks"] > 0
    assert growth < data_bytes / 3


# --- consumers ----------------------------------------------------------------------------------------------------


def test_dataloader_without_workers(shards, tokenizer):
    dataset = stream_dataset(str(shards), tokenizer=tokenizer, block_size=BLOCK, seed=3, shuffle_buffer=20)
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, num_workers=0)
    batches = [batch for _, batch in zip(range(3), loader, strict=False)]
    assert len(batches) == 3
    for batch in batches:
        assert batch["input_ids"].shape == (4, BLOCK)
        assert torch.equal(batch["labels"], batch["input_ids"])


@pytest.mark.timeout(60)
def test_dataloader_workers_share_the_data_instead_of_repeating_it(shards, tokenizer):
    def count(workers: int) -> int:
        dataset = stream_dataset(str(shards), tokenizer=tokenizer, block_size=BLOCK, seed=3, shuffle_buffer=20)
        return sum(1 for _ in torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=workers))

    single = count(0)
    assert abs(count(2) - single) <= 2  # each worker drops its own last partial block


@pytest.mark.timeout(120)
def test_transformers_trainer_trains_on_the_stream(shards, tokenizer, tmp_path):
    import transformers

    dataset = stream_dataset(str(shards), tokenizer=tokenizer, block_size=BLOCK, seed=5, shuffle_buffer=20)
    torch.manual_seed(0)
    eos = tokenizer.eos_token_id
    config = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=len(tokenizer), n_positions=BLOCK, bos_token_id=eos, eos_token_id=eos
    )
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], max_steps=3, save_strategy="no",
        per_device_train_batch_size=4, logging_steps=1, disable_tqdm=True,
    )  # fmt: skip
    trainer = transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=args, train_dataset=dataset)
    result = trainer.train()
    assert trainer.state.global_step == 3
    assert result.training_loss > 0
