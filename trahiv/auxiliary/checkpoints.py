"""Swarm checkpoints on disk: the model (loadable with `from_pretrained`), the swarm's optimizer state and the
collaborative step, written atomically, with a retention policy, and optionally uploaded to the Hugging Face Hub.

A checkpoint is a folder `checkpoint-<step>/` holding:

- what `model.save_pretrained` writes (`config.json`, `model.safetensors`, ...): `AutoModel*.from_pretrained(folder)`
  loads the swarm's weights at that step;
- `optimizer_state.pt`: `{"metadata": [...], "tensors": [...]}`, the optimizer state exactly as hivemind exchanges it
  between peers (`hivemind.optim.state_averager.dump_optimizer_state` of the trainers' optimizer: the flattened
  `optimizer.state_dict()`, values inline and tensors by index). It fits any optimizer built like the trainers'
  (`load_optimizer_state_into`); load it with `torch.load(..., weights_only=True)`;
- `trahiv_state.json`: `{"format", "step", "run_id", "parameter_names", "optimizer_tensors", "saved_at", "source"}`;
  `parameter_names` lists the trainable tensors in the order the swarm averages them. It is written last: a folder
  without it is not a checkpoint.

A checkpoint is first written to `.tmp-checkpoint-<step>-<random>/` next to the others and renamed when complete, so
readers never see a half-written one.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("trahiv.auxiliary.checkpoints")

__all__ = [
    "FORMAT",
    "SwarmCheckpoint",
    "SwarmState",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_optimizer_state_into",
    "prune_checkpoints",
    "push_to_hub",
    "save_checkpoint",
    "swarm_parameters",
]

FORMAT = "trahiv-swarm-checkpoint/1"
STATE_FILE = "trahiv_state.json"
OPTIMIZER_FILE = "optimizer_state.pt"
_NAME = re.compile(r"checkpoint-(\d+)")
_VALUE_TYPES = (bool, int, float, str, type(None))


@dataclass
class SwarmState:
    """The swarm's training state as peers exchange it: trainable tensors (in the swarm's order), the optimizer state
    in hivemind's flat form, and the collaborative step it belongs to."""

    step: int
    parameters: list[torch.Tensor]
    optimizer_metadata: list[dict[str, Any]]
    optimizer_tensors: list[torch.Tensor]

    @classmethod
    def from_peer(cls, metadata: Any, tensors: Sequence[torch.Tensor], num_parameters: int) -> SwarmState:
        """Parse what a peer's state averager served (`(metadata, tensors)`); raise ValueError if malformed."""
        if not isinstance(metadata, dict):
            raise ValueError(f"state metadata is a {type(metadata).__name__}, not a dict")
        step, entries = metadata.get("epoch"), metadata.get("optimizer_metadata")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"state step {step!r} is not a non-negative integer")
        entries = _check_optimizer_metadata(entries)
        tensors = list(tensors)
        optimizer_count = sum(entry["type"] == "tensor" for entry in entries)
        if len(tensors) != num_parameters + optimizer_count:
            raise ValueError(
                f"the state holds {len(tensors)} tensors: expected {num_parameters} trainable tensors and "
                f"{optimizer_count} optimizer tensors (a swarm with extra averaged tensors is not supported)"
            )
        return cls(step, tensors[:num_parameters], entries, tensors[num_parameters:])

    def peer_metadata(self, group_bits: str) -> dict[str, Any]:
        """The metadata a hivemind TrainingStateAverager sends with its state."""
        return {"epoch": self.step, "group_bits": group_bits, "optimizer_metadata": self.optimizer_metadata}

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [*self.parameters, *self.optimizer_tensors]


def _check_optimizer_metadata(entries: Any) -> list[dict[str, Any]]:
    if not isinstance(entries, list):
        raise ValueError(f"optimizer metadata is a {type(entries).__name__}, not a list")
    count = 0
    for entry in entries:
        if not isinstance(entry, dict) or entry.get("type") not in ("tensor", "value"):
            raise ValueError(f"malformed optimizer metadata entry {entry!r}")
        if entry["type"] == "tensor":
            if entry.get("index") != count:
                raise ValueError(f"optimizer tensor index {entry.get('index')!r} where {count} was expected")
            count += 1
        elif not _plain_value(entry.get("value")):
            raise ValueError(f"optimizer metadata value {entry.get('value')!r} is not a plain value")
    return entries


