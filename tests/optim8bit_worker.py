"""A swarm peer with a bitsandbytes 8-bit optimizer, for tests/test_optim8bit.py: `python optim8bit_worker.py SPEC`.

Like peer_worker.py (whose Recorder and model it reuses: ready.json, records.jsonl, done.json), but it trains with
TrainingArguments(optim=SPEC["optim"], default "adamw_bnb_8bit") and also writes optim.jsonl: a digest of the inner
optimizer's state when training begins (after a late peer downloaded the swarm's state) and after every collaborative
step, and the file "stepped" after its first collaborative step. done.json adds the final parameters' checksum. After
every local step the peer sleeps SPEC["slow_sleep"] seconds until the file SPEC["slow_until"] exists (a peer still
training slowly while a late one joins and catches up), SPEC["sleep"] seconds afterwards; from step 1 on it waits for
the file SPEC["hold_until"] (the late peer's ready.json) to exist.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from peer_worker import Recorder, build_model
from transformers import TrainerCallback

from trahiv import Trainer, TrainingArguments
from trahiv.demo import BlockDataset

__all__ = ["OptimizerStateRecorder", "Pacer", "main", "state_digest"]


def state_digest(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Per state key (state1, state2, absmax1, ...): dtypes and the exact sum over all parameters; and the steps."""
    sums: dict[str, float] = {}
    dtypes: dict[str, set[str]] = {}
    steps = set()
    for state in optimizer.state.values():
        for key, value in state.items():
            if key == "step":
                steps.add(int(value))
            elif isinstance(value, torch.Tensor):
                sums[key] = sums.get(key, 0.0) + float(value.double().sum())
                dtypes.setdefault(key, set()).add(str(value.dtype).removeprefix("torch."))
    return {"sums": sums, "dtypes": {key: sorted(names) for key, names in dtypes.items()}, "steps": sorted(steps)}


class OptimizerStateRecorder(TrainerCallback):
    """Appends the inner optimizer's state digest to optim.jsonl at the start and after every collaborative step;
    creates the file "stepped" after the first collaborative step."""

    def __init__(self, trainer: Trainer, out: Path):
        self.trainer, self.out, self.last_step = trainer, out, -1

    def on_train_begin(self, args, state, control, **kwargs):
        self._write("begin", state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step > self.last_step:
            self._write("step", state.global_step)
            (self.out / "stepped").touch()

    def _write(self, kind: str, step: int) -> None:
        self.last_step = step
        optimizer = self.trainer.swarm.optimizer.opt  # type: ignore[union-attr]
        row = {"kind": kind, "step": step, "class": type(optimizer).__name__, **state_digest(optimizer)}
        with open(self.out / "optim.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")


class Pacer(TrainerCallback):
    """Sleeps `slow` seconds after every local step until the file `until` exists, `fast` seconds afterwards. With
    `hold`, from collaborative step 1 on it also waits (at most 180 s) for the file `hold` to exist: on a loaded
    machine, a late peer may take longer to start than this one takes to finish."""

    def __init__(self, slow: float, until: str | None, fast: float, hold: str | None = None):
        self.slow, self.until, self.fast = slow, None if until is None else Path(until), fast
        self.hold = None if hold is None else Path(hold)

    def on_step_end(self, args, state, control, **kwargs):
        deadline = time.monotonic() + 180
        while self.hold is not None and state.global_step >= 1 and not self.hold.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.hold} did not appear within 180 s")
            time.sleep(0.2)
        slow = self.until is not None and not self.until.exists()
        time.sleep(self.slow if slow else self.fast)


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    opt = {"run_id": spec["run_id"], "target_batch_size": spec["target"], "matchmaking_time": spec.get("mm", 2.0),
           "averaging_timeout": 30.0, "verbose": True, **spec.get("opt", {})}  # fmt: skip
    dht = {"initial_peers": spec.get("initial_peers", []), "nat_port_map": False, "client_mode": False}
    args = TrainingArguments(
        output_dir=str(out / "output"), per_device_train_batch_size=spec["batch_size"], max_steps=spec["max_steps"],
        optim=spec.get("optim", "adamw_bnb_8bit"), learning_rate=spec.get("lr", 3e-3), warmup_steps=1,
        weight_decay=0.0, logging_steps=1, report_to=[], disable_tqdm=True, use_cpu=True, save_strategy="no",
        hivemind_config={"dht": dht, "opt": opt},
    )  # fmt: skip
    dataset = BlockDataset.load(Path(spec["workdir"]) / "blocks.pt")
    trainer = Trainer(model=build_model(spec), args=args, train_dataset=dataset)
    trainer.add_callback(Recorder(trainer, spec, out))
    trainer.add_callback(OptimizerStateRecorder(trainer, out))
    pacer = Pacer(spec.get("slow_sleep", 0.0), spec.get("slow_until"), spec.get("sleep", 0.0), spec.get("hold_until"))
    trainer.add_callback(pacer)
    result = trainer.train()
    params = [p.detach().double() for p in trainer.model.parameters() if p.requires_grad]
    done = {
        "global_step": trainer.state.global_step,
        "train_loss": result.training_loss,
        "checksum": sum(float(p.sum()) for p in params),
        "abs": sum(float(p.abs().sum()) for p in params),
        "averaging_rounds": trainer.swarm.optimizer.averaging_rounds(),  # type: ignore[union-attr]
    }
    (out / "done.json").write_text(json.dumps(done))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1]))
    except KeyboardInterrupt:
        sys.exit(130)
