"""Experiment trackers the auxiliary peer logs the swarm's steps to: TensorBoard (default), Weights & Biases, trackio.

Each tracker logs one point per collaborative step (`log(step, values)`), through the tracker's own API; wandb and
trackio are optional imports that fail with a clear message when missing.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any, Protocol

logger = logging.getLogger("trahiv.auxiliary")

__all__ = ["TRACKERS", "TensorBoardTracker", "TrackioTracker", "Tracker", "WandbTracker", "make_trackers"]

TRACKERS = ("tensorboard", "wandb", "trackio", "none")


class Tracker(Protocol):
    def log(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    """Scalars in `<log_dir>`: `tensorboard --logdir <output_dir>/tensorboard`."""

    def __init__(self, log_dir: str | Path):
        from torch.utils.tensorboard import SummaryWriter  # needs the `tensorboard` package (a dependency)

        self.log_dir = str(log_dir)
        self.writer = SummaryWriter(log_dir=self.log_dir, flush_secs=10)

    def log(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """One W&B run per swarm run; a restarted aux peer resumes it (its id is kept in the store's metadata)."""

    def __init__(self, project: str, name: str, run_key: str, config: dict[str, Any], directory: str | Path):
        try:
            import wandb
        except ImportError:
            raise ValueError("--report-to wandb needs the wandb package: pip install wandb") from None
        self.run = wandb.init(project=project, name=name, id=run_key, resume="allow", config=config, dir=str(directory))

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class TrackioTracker:
    """trackio (local-first, W&B-like API): `trackio show` displays the project."""

    def __init__(self, project: str, name: str, config: dict[str, Any]):
        try:
            import trackio
        except ImportError:
            raise ValueError("--report-to trackio needs the trackio package: pip install trackio") from None
        self.trackio = trackio
        self.run = trackio.init(project=project, name=name, config=config, resume="allow")

    def log(self, step: int, values: dict[str, float]) -> None:
        self.trackio.log(values, step=step)

    def close(self) -> None:
        self.trackio.finish()


def make_trackers(
    names: list[str], *, output_dir: Path, project: str, run_name: str, config: dict[str, Any], meta: dict[str, str]
) -> tuple[list[Tracker], dict[str, str]]:
    """The trackers named in `names` (from TRACKERS), and metadata to remember for the next start."""
    unknown = [name for name in names if name not in TRACKERS]
    if unknown:
        raise ValueError(f"report_to: unknown tracker(s) {unknown}; choose from {', '.join(TRACKERS)}")
    if "none" in names and len(names) > 1:
        raise ValueError("report_to: 'none' cannot be combined with other trackers")
    trackers: list[Tracker] = []
    remember: dict[str, str] = {}
    for name in dict.fromkeys(names):
        if name == "tensorboard":
            trackers.append(TensorBoardTracker(output_dir / "tensorboard"))
        elif name == "wandb":
            run_key = meta.get("wandb_run_id") or f"{run_name}-{uuid.uuid4().hex[:8]}"
            remember["wandb_run_id"] = run_key
            trackers.append(WandbTracker(project, run_name, run_key, config, output_dir))
        elif name == "trackio":
            trackers.append(TrackioTracker(project, run_name, config))
    return trackers, remember
