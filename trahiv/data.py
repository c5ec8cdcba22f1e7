"""Stream a text dataset for a volunteer peer: start at once, read a random portion, never hold the whole dataset.

`stream_dataset(...)` returns a `torch.utils.data.IterableDataset` of fixed-length causal-LM blocks that the
transformers Trainer accepts as `train_dataset` (with `max_steps` set). In a DataLoader with `num_workers > 0` each
worker reads its share of the shards (or every n-th example when the workers don't divide the shard count).

1. `datasets.load_dataset(..., streaming=True)` reads a Hub dataset or local JSON-lines / Parquet / text shards
   (a file, a directory or a glob; the builder is inferred from the extensions when `format` is None; text files
   give one example per line);
2. `datasets.IterableDataset.shuffle` shuffles the shard order and interleaves `interleave_shards` shards; the
   examples then go through a shuffle buffer of `shuffle_buffer` texts, and the first `skip` of them are set aside
   and come last (the start begins at a random offset of the shuffled stream and wraps around);
3. texts are tokenized in small batches, joined with the tokenizer's eos token and cut into `block_size` blocks
   (the remainder at the very end is dropped);
4. a background thread keeps a bounded queue of `prefetch` blocks filled, so training starts with the first block.
   The thread stops when the iterator is exhausted, closed or dropped; its exceptions are raised in the consumer as
   `DataStreamError`.

Restarts: each `iter()` of the dataset is one *start*. Its seed mixes the caller's `seed` (per peer, e.g.
`Swarm.peer_seed()`), a `restart_nonce` (by default drawn at random when the dataset object is created, so it is new
in every process), the epoch given to `set_epoch` and the number of earlier starts of this object. That seed orders
the shards and the shuffle buffer, and picks `skip` uniformly in [0, `max_start_skip`]: a peer that restarts begins
at a new random position instead of repeating the same prefix. The skipped examples are not lost: they are yielded
at the end of the pass, so one full pass still sees every example exactly once. Pass `restart_nonce` to make a run
reproducible (`StreamingTextDataset.last_start` shows the seed and skip in use). With `shuffle=False` the stream is
read in order, nothing is skipped and the seeds are ignored.

Memory is bounded whatever the dataset size: at most `shuffle_buffer` + `max_start_skip` texts, plus ~1 MB of JSON
(or one Parquet record batch) per open shard and the reader's small arrow buffer, plus one tokenizer call (at most
128K characters unless a single text is longer), plus `prefetch` blocks.
"""

from __future__ import annotations

import glob
import hashlib
import itertools
import logging
import numbers
import os
import queue
import random
import secrets
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch

logger = logging.getLogger("trahiv.data")

__all__ = [
    "FORMAT_BY_EXTENSION",
    "DataStreamError",
    "StartPlan",
    "StreamConfig",
    "StreamingTextDataset",
    "infer_format",
    "pack_blocks",
    "rotate",
    "shuffle_buffer",
    "stream_dataset",
]

FORMAT_BY_EXTENSION = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}
_COMPRESSION_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".lz4")
_GLOB_CHARS = frozenset("*?[")
_JSON_CHUNK_BYTES = 1 << 20  # bytes the JSON reader parses at a time per open shard
_READ_BATCH = 64  # rows taken from datasets at a time
_TOKENIZE_CHARS = 1 << 17  # characters tokenized per call at most (unless one text is longer)

T = TypeVar("T")


class DataStreamError(RuntimeError):
    """Reading, tokenizing or packing failed in the background producer; the original exception is `__cause__`."""


