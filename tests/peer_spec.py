"""What a test peer runs, typed: `start_peer` validates a spec before it starts a process, so a misspelt key or a
wrong value fails the test at once, with the field named, instead of being ignored by the worker.

Faults are injected at named collaborative steps, never at a time: `Fault(kind="stall", at_step=3, seconds=40)` makes
the peer stop for 40 s when it reaches step 3, wherever the others are by then."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["Attack", "DiLoCoPeerSpec", "Fault", "PeerSpec", "spec_model"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Attack(_Strict):
    """What a Byzantine peer sends instead of its gradients (tests/peer_worker.py `corrupt_`)."""

    attack: Literal["scale", "nan", "sign_flip", "noise", "inflate_weight"]
    factor: float = 1.0
    min_group: int = Field(1, ge=1, description="made only in groups this large; smaller ones get true gradients")


class Fault(_Strict):
    """A fault the peer injects into itself when its collaborative step reaches `at_step`:
    - stall: no local step for `seconds` (a frozen laptop, a notebook's paused kernel);
    - die: SIGKILL to itself (its engine processes must go too);
    - kill_dht / kill_p2pd: SIGKILL to its DHT process / its p2p daemon (the kernel's OOM killer picked it);
    - nan: the next averaging round it joins, it sends NaN/inf gradients;
    - lie_samples: the next averaging round it joins, it claims `factor` times the samples it accumulated."""

    kind: Literal["stall", "die", "kill_dht", "kill_p2pd", "nan", "lie_samples"]
    at_step: int = Field(ge=0)
    seconds: float = Field(0.0, ge=0)
    factor: float = Field(1e3, gt=0)


class _Common(_Strict):
    out: str
    workdir: str
    run_id: str
    batch_size: int = Field(ge=1)
    max_steps: int = Field(ge=1)
    initial_peers: list[str] = []
    mm: float = Field(2.0, gt=0, description="matchmaking_time")
    opt: dict[str, Any] = {}
    auth: dict[str, Any] | None = None
    lr: float | None = None
    optim: str | None = None
    scheduler: str | None = None
    seed: int = 42
    sleep_per_step: float = Field(0.0, ge=0)
    toy_grad: float | None = None
    toy_tensors: int = Field(1, ge=1)  # the toy model's tensors (each `w`-shaped, with the same gradient)
    eval_blocks: int | None = Field(None, ge=1)
    save_steps: int | None = Field(None, ge=1)
    resume: str | bool | None = None
    byzantine: Attack | list[Attack] | None = None
    byzantine_once: bool = False  # a list of attacks is made once, in turn; then honest rounds (not round after round)
    n_embd: int | None = Field(None, ge=1, description="a deliberately different model")
    lora: bool = False
    init_seed: int | None = Field(None, description="trainable weights moved by noise of this seed (other weights)")


class PeerSpec(_Common):
    """tests/peer_worker.py: a trainer of the synchronous mode."""

    target: int = Field(ge=1, description="target_batch_size")
    dht: dict[str, Any] = {}
    metrics: dict[str, Any] | None = None
    poison_state: bool = False
    faults: list[Fault] = []
    progress_recheck_s: float | None = Field(None, gt=0, description="SwarmOptimizer's PROGRESS_RECHECK_PERIOD")
    tells: bool = True  # False: this peer does not tell its groupmates as its round begins (an older peer)


class DiLoCoPeerSpec(_Common):
    """tests/diloco_worker.py: a DiLoCo trainer."""

    inner_steps: int = Field(ge=1)
    diloco: dict[str, Any] = {}
    logging_steps: int = Field(5, ge=1)
    save_final: bool = False
    report_to: list[str] = []
    download_at_start: bool = True  # False: the peer keeps its own parameters at start (a failed download)
    revert_delay: float = Field(0.0, ge=0)  # apply a revert order only that many seconds after first seeing it
    hold_at_step: int | None = Field(None, ge=1, description="after this inner step, wait for `hold_until` to exist")
    hold_until: str | None = None  # a file another process writes (a joiner's ready.json); waited for 120 s at most
    # a sync's faults and events, each at one outer step: the peer's sync fails at once (its group search ended as
    # the others' group with it assembled); it writes `signal_file` on reaching its sync point; it waits for
    # `hold_until` to exist (120 s at most) before averaging (its all-reduce takes that long)
    fail_sync_at: int | None = Field(None, ge=0)
    signal_sync_at: int | None = Field(None, ge=0)
    signal_file: str | None = None
    hold_sync_at: int | None = Field(None, ge=0)
    # the peer's all-reduce of this outer step's sync fails at once (its group counted it in, and it sends nothing);
    # or, crash, its averager kills the peer's whole process tree (SIGKILL) as soon as that all-reduce is over for
    # the groupmates too (they have every part it reduced): the first moment the round is over for all
    fail_round_at_sync: int | None = Field(None, ge=0)
    crash_round_at_sync: int | None = Field(None, ge=0)
    # seconds a peer that missed a sync waits before downloading the swarm's result (a slow CPU); False: a peer whose
    # training ended leaves at once (the behaviour before DiLoCoOptimizer.serve_late_peers, as a control)
    adopt_delay: float = Field(0.0, ge=0)
    # the first download of a peer that missed a sync (or diverged) writes `hold_until` (the others, held at
    # `hold_sync_at`, then take their outer step) and ends only once another peer's record is past the outer step it
    # got (120 s at most): the state was served before that peer took its next outer step
    stale_download: bool = False
    serve_late: bool = True
    # allreduce.jsonl: one line per all-reduce, the norm of what this peer sent and of the aggregate it got back
    record_allreduce: bool = False


SPECS: dict[str, type[_Common]] = {"peer_worker.py": PeerSpec, "diloco_worker.py": DiLoCoPeerSpec}


def spec_model(worker: str) -> type[_Common] | None:
    """The spec model of `worker` (a script in tests/), or None for the workers that take free-form specs."""
    return SPECS.get(worker)
