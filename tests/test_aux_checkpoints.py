"""The auxiliary peer's checkpoints: they follow the swarm, load with `from_pretrained`, equal the trainers' weights and
optimizer state, restart a stopped swarm at the same collaborative step, and go to the Hub (a stand-in on 127.0.0.1)."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hub_standin import HubStandIn
from safetensors.torch import load_file
from swarm_helpers import ENV, start_peer, start_trahiv, stop, wait_for

from trahiv.auxiliary.checkpoints import (
    SwarmState,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_optimizer_state_into,
    save_checkpoint,
    swarm_parameters,
)
from trahiv.auxiliary.state import StateKeeperConfig

RUN = "auxckpt"


# --- the format, in-process ------------------------------------------------------------------------------------


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    """An optimizer built like a trahiv trainer's: weight-decay groups over swarm_parameters, a LambdaLR schedule."""
    named = swarm_parameters(model)
    decay = set(__import__("transformers").Trainer.get_decay_parameter_names(None, model))
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": 0.01},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=1e-3)
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    return optimizer


def test_checkpoint_format_roundtrip_and_retention(tmp_path):
    from hivemind.optim.state_averager import dump_optimizer_state
    from transformers import AutoModelForCausalLM, GPT2LMHeadModel

    from trahiv.demo import tiny_gpt2_config

    torch.manual_seed(0)
    model = GPT2LMHeadModel(tiny_gpt2_config(n_layer=1, n_embd=32, n_head=2))
    optimizer = _adamw(model)
    model(input_ids=torch.arange(8)[None], labels=torch.arange(8)[None]).loss.backward()
    optimizer.step()
    metadata, opt_tensors = dump_optimizer_state(optimizer)
    params = [p.detach().clone() for _, p in swarm_parameters(model)]

    target = GPT2LMHeadModel(tiny_gpt2_config(n_layer=1, n_embd=32, n_head=2))  # other initial weights
    folder = tmp_path / "ckpts"
    (folder / ".tmp-checkpoint-9-deadbeef").mkdir(parents=True)  # a crashed writer's leftover: not a checkpoint
    (folder / "checkpoint-8").mkdir()  # a folder without trahiv_state.json: not a checkpoint
    for step in (3, 5, 7):
        state = SwarmState(step, [p + step for p in params], metadata, opt_tensors)
        save_checkpoint(folder, state, target, run_id=RUN, keep=2)
    assert [p.name for p in list_checkpoints(folder)] == ["checkpoint-5", "checkpoint-7"]
    assert latest_checkpoint(folder) == folder / "checkpoint-7"

    checkpoint = load_checkpoint(folder / "checkpoint-7")
    assert (checkpoint.step, checkpoint.run_id) == (7, RUN)
    loaded = AutoModelForCausalLM.from_pretrained(checkpoint.path)
    for (name, param), expected in zip(swarm_parameters(loaded), params, strict=True):
        assert torch.equal(param, expected + 7), name
    assert all(torch.equal(a, b + 7) for a, b in zip(checkpoint.model_state_dict().values(), params, strict=True))

    fresh = _adamw(GPT2LMHeadModel(tiny_gpt2_config(n_layer=1, n_embd=32, n_head=2)))
    load_optimizer_state_into(fresh, checkpoint.optimizer_state)
    _assert_same_optimizer_state(fresh.state_dict(), optimizer.state_dict())
    served = checkpoint.swarm_state()
    assert served.step == 7 and len(served.tensors) == len(params) + len(opt_tensors)

    with pytest.raises(ValueError, match="not a trahiv checkpoint"):
        load_checkpoint(folder / "checkpoint-8")
    with pytest.raises(ValueError, match="expected 2 trainable tensors"):
        SwarmState.from_peer({"epoch": 1, "optimizer_metadata": metadata}, [*params, *opt_tensors], 2)