@dataclass(frozen=True, kw_only=True)
class StreamConfig:
    """What to stream and how; every check raises ValueError naming the bad field."""

    path: str  # Hub dataset name, builder name ("json", "parquet", "text") or local file / directory / glob
    block_size: int  # tokens per yielded block
    seed: int | None  # per-peer seed; None: trahiv.Trainer sets it from the peer's identity (use_peer_seed)
    data_files: str | list[str] | None = None  # files or patterns for a Hub dataset or builder name
    split: str = "train"
    name: str | None = None  # dataset configuration name on the Hub
    text_column: str = "text"
    format: str | None = None  # builder for local files; inferred from extensions when None
    shuffle: bool = True  # False: read in order, skip nothing (deterministic; for tests and evaluation)
    shuffle_buffer: int = 10_000  # texts held for shuffling (memory bound; the first block waits for it to fill)
    interleave_shards: int = 4  # shards read at once, in a random order, to feed the buffer
    max_start_skip: int = 1_000  # each start defers a random number in [0, max_start_skip] of examples to its end
    restart_nonce: int | None = None  # None: drawn at random per dataset object (new in every process)
    prefetch: int = 64  # blocks the background thread keeps ready
    tokenize_batch: int = 64  # texts tokenized per call
    load_kwargs: Mapping[str, Any] = field(default_factory=dict)  # extra load_dataset kwargs (e.g. sample_by)

    def __post_init__(self) -> None:
        for name in ("block_size", "shuffle_buffer", "interleave_shards", "prefetch", "tokenize_batch"):
            _check_int(name, getattr(self, name), minimum=1)
        _check_int("max_start_skip", self.max_start_skip, minimum=0)
        if self.seed is not None:
            _check_int("seed", self.seed)
        if self.restart_nonce is not None:
            _check_int("restart_nonce", self.restart_nonce)
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"path must be a non-empty string, got {self.path!r}")
        if not isinstance(self.text_column, str) or not self.text_column:
            raise ValueError(f"text_column must be a non-empty string, got {self.text_column!r}")
        if self.format is not None and self.format not in set(FORMAT_BY_EXTENSION.values()):
            raise ValueError(f"format must be one of json, parquet, text or None, got {self.format!r}")
        if self.data_files is not None and not isinstance(self.data_files, str | list):
            raise ValueError(f"data_files must be a string, a list of strings or None, got {self.data_files!r}")
        if not isinstance(self.load_kwargs, Mapping):
            raise ValueError(f"load_kwargs must be a mapping, got {type(self.load_kwargs).__name__}")


@dataclass(frozen=True)
class StartPlan:
    """How one start reads the stream: its shuffle seed and how many shuffled examples it defers to its end."""

    index: int
    seed: int
    skip: int


