"""Settings and `trahiv aux` flags of the auxiliary peer's state keeper (`trahiv.auxiliary.keeper`): checkpoints of the
swarm's state, serving it to joining peers, restarting a stopped swarm, Hub upload. Light to import (no torch)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field, model_validator

from trahiv.config import _Section

if TYPE_CHECKING:
    from trahiv.auxiliary.peer import AuxPeer

__all__ = ["StateKeeperConfig", "add_arguments", "attach", "load_model"]


class StateKeeperConfig(_Section):
    """What the auxiliary peer does with the swarm's state."""

    model: str = Field(description="the swarm's model: a local folder or a cached Hub name (local files only)")
    model_class: str = Field("AutoModelForCausalLM", description="transformers class that loads `model`")
    checkpoint_dir: str = Field(description="where checkpoint-<step>/ folders go")
    checkpoint_every: int = Field(20, ge=1, description="save a checkpoint every this many collaborative steps")
    keep_checkpoints: int = Field(3, ge=1, description="keep the newest this many checkpoints")
    resume: bool = Field(True, description="at start, load the newest checkpoint and serve it to joining peers")
    poll_interval: float = Field(5.0, gt=0, description="seconds between looks at the swarm's newest state")
    load_state_timeout: float = Field(600.0, gt=0, description="bound on one state download")
    push_to_hub: bool = Field(False, description="upload every checkpoint to the Hugging Face Hub")
    hub_repo: str | None = Field(None, description="Hub model repo id (user/name) for push_to_hub")
    hub_token: str | None = Field(None, description="Hub token (default: HF_TOKEN or the cached login)")
    hub_private: bool | None = Field(None, description="create the Hub repo as private")

    @model_validator(mode="after")
    def _hub(self) -> StateKeeperConfig:
        if self.push_to_hub and not self.hub_repo:
            raise ValueError("push_to_hub needs hub_repo (the Hub model repo id, e.g. 'my-org/my-model')")
        return self


def load_model(name: str, model_class: str = "AutoModelForCausalLM") -> Any:
    """The swarm's model on the CPU from a local folder or the Hub cache (never downloads). A folder with only a
    config gives freshly initialised weights: the keeper replaces them with the swarm's."""
    import transformers

    cls = getattr(transformers, model_class, None)
    if cls is None or not hasattr(cls, "from_pretrained"):
        raise ValueError(f"model_class {model_class!r} is not a transformers model class (e.g. AutoModelForCausalLM)")
    folder = Path(name).expanduser()
    if name.startswith(("/", ".", "~")) and not folder.is_dir():
        raise ValueError(f"model folder {name!r} does not exist")
    if not folder.is_dir():  # a Hub name: its cached snapshot (transformers would still ask the network for parts)
        from huggingface_hub import snapshot_download

        try:
            folder = Path(snapshot_download(name, local_files_only=True))
        except Exception as e:
            raise ValueError(
                f"model {name!r} is neither a folder nor a Hub model in the local cache (`hf download {name}` "
                f"fetches it): {e!r}"
            ) from None
    has_weights = any(folder.glob("*.safetensors")) or any(folder.glob("*.bin"))
    try:
        if folder.is_dir() and not has_weights:
            config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
            return cls.from_config(config)
        return cls.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load model {name!r} from {folder}: {e}") from None


# --- `trahiv aux` flags -------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of StateKeeperConfig's fields (help and defaults from the model; hub_token stays off the command
    line: HF_TOKEN or the cached login)."""
    from trahiv.cli.flags import add_flags

    group = parser.add_argument_group("checkpoints and state (with --model)")
    notes = {"model": "with it: save checkpoints and serve state", "checkpoint_dir": "default: OUTPUT_DIR/checkpoints"}
    flags = add_flags(group, StateKeeperConfig, exclude=("hub_token",), rename={"poll_interval": "--state-poll"},
                      notes=notes)  # fmt: skip
    parser.set_defaults(flags_state=flags)


def attach(peer: AuxPeer, args: argparse.Namespace) -> None:
    flags = args.flags_state
    given = flags.given(args)
    if "model" not in given:
        for name in ("push_to_hub", "checkpoint_dir"):
            if given.get(name):
                raise ValueError(f"{flags.flags[name]} needs --model (the swarm's model)")
        return
    if given.get("push_to_hub") and not given.get("hub_repo"):
        raise ValueError("--push-to-hub needs --hub-repo (the Hub model repo id, e.g. my-org/my-model)")
    config = flags.build(args, base={"checkpoint_dir": str(Path(peer.output_dir) / "checkpoints")})
    if peer.config.diloco is not None:  # [DiLoCo] checkpoints of the outer parameters, at outer steps
        from trahiv.auxiliary.diloco import DiLoCoStateKeeper

        peer.add_service(DiLoCoStateKeeper(config))
        return
    from trahiv.auxiliary.keeper import StateKeeper  # torch, transformers, hivemind: only when asked

    peer.add_service(StateKeeper(config))