def test_keeper_refuses_another_runs_or_models_checkpoint(tmp_path):
    from transformers import GPT2LMHeadModel

    from trahiv.auxiliary.keeper import StateKeeper
    from trahiv.demo import tiny_gpt2_config

    model = GPT2LMHeadModel(tiny_gpt2_config(n_layer=1, n_embd=32, n_head=2))
    params = [p.detach().clone() for _, p in swarm_parameters(model)]
    save_checkpoint(tmp_path / "c", SwarmState(4, params, [], []), model, run_id="other_run")
    config = StateKeeperConfig(model=str(tmp_path / "unused"), checkpoint_dir=str(tmp_path / "c"))
    with pytest.raises(ValueError, match="checkpoint of run 'other_run', not 'this_run'"):
        StateKeeper(config, model=model).start_with(None, "this_run")  # fails before starting anything
    wider = GPT2LMHeadModel(tiny_gpt2_config(n_layer=1, n_embd=64, n_head=2))
    with pytest.raises(ValueError, match="does not fit model"):
        StateKeeper(config, model=wider).start_with(None, "other_run")


def _assert_same_optimizer_state(got: dict, expected: dict) -> None:
    assert got["param_groups"] == expected["param_groups"]
    assert got["state"].keys() == expected["state"].keys()
    for index, values in expected["state"].items():
        for key, value in values.items():
            assert torch.equal(got["state"][index][key], value), (index, key)


def test_state_keeper_config_is_strict():
    with pytest.raises(ValueError, match="did you mean 'checkpoint_every'"):
        StateKeeperConfig.model_validate({"model": "m", "checkpoint_dir": "c", "checkpoint_evry": 3})
    with pytest.raises(ValueError, match="push_to_hub needs hub_repo"):
        StateKeeperConfig(model="m", checkpoint_dir="c", push_to_hub=True)
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        StateKeeperConfig(model="m", checkpoint_dir="c", keep_checkpoints=0)


# --- a real swarm ----------------------------------------------------------------------------------------------


@dataclass
class Aux:
    process: subprocess.Popen
    out: Path
    log_path: Path
    initial_peers: list[str]

    @property
    def checkpoints(self) -> Path:
        return self.out / "checkpoints"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_aux(tmp: Path, workdir: Path, *extra: str, env: dict | None = None) -> Aux:
    """`trahiv aux` keeping checkpoints of every collaborative step (the newest two) in tmp/auxiliary/checkpoints."""
    out = tmp / "auxiliary"
    addresses = tmp / "aux-addresses.json"
    addresses.unlink(missing_ok=True)
    config = json.dumps({"dht": {"nat_port_map": False}, "opt": {"run_id": RUN, "target_batch_size": 16}})
    argv = [
        "aux", "--config", config, "--output-dir", str(out),
        "--report-to", "none", "--addresses-file", str(addresses), "--period", "1",
        "--model", str(workdir / "model"), "--checkpoint-every", "1", "--keep-checkpoints", "2", "--state-poll", "0.5",
        *extra,
    ]  # fmt: skip
    log = tmp / f"aux-{len(list(tmp.glob('aux-*.log')))}.log"
    process = start_trahiv(argv, log, tmp, env=env)  # (with `env`, the Hub stand-in's: a fresh interpreter reads it)

    def joined() -> list[str] | None:
        if process.poll() is not None:
            raise AssertionError(f"aux peer exited with {process.returncode}:\n{log.read_text()[-4000:]}")
        return json.loads(addresses.read_text()) if addresses.exists() and addresses.stat().st_size else None

    return Aux(process, out, log, wait_for(joined, 90, "the aux peer"))


def _checksum(tensors) -> float:
    return sum(float(t.double().sum()) for t in tensors)


