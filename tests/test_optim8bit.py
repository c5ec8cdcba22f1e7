"""bitsandbytes 8-bit optimizers inside the swarm, with the optimizer offloaded to the CPU (trahiv's default), trained
for real on the CPU: AdamW through `optim=`, LAMB through `optimizer_cls_and_kwargs`, embeddings kept in 32 bits,
gradient checkpointing, a late peer downloading the 8-bit optimizer state, and compressions of that state."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import bitsandbytes as bnb
import pytest
import torch
import transformers
from swarm_helpers import TESTS, Peer, start_bootstrap, start_peer
from transformers import TrainerCallback

from trahiv import Trainer, TrainingArguments
from trahiv.demo import BlockDataset

pytestmark = pytest.mark.swarm

STEPS = 3
WORKER = TESTS / "optim8bit_worker.py"


def make_trainer(tmp: Path, workdir: Path, run_id: str, trainer_kwargs: dict | None = None, **kwargs: Any) -> Trainer:
    """A lone peer (in this process) with 2 local steps of 8 samples per collaborative step."""
    args = TrainingArguments(
        output_dir=str(tmp / run_id), max_steps=STEPS, per_device_train_batch_size=8, learning_rate=3e-3,
        report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, logging_steps=1,
        hivemind_config={"dht": {"nat_port_map": False}, "opt": {"run_id": run_id, "target_batch_size": 16}},
        **kwargs,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_pretrained(workdir / "model")
    dataset = BlockDataset.load(workdir / "blocks.pt")
    return Trainer(model=model, args=args, train_dataset=dataset, **(trainer_kwargs or {}))


def train(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Train; return the parameters as they were before."""
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    return before


def optimizer_states(trainer: Trainer) -> dict[str, tuple[torch.Tensor, dict[str, Any]]]:
    """Model parameter name -> (the inner optimizer's offloaded copy of it, that copy's optimizer state). hivemind gives
    the optimizer the copies in the order of its main parameters."""
    swarm_opt = trainer.swarm.optimizer
    offloaded = [p for group in swarm_opt.opt.param_groups for p in group["params"]]
    names = {id(p): name for name, p in trainer.model.named_parameters()}
    main = [names[id(p)] for p in swarm_opt.state_averager.main_parameters]
    return {name: (copy, swarm_opt.opt.state[copy]) for name, copy in zip(main, offloaded, strict=True)}


def embedding_names(model: torch.nn.Module) -> set[str]:
    return {f"{module_name}.weight" for module_name, m in model.named_modules() if isinstance(m, torch.nn.Embedding)}


def check_trained_in_8_bits(trainer: Trainer, before: dict[str, torch.Tensor], cls: type, lamb: bool = False) -> None:
    check_8_bit_states(trainer, before, cls)
    check_progress(trainer, before, lamb)


def check_8_bit_states(trainer: Trainer, before: dict[str, torch.Tensor], cls: type) -> None:
    optimizer = trainer.swarm.optimizer.opt
    assert isinstance(optimizer, cls) and optimizer.args.optim_bits == 8, optimizer
    states = optimizer_states(trainer)
    assert states.keys() == before.keys()
    model_params = {id(p) for p in trainer.model.parameters()}
    assert not model_params & {id(copy) for copy, _ in states.values()}, "the optimizer should update offloaded copies"
    # bitsandbytes keeps tensors below min_8bit_size (biases) in 32 bits, and trahiv's Trainer the embeddings (as
    # transformers' Trainer does: 8-bit embedding states make training unstable)
    embeddings = embedding_names(trainer.model)
    large = {name for name, (copy, _) in states.items() if copy.numel() >= optimizer.args.min_8bit_size}
    assert embeddings == {"transformer.wte.weight", "transformer.wpe.weight"} and embeddings <= large
    for name, (copy, state) in states.items():
        assert copy.device.type == state["state1"].device.type == state["state2"].device.type == "cpu"
        bits = torch.float32 if name in embeddings or name not in large else torch.uint8
        assert state["state1"].dtype == state["state2"].dtype == bits, name
    large -= embeddings
    assert sum(states[name][0].numel() for name in large) > 0.75 * sum(p.numel() for p in before.values())


