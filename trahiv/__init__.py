"""trahiv: train Hugging Face transformers together over the Internet, on hivemind.

`from trahiv import Trainer, TrainingArguments` and add `hivemind_config` to join a swarm. Importing trahiv is
cheap: the Trainer (torch, transformers) and the engine load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trahiv.console import quiet_third_party_notices

quiet_third_party_notices()  # a logging filter, before transformers/peft import bitsandbytes (see trahiv/console.py)

__version__ = "0.1.0"
__all__ = [
    "DHTConfig",
    "HivemindConfig",
    "OptimizerConfig",
    "Seq2SeqTrainer",
    "Seq2SeqTrainingArguments",
    "Trainer",
    "TrainingArguments",
    "__version__",
    "collaborative",
    "collaborative_args",
]

_LAZY = {
    "Trainer": "trahiv.trainer",
    "TrainingArguments": "trahiv.trainer",
    "HivemindConfig": "trahiv.config",
    "DHTConfig": "trahiv.config",
    "OptimizerConfig": "trahiv.config",
    "collaborative": "trahiv.dropin",
    "collaborative_args": "trahiv.dropin",
    "Seq2SeqTrainer": "trahiv.seq2seq",
    "Seq2SeqTrainingArguments": "trahiv.seq2seq",
}

if TYPE_CHECKING:
    from trahiv.config import DHTConfig, HivemindConfig, OptimizerConfig
    from trahiv.dropin import collaborative, collaborative_args
    from trahiv.seq2seq import Seq2SeqTrainer, Seq2SeqTrainingArguments
    from trahiv.trainer import Trainer, TrainingArguments


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'trahiv' has no attribute {name!r}")