@pytest.mark.swarm
def test_aux_checkpoints_equal_trainers_and_restart_the_swarm(tmp_path, workdir):
    aux = start_aux(tmp_path, workdir)
    try:
        trainers = [
            start_peer(tmp_path, name, workdir=str(workdir), run_id=RUN, target=16, max_steps=4, batch_size=8,
                       save_steps=1, initial_peers=aux.initial_peers)
            for name in ("a", "b")
        ]  # fmt: skip
        for trainer in trainers:
            assert trainer.finish(timeout=180)["global_step"] == 4
        wait_for(lambda: list_checkpoints(aux.checkpoints), 30, "a checkpoint")
    finally:
        stop(aux.process)
    saved = list_checkpoints(aux.checkpoints)  # once stopped: it may still have saved a newer one after the first
    log = aux.log()
    assert aux.process.returncode == 0, log[-3000:]
    assert len(saved) <= 2, f"retention keeps 2: {saved}"
    if log.count("Saved checkpoint") > 2:
        assert "Removed old checkpoint" in log
    newest = load_checkpoint(saved[-1])
    step, checksum = newest.step, _checksum(newest.model_state_dict().values())
    assert 1 <= step <= 4

    # the checkpoint is the trainers' state at that step: weights (from_pretrained) and optimizer state
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(newest.path)
    ours = {name: p.detach() for name, p in model.named_parameters()}
    saved_by = [t for t in trainers if (t.out / "output" / f"checkpoint-{step}").exists()]  # (a peer that caught
    assert saved_by, f"no trainer saved step {step}"  # up by downloading skips the steps in between)
    theirs = [load_file(t.out / "output" / f"checkpoint-{step}" / "model.safetensors") for t in saved_by]
    same = [all(torch.equal(ours[name], weights[name]) for name in ours) for weights in theirs]
    assert any(same), f"checkpoint-{step} equals no trainer's weights at step {step}"
    donor = saved_by[same.index(True)]
    trainer_opt = torch.load(donor.out / "output" / f"checkpoint-{step}" / "optimizer.pt", weights_only=True)
    assert trainer_opt["state"].pop("local_epoch") == step
    from hivemind.utils.nested import nested_flatten

    flat = [x for x in nested_flatten(trainer_opt) if isinstance(x, torch.Tensor)]
    got = newest.optimizer_state["tensors"]
    assert len(flat) == len(got) and all(torch.equal(a, b) for a, b in zip(flat, got, strict=True))

    # the whole swarm stopped; the aux peer restarts, serves its newest checkpoint, and a new trainer (initial weights)
    # continues from that collaborative step; the restarted aux peer uploads its next checkpoints to the "Hub"
    with HubStandIn() as hub:
        env = {**ENV, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": hub.url, "HF_TOKEN": "hf_standin"}
        aux = start_aux(tmp_path, workdir, "--push-to-hub", "--hub-repo", "someone/tiny-gpt2", env=env)
        try:
            late = start_peer(tmp_path, "c", workdir=str(workdir), run_id=RUN, target=16, max_steps=step + 2,
                              batch_size=8, sleep_per_step=1.0, initial_peers=aux.initial_peers)  # fmt: skip
            done = late.finish(timeout=180)
            wait_for(lambda: hub.commits, 60, "a checkpoint upload")
        finally:
            stop(aux.process)
        log = aux.log()
    begin = late.records("begin")[0]
    assert begin["step"] == step, f"the new trainer started at {begin['step']}, not at the checkpoint's {step}"
    assert begin["checksum"] == pytest.approx(checksum, rel=1e-9)
    assert done["global_step"] == step + 2
    for row in late.records("log"):  # its linear schedule (1 warmup step) continues at the collaborative step
        expected = 3e-3 * (step + 2 - row["step"]) / (step + 1)
        assert row["lr"] == pytest.approx(expected, rel=1e-6, abs=1e-12), row

    commit = hub.commits[0]
    assert (commit.repo, commit.authorization) == ("someone/tiny-gpt2", "Bearer hf_standin"), log[-3000:]
    assert {"config.json", "model.safetensors", "optimizer_state.pt", "trahiv_state.json"} <= set(commit.files)
    uploaded_step = json.loads(commit.files["trahiv_state.json"])["step"]
    assert uploaded_step > step
    local = aux.checkpoints / f"checkpoint-{uploaded_step}" / "model.safetensors"
    if local.exists():  # (retention may have removed it since)
        assert commit.files["model.safetensors"] == local.read_bytes()
