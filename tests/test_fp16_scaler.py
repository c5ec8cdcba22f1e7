"""fp16 loss scaling in a swarm peer, run on the CPU: the Trainer's gradient scaler on a GPU is the same code on any
device, so these tests give the Trainer a CPU `GradScaler` where transformers would give it a CUDA one (on a CPU it
gives none). The gradients that reach the swarm must be unscaled, gradient clipping must see unscaled gradients, and a
local step whose gradients overflowed must be dropped without harm. tests/test_cuda.py runs the same on a GPU."""

from __future__ import annotations

import pytest
import torch

from trahiv import Trainer, TrainingArguments

pytestmark = pytest.mark.swarm

C = 0.5  # the toy's gradient: every element of every local step's gradient is exactly C (lr 1: w = -C per step)
SCALE = 1024.0  # a loss scale whose products with C are exact


class Toy(torch.nn.Module):
    """loss = <w, c> (times `blowup` from local step `overflow_at` on, once): every gradient is exactly c."""

    def __init__(self, overflow_at: int | None = None):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4))
        self.register_buffer("c", torch.full((4,), C))
        self.overflow_at, self.calls = overflow_at, 0

    def forward(self, input_ids=None, labels=None, **kwargs):
        self.calls += 1
        loss = (self.w * self.c).sum() + 0.0 * input_ids.float().sum()
        if self.calls == self.overflow_at:
            loss = loss * float("inf")  # its gradients are inf and NaN once scaled
        return {"loss": loss}


class ScaledTrainer(Trainer):
    """Trainer whose accelerator scales the loss as it does with fp16 on a GPU (a GradScaler, native AMP)."""

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        self.accelerator.scaler = self.make_scaler()
        self.accelerator.native_amp = True  # clip_grad_norm_ unscales first, as it does on a GPU

    def make_scaler(self):
        return torch.amp.GradScaler("cpu", init_scale=SCALE)


def make_trainer(tmp_path, run_id: str, model: Toy, max_grad_norm: float = 10.0, opt=None, cls=ScaledTrainer):
    args = TrainingArguments(
        output_dir=str(tmp_path / run_id), max_steps=3, per_device_train_batch_size=4, use_cpu=True, fp16=True,
        optim="sgd", learning_rate=1.0, lr_scheduler_type="constant", max_grad_norm=max_grad_norm, weight_decay=0.0,
        report_to=[], save_strategy="no", disable_tqdm=True, logging_steps=1, dataloader_drop_last=True,
        hivemind_config={"dht": {"nat_port_map": False},
                         "opt": {"run_id": run_id, "target_batch_size": 8, **(opt or {})}},
    )  # fmt: skip
    data = [{"input_ids": torch.tensor([1, 2])} for _ in range(64)]
    return cls(model=model, args=args, train_dataset=data)


def test_the_swarm_averages_and_clips_unscaled_gradients(tmp_path):
    """2 local steps of 4 samples per collaborative step, 3 steps, lr 1: w = -3 C exactly. Scaled gradients (x1024)
    clipped to norm 10 would give -5 per step (clipping the true ones, norm 1, leaves them alone)."""
    trainer = make_trainer(tmp_path, "fp16-unscaled", Toy())
    trainer.train()
    assert trainer.state.global_step == 3
    assert isinstance(trainer.accelerator.scaler, torch.amp.GradScaler)
    assert trainer.model.w.detach().tolist() == [-3 * C] * 4
    norms = [row["grad_norm"] for row in trainer.state.log_history if "grad_norm" in row]
    assert norms and all(norm == pytest.approx(2 * C) for norm in norms), norms  # unscaled: |c| = 1 for 4 elements


def test_a_local_step_that_overflowed_is_dropped_and_the_scale_lowered(tmp_path):
    """The third local step's loss is inf: the scaler skips that optimizer step (its samples never reach the swarm)
    and halves its scale; the swarm's steps go on with finite weights, each the exact mean gradient."""
    trainer = make_trainer(tmp_path, "fp16-overflow", Toy(overflow_at=3))
    trainer.train()
    assert trainer.state.global_step == 3
    assert trainer.accelerator.scaler.get_scale() == SCALE / 2
    assert trainer.model.w.detach().tolist() == [-3 * C] * 4
    assert trainer.swarm.optimizer.samples_contributed == 3 * 8  # 7 local steps of 4 samples, one dropped


def test_reused_gradient_buffers_are_refused_before_the_peer_starts(tmp_path):
    """hivemind's reuse_grad_buffers sums the local steps' gradients in .grad, which the Trainer zeroes after every
    local step: the swarm would average the last one's, divided by their count (half the update here, measured)."""
    with pytest.raises(ValueError, match="reuse_grad_buffers.*zeroes .grad after every local step"):
        make_trainer(tmp_path, "fp16-reuse", Toy(), opt={"reuse_grad_buffers": True})