def _plain_value(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain_value(v) for v in value)
    return isinstance(value, _VALUE_TYPES)


def swarm_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The model's trainable tensors in the order trahiv trainers hand them to the swarm's optimizer (the Trainer's
    weight-decay group first, then the rest): the order of the tensors in the swarm's state."""
    import transformers

    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))  # type: ignore[arg-type]
    named = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    return [(n, p) for n, p in named if n in decay] + [(n, p) for n, p in named if n not in decay]


# --- writing --------------------------------------------------------------------------------------------------


def save_checkpoint(
    directory: str | Path,
    state: SwarmState,
    model: Any,
    *,
    run_id: str = "",
    source: str = "",
    keep: int | None = None,
    tokenizer: Any = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write `state` as `directory/checkpoint-<step>` and return its path (an existing one is left as it is).

    `model` is a transformers model of the swarm's architecture: the state's tensors are copied into its trainable
    parameters (in `swarm_parameters` order) before `save_pretrained`. With `keep`, only the newest `keep`
    checkpoints stay; `extra` goes into trahiv_state.json (DiLoCo: `{"diloco": {...}}`, see trahiv.auxiliary.diloco).
    The folder appears complete or not at all."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"checkpoint-{state.step}"
    if (target / STATE_FILE).exists():
        return target
    named = swarm_parameters(model)
    if len(named) != len(state.parameters):
        raise ValueError(f"the state has {len(state.parameters)} trainable tensors, the model {len(named)}")
    with torch.no_grad():
        for (name, param), value in zip(named, state.parameters, strict=True):
            if tuple(param.shape) != tuple(value.shape):
                raise ValueError(f"tensor {name}: the state has shape {tuple(value.shape)}, the model {param.shape}")
            param.copy_(value)
    tmp = directory / f".tmp-checkpoint-{state.step}-{uuid.uuid4().hex[:8]}"
    try:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        optimizer_state = {"metadata": state.optimizer_metadata, "tensors": [t.cpu() for t in state.optimizer_tensors]}
        torch.save(optimizer_state, tmp / OPTIMIZER_FILE)
        info = {
            "format": FORMAT,
            "step": state.step,
            "run_id": run_id,
            "parameter_names": [name for name, _ in named],
            "optimizer_tensors": len(state.optimizer_tensors),
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "source": source,
            **(extra or {}),
        }
        (tmp / STATE_FILE).write_text(json.dumps(info, indent=1))
        if target.exists():  # a folder without STATE_FILE: a leftover, not a checkpoint
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if keep is not None:
        prune_checkpoints(directory, keep)
    return target


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Complete checkpoints in `directory`, oldest step first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = _NAME.fullmatch(path.name)
        if match and (path / STATE_FILE).is_file():
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def latest_checkpoint(directory: str | Path) -> Path | None:
    found = list_checkpoints(directory)
    return found[-1] if found else None


def prune_checkpoints(directory: str | Path, keep: int, protect: Sequence[Path] = ()) -> list[Path]:
    """Delete all but the newest `keep` checkpoints (except those in `protect`, e.g. being uploaded) and leftover
    temporary folders; return what was deleted."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    directory = Path(directory)
    kept = {Path(p).resolve() for p in protect}
    doomed = [p for p in list_checkpoints(directory)[:-keep] if p.resolve() not in kept]
    doomed += [p for p in directory.glob(".tmp-checkpoint-*") if p.is_dir() and _stale(p)]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
        logger.info(f"Removed old checkpoint {path}")
    return doomed


def _stale(path: Path, age: float = 3600.0) -> bool:
    """A temporary folder nobody wrote to for an hour (another writer may still be busy with a newer one)."""
    return time.time() - path.stat().st_mtime > age


# --- reading --------------------------------------------------------------------------------------------------


@dataclass
class SwarmCheckpoint:
    """A checkpoint read back: `path` is the model folder (`from_pretrained(path)`), `step` the collaborative step,
    `optimizer_state` hivemind's flat optimizer state (`{"metadata", "tensors"}`)."""

    path: Path
    step: int
    run_id: str
    parameter_names: list[str]
    optimizer_state: dict[str, Any]
    diloco: dict[str, Any] | None = None  # a DiLoCo swarm's outer state: {"outer_step", "inner_steps", "global_step"}

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The trainable tensors by name, in the swarm's order."""
        from safetensors.torch import load_file

        index = self.path / "model.safetensors.index.json"
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else []
        tensors: dict[str, torch.Tensor] = {}
        for name in files or ["model.safetensors"]:
            tensors.update(load_file(self.path / name))
        missing = [n for n in self.parameter_names if n not in tensors]
        if missing:
            raise ValueError(f"checkpoint {self.path} lacks tensors {missing[:3]} (of {len(missing)})")
        return {name: tensors[name] for name in self.parameter_names}

    def swarm_state(self) -> SwarmState:
        """The state to serve to peers (what they download with `load_state_from_peers`)."""
        return SwarmState(
            step=self.step,
            parameters=list(self.model_state_dict().values()),
            optimizer_metadata=self.optimizer_state["metadata"],
            optimizer_tensors=self.optimizer_state["tensors"],
        )


def load_checkpoint(path: str | Path) -> SwarmCheckpoint:
    """Read a checkpoint written by `save_checkpoint`; raise ValueError if it is not one."""
    path = Path(path)
    info_file = path / STATE_FILE
    if not info_file.is_file():
        raise ValueError(f"{path} is not a trahiv checkpoint (no {STATE_FILE})")
    info = json.loads(info_file.read_text())
    if info.get("format") != FORMAT:
        raise ValueError(f"{path}: unknown checkpoint format {info.get('format')!r} (this trahiv reads {FORMAT!r})")
    optimizer_state = torch.load(path / OPTIMIZER_FILE, weights_only=True)
    _check_optimizer_metadata(optimizer_state.get("metadata"))
    if len(optimizer_state.get("tensors", ())) != info["optimizer_tensors"]:
        raise ValueError(f"{path}: {OPTIMIZER_FILE} does not hold {info['optimizer_tensors']} tensors")
    return SwarmCheckpoint(
        path, int(info["step"]), info.get("run_id", ""), list(info["parameter_names"]), optimizer_state,
        info.get("diloco"),
    )  # fmt: skip


def load_optimizer_state_into(optimizer: torch.optim.Optimizer, optimizer_state: dict[str, Any]) -> None:
    """Load a checkpoint's `optimizer_state` into a torch optimizer built like the trainers' (same class, same
    parameter groups over `swarm_parameters(model)`). Its parameters keep their values."""
    from hivemind.optim.state_averager import initialize_optimizer_state_, load_optimizer_state

    if not optimizer.state:  # the flat state is unpacked along the optimizer's own: create its statistics first
        params = [p for group in optimizer.param_groups for p in group["params"]]
        with torch.no_grad():
            saved = [p.detach().clone() for p in params]
            initialize_optimizer_state_(optimizer)  # a step with zero gradients (weight decay moves parameters)
            for param, value in zip(params, saved, strict=True):
                param.copy_(value)
    load_optimizer_state(optimizer, optimizer_state["metadata"], optimizer_state["tensors"])


# --- the Hub --------------------------------------------------------------------------------------------------


def push_to_hub(path: str | Path, repo_id: str, *, token: str | None = None, private: bool | None = None) -> str:
    """Upload a checkpoint folder to the root of the Hub model repo `repo_id` (created if missing) with the real
    `huggingface_hub` client; the endpoint is `HF_ENDPOINT` (default: the Hub), the token `token` or `HF_TOKEN`.
    Returns the commit URL."""
    from huggingface_hub import HfApi

    path = Path(path)
    step = json.loads((path / STATE_FILE).read_text())["step"]
    api = HfApi(token=token)
    api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    commit = api.upload_folder(
        repo_id=repo_id,
        repo_type="model",
        folder_path=path,
        commit_message=f"trahiv checkpoint at collaborative step {step}",
    )
    return str(commit.commit_url)