def check_progress(trainer: Trainer, before: dict[str, torch.Tensor], lamb: bool) -> None:
    assert trainer.state.global_step == STEPS
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    assert len(losses) == STEPS and losses[-1] < losses[0], losses
    # bitsandbytes' LAMB bounds each update by max_unorm x the parameter's norm: parameters at zero (biases) stay there
    should_change = {name for name, p in before.items() if not lamb or p.any()}
    changed = {name for name, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[name])}
    assert len(should_change) > len(before) / 2 and should_change <= changed, f"unchanged: {should_change - changed}"


@pytest.fixture(scope="module")
def adamw_8bit(tmp_path_factory, workdir) -> tuple[Trainer, dict[str, torch.Tensor]]:
    trainer = make_trainer(tmp_path_factory.mktemp("adamw8bit"), workdir, "adamw-8bit", optim="adamw_bnb_8bit")
    return trainer, train(trainer)


def test_adamw_bnb_8bit_trains_with_8_bit_states_on_the_cpu(adamw_8bit):
    trainer, before = adamw_8bit
    check_trained_in_8_bits(trainer, before, bnb.optim.AdamW)


def test_lamb_8bit_from_optimizer_cls_and_kwargs(tmp_path, workdir):
    lamb = {"optimizer_cls_and_kwargs": (bnb.optim.LAMB8bit, {"lr": 1e-2})}
    trainer = make_trainer(tmp_path, workdir, "lamb-8bit", trainer_kwargs=lamb)
    before = train(trainer)
    check_trained_in_8_bits(trainer, before, bnb.optim.LAMB8bit, lamb=True)
    assert {group["initial_lr"] for group in trainer.swarm.optimizer.opt.param_groups} == {1e-2}


def test_every_compression_keeps_8_bit_states_exact(adamw_8bit):
    from hivemind.compression import CompressionInfo, deserialize_torch_tensor

    import trahiv.swarm  # noqa: F401  (the engine's fixes to hivemind's codecs, as in a peer)
    from trahiv.compression import make_compression
    from trahiv.config import COMPRESSIONS

    trainer, _ = adamw_8bit
    state = optimizer_states(trainer)["transformer.h.0.mlp.c_fc.weight"][1]["state1"]
    assert state.dtype == torch.uint8
    wrong = {}
    for name in COMPRESSIONS:
        try:
            info = CompressionInfo.from_tensor(state, key=0)
            restored = deserialize_torch_tensor(make_compression(name).compress(state, info, allow_inplace=False))
            if not torch.equal(restored, state):
                wrong[name] = "altered"
        except ValueError as e:
            wrong[name] = str(e)
    assert not wrong, wrong


class CheckpointingProbe(TrainerCallback):
    """Counts local steps, forward calls of a block's attention, and whether the model says checkpointing is on.
    (The recomputation stops after the last tensor the backward pass needs; the attention, the block's first part, is
    surely recomputed.)"""

    def __init__(self, model: torch.nn.Module, attention: torch.nn.Module):
        self.model, self.steps, self.attention_calls, self.enabled = model, 0, 0, []
        attention.register_forward_hook(self._count)

    def _count(self, *args: Any) -> None:
        self.attention_calls += 1

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1
        self.enabled.append(self.model.is_activation_checkpointing)


# transformers 5 renamed gradient_checkpointing (kept as a deprecated alias) to activation_checkpointing
@pytest.mark.parametrize("argument", ["gradient_checkpointing", "activation_checkpointing"])
def test_gradient_checkpointing_is_honoured(tmp_path, workdir, argument):
    trainer = make_trainer(tmp_path, workdir, f"{argument}-8bit", optim="adamw_bnb_8bit", **{argument: True})
    assert not trainer.model.is_activation_checkpointing  # the Trainer turns it on when training starts
    probe = CheckpointingProbe(trainer.model, trainer.model.transformer.h[0].attn)
    trainer.add_callback(probe)
    before = train(trainer)
    assert probe.steps == 2 * STEPS and all(probe.enabled) and len(probe.enabled) == probe.steps
    assert probe.attention_calls == 2 * probe.steps, "the block should run again in the backward pass (recomputation)"
    check_trained_in_8_bits(trainer, before, bnb.optim.AdamW)


