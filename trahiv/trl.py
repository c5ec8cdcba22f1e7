"""Drop-ins for TRL (`pip install trahiv[trl]`): TRL's trainers and configs, plus `hivemind_config`.

    from trahiv.trl import SFTConfig, SFTTrainer          # instead of: from trl import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir="out", hivemind_config={"dht": {...}, "opt": {"run_id": ..., ...}})
    SFTTrainer(model=model, args=args, train_dataset=data, peft_config=LoraConfig(...)).train()

Each is a real subclass, `class SFTConfig(trl.SFTConfig, trahiv.TrainingArguments)` and `class SFTTrainer(
trl.SFTTrainer, trahiv.Trainer)`, made by `trahiv.collaborative_args` / `trahiv.collaborative`: TRL's data
preparation, packing, PEFT (`peft_config`: only the adapters train, so only they are averaged), losses and logs stay
TRL's. A plain `trahiv.TrainingArguments` given as `args` is converted to the matching config (TRL would otherwise
rebuild it without `hivemind_config`). Other TRL trainers: `trahiv.collaborative(trl.XTrainer, args_cls=...)`.
"""

from __future__ import annotations

try:
    import trl
except ImportError as e:  # pragma: no cover - the optional extra
    raise ImportError("trahiv.trl needs TRL: pip install 'trahiv[trl]'") from e

from trahiv.dropin import collaborative, collaborative_args

__all__ = ["DPOConfig", "DPOTrainer", "SFTConfig", "SFTTrainer"]

SFTConfig = collaborative_args(trl.SFTConfig)
SFTTrainer = collaborative(trl.SFTTrainer, args_cls=SFTConfig)
DPOConfig = collaborative_args(trl.DPOConfig)
DPOTrainer = collaborative(trl.DPOTrainer, args_cls=DPOConfig)