def _check_int(name: str, value: Any, minimum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


# --- where the data comes from ----------------------------------------------------------------------------------


def infer_format(files: Iterable[str]) -> str:
    """The datasets builder ("json", "parquet" or "text") for these files, from their extensions.

    Compression suffixes (.gz, .zst, ...) are looked through. Raises ValueError if an extension is unknown or the
    files need different builders.
    """
    by_file = {file: _format_of(file) for file in files}
    unknown = sorted(file for file, builder in by_file.items() if builder is None)
    if unknown:
        raise ValueError(f"format: cannot infer the builder of {unknown[:3]}; pass format='json'|'parquet'|'text'")
    formats = sorted({builder for builder in by_file.values() if builder is not None})
    if len(formats) != 1:
        raise ValueError(f"format: the files mix builders {formats}; stream them separately or pass format")
    return formats[0]


def _format_of(file: str) -> str | None:
    name = file.lower()
    for suffix in _COMPRESSION_SUFFIXES:
        name = name.removesuffix(suffix)
    return FORMAT_BY_EXTENSION.get(os.path.splitext(name)[1])


def _local_files(path: str) -> list[str] | None:
    """The sorted data files a local path names (file, directory searched recursively, or glob); None if not local."""
    path = os.path.expanduser(path)
    if os.path.isfile(path):
        return [path]
    if os.path.isdir(path):
        files = (str(p) for p in Path(path).rglob("*") if p.is_file() and not p.name.startswith("."))
        return sorted(f for f in files if _format_of(f) is not None)
    if _GLOB_CHARS & set(path):  # Hub names have no glob characters
        return sorted(f for f in glob.glob(path, recursive=True) if os.path.isfile(f))
    return None


def _load_arguments(config: StreamConfig) -> tuple[str, dict[str, Any]]:
    """`(path, kwargs)` for datasets.load_dataset; local paths are resolved to files now so typos fail early."""
    kwargs: dict[str, Any] = {"split": config.split, "streaming": True, **config.load_kwargs}
    if config.name is not None:
        kwargs["name"] = config.name
    files = _local_files(config.path)
    if files is not None:
        if config.data_files is not None:
            raise ValueError("data_files: give either a local path or data_files, not both")
        if not files:
            raise ValueError(f"path: no .jsonl/.json/.parquet/.txt files at {config.path!r}")
        return config.format or infer_format(files), {**kwargs, "data_files": files}
    if config.path in FORMAT_BY_EXTENSION.values():
        if config.data_files is None:
            raise ValueError(f"data_files: required with the builder name {config.path!r}")
        return config.path, {**kwargs, "data_files": config.data_files}
    if config.path.startswith(("/", "./", "../", "~")):
        raise ValueError(f"path: {config.path!r} does not exist")
    if config.data_files is not None:
        kwargs["data_files"] = config.data_files
    return config.path, kwargs  # a Hub dataset name


def _load(config: StreamConfig, seed: int) -> Any:
    """The datasets.IterableDataset; when shuffling, its shard order is shuffled and a few shards are interleaved."""
    import datasets

    path, kwargs = _load_arguments(config)
    if path == "json":
        kwargs.setdefault("chunksize", _JSON_CHUNK_BYTES)  # datasets reads 10 MB per open shard by default
    dataset = datasets.load_dataset(path, **kwargs)
    if config.shuffle:  # examples are shuffled afterwards, in our buffer of strings (smaller than datasets' arrow one)
        rows = _READ_BATCH * config.interleave_shards
        dataset = dataset.shuffle(seed=seed, buffer_size=rows, max_buffer_input_shards=config.interleave_shards)
    return _for_this_worker(dataset)


def _for_this_worker(dataset: Any) -> Any:
    """In a DataLoader worker, this worker's part: its shards, or every n-th example if shards don't divide."""
    worker = torch.utils.data.get_worker_info()
    if worker is None or worker.num_workers == 1:
        return dataset
    from datasets.distributed import split_dataset_by_node

    return split_dataset_by_node(dataset, rank=worker.id, world_size=worker.num_workers)


def _column(dataset: Any, text_column: str) -> Iterator[str]:
    """The non-empty texts of `text_column`."""
    for batch in dataset.iter(batch_size=_READ_BATCH):
        if text_column not in batch:
            raise KeyError(f"text_column {text_column!r} is not among the dataset's columns {sorted(batch)}")
        for text in batch[text_column]:
            if text and not isinstance(text, str):
                raise TypeError(f"text_column {text_column!r} holds a {type(text).__name__}, not a string")
            if text:
                yield text


def shuffle_buffer(items: Iterable[T], size: int, rng: random.Random) -> Iterator[T]:
    """Shuffle a stream through a buffer of `size` items: fill it, then yield a random one for each new item."""
    buffer: list[T] = []
    for item in items:
        if len(buffer) < size:
            buffer.append(item)
            continue
        index = rng.randrange(size)
        yield buffer[index]
        buffer[index] = item
    rng.shuffle(buffer)
    yield from buffer


def rotate(items: Iterable[T], offset: int) -> Iterator[T]:
    """`items` starting at index `offset`, followed by the first `offset` items (held meanwhile; fewer if short)."""
    iterator = iter(items)
    head = list(itertools.islice(iterator, offset))
    yield from iterator
    yield from head


def _texts(config: StreamConfig, plan: StartPlan) -> Iterator[str]:
    """This start's texts: shuffled shards, then shuffled examples, rotated by `plan.skip`."""
    texts = _column(_load(config, plan.seed), config.text_column)
    if not config.shuffle:
        return texts
    return rotate(shuffle_buffer(texts, config.shuffle_buffer, random.Random(plan.seed)), plan.skip)


# --- tokens to blocks -------------------------------------------------------------------------------------------


def pack_blocks(token_lists: Iterable[Sequence[int]], block_size: int, eos_token_id: int) -> Iterator[list[int]]:
    """Concatenate the token lists, each followed by `eos_token_id`, and cut the stream into `block_size` blocks;
    the incomplete remainder at the end is dropped."""
    buffer: list[int] = []
    for tokens in token_lists:
        buffer.extend(tokens)
        buffer.append(eos_token_id)
        full = len(buffer) // block_size * block_size
        for start in range(0, full, block_size):
            yield buffer[start : start + block_size]
        del buffer[:full]


def _batches(texts: Iterable[str], max_texts: int, max_chars: int) -> Iterator[list[str]]:
    """Consecutive batches of at most `max_texts` texts, cut early once they hold `max_chars` characters."""
    batch: list[str] = []
    chars = 0
    for text in texts:
        batch.append(text)
        chars += len(text)
        if len(batch) >= max_texts or chars >= max_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _token_lists(texts: Iterable[str], tokenizer: Any, batch_size: int) -> Iterator[list[int]]:
    """Token ids of each text, without special tokens; batches are bounded in characters too, since a fast
    tokenizer's transient memory is ~100 bytes per character."""
    for batch in _batches(texts, batch_size, _TOKENIZE_CHARS):
        encoded = tokenizer(
            batch, add_special_tokens=False, return_attention_mask=False, return_token_type_ids=False, verbose=False
        )
        yield from encoded["input_ids"]


def _example(block: list[int]) -> dict[str, torch.Tensor]:
    input_ids = torch.tensor(block, dtype=torch.long)
    return {"input_ids": input_ids, "labels": input_ids.clone(), "attention_mask": torch.ones_like(input_ids)}


# --- background prefetch ----------------------------------------------------------------------------------------

_END = object()


@dataclass
class _Failure:
    error: BaseException


def _put(items: queue.Queue, item: Any, stop: threading.Event) -> bool:
    """Put unless the consumer has gone; False once stopped."""
    while not stop.is_set():
        try:
            items.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def _produce(make_items: Callable[[], Iterable[Any]], items: queue.Queue, stop: threading.Event) -> None:
    try:
        for item in make_items():
            if not _put(items, item, stop):
                return
    except BaseException as e:  # everything reaches the consumer, which re-raises it
        _put(items, _Failure(e), stop)
        return
    _put(items, _END, stop)


class _PrefetchIterator(Iterator[Any]):
    """Iterates what `make_items()` yields, produced ahead by a daemon thread into a queue of `size` items.

    The thread stops when the iterator is closed, exhausted or garbage collected; its exceptions are re-raised
    here as DataStreamError.
    """

    def __init__(self, make_items: Callable[[], Iterable[Any]], size: int, what: str):
        self._items: queue.Queue = queue.Queue(maxsize=size)
        self._stop = threading.Event()
        self._what = what
        # the thread gets the queue and the event, never `self`, so dropping the iterator ends it
        self._thread = threading.Thread(
            target=_produce, args=(make_items, self._items, self._stop), name="trahiv-data-prefetch", daemon=True
        )
        self._thread.start()

    def __next__(self) -> Any:
        if self._stop.is_set():
            raise StopIteration
        item = self._get()
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            error = item.error
            raise DataStreamError(f"streaming {self._what} failed: {type(error).__name__}: {error}") from error
        return item

    def _get(self) -> Any:
        while True:
            try:
                return self._items.get(timeout=0.5)
            except queue.Empty:
                if not self._thread.is_alive() and self._items.empty():
                    self.close()
                    raise DataStreamError(f"streaming {self._what}: the producer thread ended unexpectedly") from None

    def close(self) -> None:
        """Stop the producer thread (it exits within ~0.1 s, or once its current read/tokenize call returns)."""
        self._stop.set()

    def __del__(self) -> None:
        self._stop.set()


# --- the dataset ------------------------------------------------------------------------------------------------


def _mix(*values: int | str) -> int:
    """A 63-bit seed from the values (stable across processes and Python versions)."""
    digest = hashlib.sha256(b"trahiv.data:" + ",".join(str(v) for v in values).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class StreamingTextDataset(torch.utils.data.IterableDataset):
    """Fixed-length causal-LM blocks streamed from a text dataset (see the module docstring and `stream_dataset`).

    Yields {"input_ids", "labels", "attention_mask"}, each a LongTensor of `block_size`; labels equal input_ids
    (the model shifts them). Has no length: give the Trainer `max_steps`.
    """

    def __init__(self, config: StreamConfig, tokenizer: Any):
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is None:
            raise ValueError("tokenizer must have an eos_token (eos_token_id is None); set tokenizer.eos_token")
        _load_arguments(config)  # fail now on a missing local path or a bad combination of options
        self.config = config
        self.tokenizer = tokenizer
        self.eos_token_id = int(eos)
        self.restart_nonce = config.restart_nonce if config.restart_nonce is not None else secrets.randbits(63)
        self.epoch = 0
        self.starts = 0
        self.last_start: StartPlan | None = None

    def use_peer_seed(self, seed: int) -> None:
        """Called by trahiv.Trainer with a seed from the peer's identity; a seed given explicitly is kept."""
        if self.config.seed is None:
            self.config = replace(self.config, seed=seed)

    def set_epoch(self, epoch: int) -> None:
        """Mixed into the next start's seed (the Trainer / accelerate call it between epochs)."""
        self.epoch = int(epoch)

    def plan(self, index: int) -> StartPlan:
        """The seed and skip of start number `index` (deterministic given seed, restart_nonce and epoch)."""
        if self.config.seed is None:
            raise ValueError(
                "stream_dataset(seed=None) needs a seed: pass one, or train with trahiv.Trainer in a swarm"
            )
        seed = _mix(self.config.seed, self.restart_nonce, self.epoch, index)
        skip = random.Random(_mix(seed, "skip")).randint(0, self.config.max_start_skip) if self.config.shuffle else 0
        return StartPlan(index=index, seed=seed, skip=skip)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        plan = self.plan(self.starts)
        self.starts += 1
        self.last_start = plan
        logger.info(f"Streaming {self.config.path!r}: start {plan.index}, seed {plan.seed}, skip {plan.skip}")
        return _PrefetchIterator(partial(self._examples, plan), size=self.config.prefetch, what=repr(self.config.path))

    def _examples(self, plan: StartPlan) -> Iterator[dict[str, torch.Tensor]]:
        token_lists = _token_lists(_texts(self.config, plan), self.tokenizer, self.config.tokenize_batch)
        return map(_example, pack_blocks(token_lists, self.config.block_size, self.eos_token_id))


def stream_dataset(
    path_or_name: str,
    *,
    tokenizer: Any,
    block_size: int,
    seed: int | None = None,
    data_files: str | list[str] | None = None,
    split: str = "train",
    name: str | None = None,
    text_column: str = "text",
    format: str | None = None,
    shuffle: bool = True,
    shuffle_buffer: int = 10_000,
    interleave_shards: int = 4,
    max_start_skip: int = 1_000,
    restart_nonce: int | None = None,
    prefetch: int = 64,
    tokenize_batch: int = 64,
    **load_kwargs: Any,
) -> StreamingTextDataset:
    """Stream `path_or_name` as shuffled, tokenized, packed causal-LM blocks for this peer.

    `path_or_name` is a Hub dataset ("HuggingFaceFW/fineweb-edu", with optional `name` and `data_files`), a builder
    name with `data_files` ("json", "parquet", "text"), or a local file, directory or glob of .jsonl/.json/.parquet/
    .txt shards (optionally compressed). `tokenizer` is a transformers tokenizer with an eos token. `seed` should
    differ between peers; left None, trahiv.Trainer derives it from the peer's identity. Each start also mixes in
    `restart_nonce` (random by default)
    and begins up to `max_start_skip` examples further on (wrapping around), so restarts begin elsewhere. Other
    keyword arguments go to `datasets.load_dataset` (e.g. `sample_by="paragraph"` for text files).

    Raises ValueError naming the bad option, or a missing local path, at once; errors while reading (an unknown Hub
    dataset, a malformed shard, a missing `text_column`) are raised from the iterator as DataStreamError. See the
    module docstring for the order, restart and memory guarantees.
    """
    config = StreamConfig(
        path=path_or_name, block_size=block_size, seed=seed, data_files=data_files, split=split, name=name,
        text_column=text_column, format=format, shuffle=shuffle, shuffle_buffer=shuffle_buffer,
        interleave_shards=interleave_shards, max_start_skip=max_start_skip, restart_nonce=restart_nonce,
        prefetch=prefetch, tokenize_batch=tokenize_batch, load_kwargs=load_kwargs,
    )  # fmt: skip
    return StreamingTextDataset(config, tokenizer)