def test_each_8_bit_optimizer_keeps_its_own_32_bit_overrides():
    """bitsandbytes keeps overrides in one process-wide manager, by (group, index) and by tensor id, forever: an
    optimizer built after another one in the same process must not inherit the first one's 32-bit positions."""
    from trahiv.trainer import _keep_32bit_states

    def states(params: list[torch.Tensor], positions: list[tuple[int, int]]) -> list[torch.dtype]:
        optimizer = bnb.optim.AdamW8bit([{"params": params}], lr=1e-3)
        _keep_32bit_states(optimizer, positions)
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer.step()
        return [optimizer.state[p]["state1"].dtype for p in params]

    big = 2 * 4096  # above bitsandbytes' min_8bit_size
    first = states([torch.zeros(big, requires_grad=True), torch.zeros(big, requires_grad=True)], [(0, 0)])
    assert first == [torch.float32, torch.uint8]
    second = states([torch.zeros(big, requires_grad=True), torch.zeros(big, requires_grad=True)], [(0, 1)])
    assert second == [torch.uint8, torch.float32], "the first optimizer's override leaked into the second"
    assert not bnb.optim.GlobalOptimManager.get_instance().index2config, "the process-wide manager was written to"


# --- two peers ----------------------------------------------------------------------------------------------------


def start_worker(tmp: Path, name: str, **spec: Any) -> Peer:
    """swarm_helpers.start_peer, with the 8-bit worker (forked from the warm fork server: as a fresh interpreter each
    peer took 9-11 s to start, its imports most of it)."""
    return start_peer(tmp, name, worker=WORKER.name, **spec)


def optimizer_rows(peer: Peer) -> dict[tuple[str, int], dict]:
    rows = [json.loads(line) for line in (peer.out / "optim.jsonl").read_text().splitlines()]
    return {(row["kind"], row["step"]): row for row in rows}


def same_state(a: dict, b: dict) -> bool:
    sums_a, sums_b = a["sums"], b["sums"]
    return sums_a.keys() == sums_b.keys() and all(sums_a[k] == pytest.approx(sums_b[k], rel=1e-6) for k in sums_a)


def test_late_peer_downloads_the_8_bit_state_and_trains_in_step(tmp_path, workdir):
    def scenario(tmp: Path) -> tuple[Peer, Peer, int, dict, dict]:
        tmp.mkdir()
        boot = start_bootstrap(tmp)
        common = dict(workdir=str(workdir), run_id="late-8bit", target=32, batch_size=8, max_steps=6, sleep=0.3,
                      initial_peers=boot.initial_peers)  # fmt: skip
        try:
            # the first peer trains slowly until the late one has caught up and taken a step with it: the swarm is
            # still training when the late peer joins, and does not step without it while it downloads the state
            a = start_worker(tmp, "a", slow_sleep=1.0, slow_until=str(tmp / "b" / "stepped"),
                             hold_until=str(tmp / "b" / "ready.json"), **common)  # fmt: skip
            a.wait_step(1, timeout=60)
            b = start_worker(tmp, "b", **common)
            start = b.ready(timeout=60)["start_step"]
            return a, b, start, a.finish(timeout=60), b.finish(timeout=30)
        finally:
            boot.stop()

    a, b, start, done_a, done_b = scenario(tmp_path / "run")
    assert 1 <= start < 6, f"the late peer started at step {start}"
    assert done_a["global_step"] == done_b["global_step"] == 6
    rows_a, rows_b = optimizer_rows(a), optimizer_rows(b)
    begin_b = rows_b["begin", start]
    assert begin_b["class"] == "AdamW" and begin_b["dtypes"]["state1"] == ["float32", "uint8"], begin_b
    # the downloaded state is the swarm's, exactly: the first peer's after one of its steps (the latest, unless the
    # swarm moved on while the late peer downloaded), not the fresh state of a newly built optimizer
    assert any(same_state(begin_b, rows_a["step", step]) for step in (start, start - 1)), (begin_b, rows_a)
    common_steps = sorted({s for kind, s in rows_a if kind == "step"} & {s for kind, s in rows_b if kind == "step"})
    assert common_steps and common_steps[-1] == 6, common_steps
    for step in common_steps:
        assert same_state(rows_a["step", step], rows_b["step", step]), step
        assert rows_b["step", step]["steps"] == rows_a["step", step]["steps"], step
    params_a, params_b = a.params_at(), b.params_at()
    for step in common_steps:
        assert params_b[step]["checksum"] == pytest.approx(params_a[step]["checksum"], rel=1e-6), step
    assert done_b["abs"] == pytest.approx(done_a["abs"], rel=1e-6)
    assert done_b["checksum"] == pytest.approx(done_a["checksum"], rel=1e-6, abs=1e-4)
