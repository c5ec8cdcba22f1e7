"""Drop-in `Seq2SeqTrainer` and `Seq2SeqTrainingArguments`: transformers' own, plus `hivemind_config`.

    from trahiv.seq2seq import Seq2SeqTrainer, Seq2SeqTrainingArguments   # (also: from trahiv import ...)

They are `trahiv.collaborative(transformers.Seq2SeqTrainer)` and `trahiv.collaborative_args(...)`: generation
(`predict_with_generate`, `generation_config`) works as in transformers.
"""

from __future__ import annotations

import transformers

from trahiv.dropin import collaborative, collaborative_args

__all__ = ["Seq2SeqTrainer", "Seq2SeqTrainingArguments"]

Seq2SeqTrainingArguments = collaborative_args(transformers.Seq2SeqTrainingArguments)
Seq2SeqTrainer = collaborative(transformers.Seq2SeqTrainer, args_cls=Seq2SeqTrainingArguments)
