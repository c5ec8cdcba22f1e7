"""A trainer peer for the swarm tests: `python tests/peer_worker.py SPEC.json`.

It trains with trahiv's Trainer as a user script would, and writes what the tests check into SPEC["out"]:
- ready.json      once training begins: peer id, pids of its engine processes, the step it started from
- records.jsonl   one line per local step (collaborative step before/after, samples, loss) and, at every
                  collaborative step, the trainable parameters' checksum (or values, for the toy model) and the
                  metrics record it published (kind "metrics"; SPEC["metrics"] is hivemind_config["metrics"])
- done.json       at the end: collaborative step, samples contributed, train loss (and, with SPEC["eval_blocks"],
                  the loss of the initial and final model on the dataset's first blocks)
- attacks.jsonl   with SPEC["byzantine"] = {"attack": "scale" | "nan" | "sign_flip" | "noise", "factor": x} (or a list
                  of them, used in turn): one line per averaging round whose gradients this peer corrupted just before
                  sending them; also one line per round a "nan" or "lie_samples" fault (SPEC["faults"]) corrupted

SPEC is a tests/peer_spec.py PeerSpec; its faults fire when the collaborative step reaches their `at_step` (a record of
kind "fault" says when).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import torch
import transformers
from hivemind.averaging import DecentralizedAverager
from peer_spec import PeerSpec
from transformers import TrainerCallback

from trahiv import Trainer, TrainingArguments
from trahiv.demo import BlockDataset
from trahiv.engine import optimizer as optimizer_module
from trahiv.engine.averagers import RobustGradientAverager, RobustTrainingStateAverager
from trahiv.engine.optimizer import SwarmOptimizer
from trahiv.engine.tell import TellsGroupmates
from trahiv.swarm import Swarm


def corrupt_(tensors, attack: str, factor: float) -> None:
    """What a Byzantine peer sends instead of its gradients (in place)."""
    for tensor in tensors:
        if attack == "scale":
            tensor.mul_(factor)
        elif attack == "sign_flip":
            tensor.mul_(-factor)
        elif attack == "inflate_weight":  # the flipped gradient, sent with a weight `factor` times its samples
            tensor.mul_(-1.0)
        elif attack == "noise":
            tensor.add_(torch.randn_like(tensor) * factor)
        elif attack == "nan":
            tensor.fill_(float("nan")).view(-1)[1::2] = float("inf")
        elif attack == "lie_samples":  # honest gradients, sent with a weight `factor` times its samples
            pass
        else:
            raise ValueError(f"unknown attack {attack!r}")


ARMED_ATTACKS: list[dict] = [{"attack": "nan"}, {"attack": "lie_samples"}]  # codes 1, 2 of an armed fault


def byzantine_averager(
    attacks: list[dict], log: Path, armed: Any = None, once: bool = False
) -> type[RobustGradientAverager]:
    """A gradient averager that corrupts this peer's accumulated gradients just before every all-reduce, with the
    attacks in turn, round after round (`once`: each attack once, then honest rounds; its own reducer stays honest:
    the attack is on what it sends; an attack with `min_group` waits for a group that large, averaging honestly
    meanwhile); with no
    `attacks`, only in the round after a fault armed `armed` (shared memory: the averager runs in its own process). It
    keeps its own model finite: the parts that honest reducers refuse to send back to it (after sending NaN) revert to
    its true gradients, so that the next rounds' attacks are made on real gradients, not on NaN."""

    class ByzantineGradientAverager(RobustGradientAverager):
        rounds = 0

        async def _run_allreduce_inplace_(self, tensors, group_info, **kwargs):
            if attacks and once and self.rounds >= len(attacks):  # every attack made: honest from here
                return await super()._run_allreduce_inplace_(tensors, group_info, **kwargs)
            if attacks and len(group_info.peer_ids) >= attacks[self.rounds % len(attacks)].get("min_group", 1):
                attack = attacks[self.rounds % len(attacks)]
            elif attacks:  # a group too small for this attack: averaged honestly, the attack waits for the next round
                return await super()._run_allreduce_inplace_(tensors, group_info, **kwargs)
            elif armed is not None and armed[0] > 0:
                attack = {**ARMED_ATTACKS[int(armed[0]) - 1], "factor": armed[1]}
                armed[0] = 0
            else:
                return await super()._run_allreduce_inplace_(tensors, group_info, **kwargs)
            true_gradients = [tensor.detach().clone() for tensor in tensors]
            with torch.no_grad():
                corrupt_(tensors, attack["attack"], attack.get("factor", 1.0))
            line = {"round": self.rounds, **attack, "group_size": len(group_info.peer_ids), "t": time.time()}
            with open(log, "a") as f:
                f.write(json.dumps(line) + "\n")
            self.rounds += 1
            if attack["attack"] in ("inflate_weight", "lie_samples"):
                kwargs["weight"] = kwargs["weight"] * attack["factor"]
            try:
                await super()._run_allreduce_inplace_(tensors, group_info, **kwargs)
            finally:
                with torch.no_grad():
                    for tensor, true in zip(tensors, true_gradients, strict=True):
                        torch.where(torch.isfinite(tensor), tensor, true, out=tensor)

    return ByzantineGradientAverager


class PoisonedStateAverager(RobustTrainingStateAverager):
    """Trains honestly but serves NaN weights to peers that download its state, claiming the highest priority."""

    @property
    def state_sharing_priority(self) -> float:
        return float(self._state_sharing_priority.value)

    @state_sharing_priority.setter
    def state_sharing_priority(self, value: float) -> None:
        DecentralizedAverager.state_sharing_priority.fset(self, 1e9)  # type: ignore[attr-defined]

    def get_current_state(self):
        metadata, tensors, infos = super().get_current_state()
        return metadata, [torch.full_like(t, float("nan")) if t.is_floating_point() else t for t in tensors], infos


@torch.no_grad()
def eval_loss(model, dataset, blocks: int) -> float:
    """Mean loss on the dataset's first `blocks` blocks (the same for every peer and run)."""
    was_training = model.training
    model.eval()
    batch = torch.stack([dataset[i]["input_ids"] for i in range(blocks)])
    loss = float(model(input_ids=batch, labels=batch)["loss"])
    model.train(was_training)
    return loss


class ToyModel(torch.nn.Module):
    """loss = <w, c>: every local step's gradient is exactly c, so the averaged update is predictable."""

    def __init__(self, grad: float, size: int = 4, tensors: int = 1):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(size))
        self.more = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(size)) for _ in range(tensors - 1)])
        self.register_buffer("c", torch.full((size,), float(grad)))

    def forward(self, input_ids=None, labels=None, **kwargs):
        loss = sum(((w * self.c).sum() for w in (self.w, *self.more)), 0.0 * input_ids.float().sum())
        return {"loss": loss}


class FaultInjector(TrainerCallback):
    """Fires SPEC["faults"] when the collaborative step reaches their `at_step` (see tests/peer_spec.py)."""

    def __init__(self, faults: list[dict], armed: Any, records: Any, trainer: Trainer):
        self.pending, self.armed, self.records = sorted(faults, key=lambda f: f["at_step"]), armed, records
        self.trainer = trainer

    def on_step_begin(self, args, state, control, **kwargs):
        while self.pending and state.global_step >= self.pending[0]["at_step"]:
            fault = self.pending.pop(0)
            line = {**fault, "fault": fault["kind"], "kind": "fault", "step": state.global_step, "t": time.time()}
            self.records.write(json.dumps(line) + "\n")
            self.records.flush()
            if fault["kind"] == "stall":
                time.sleep(fault["seconds"])  # the fault itself: this peer is frozen
            elif fault["kind"] == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault["kind"] in ("kill_dht", "kill_p2pd"):  # one engine process dies under the peer (OOM killer)
                dht = psutil.Process(self.trainer.swarm.dht.pid)
                victim = dht if fault["kind"] == "kill_dht" else next(c for c in dht.children() if "p2pd" in c.name())
                victim.kill()
            else:  # nan / lie_samples: the next round this peer joins
                self.armed[1] = fault["factor"]
                self.armed[0] = 1 + [a["attack"] for a in ARMED_ATTACKS].index(fault["kind"])


class Recorder(TrainerCallback):
    def __init__(self, trainer: Trainer, spec: dict, out: Path):
        self.trainer, self.spec, self.out = trainer, spec, out
        self.records = open(out / "records.jsonl", "a", buffering=1)
        self.epoch_before = self.pre_samples = 0
        self.last_loss = None

    def on_train_begin(self, args, state, control, **kwargs):
        swarm = self.trainer.swarm
        ready = {
            "peer_id": swarm.peer_id,
            "pid": os.getpid(),
            "engine_pids": [p.pid for p in swarm.engine_processes()],
            "start_step": state.global_step,
            "averaged_tensors": len(swarm.optimizer.state_averager.main_parameters),
        }
        self._params(state.global_step, "begin")  # before ready.json: tests read it as soon as the peer is ready
        (self.out / "ready.tmp").write_text(json.dumps(ready))
        (self.out / "ready.tmp").rename(self.out / "ready.json")  # atomic: never read half-written

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        opt = self.trainer.swarm.optimizer
        self.epoch_before, self.pre_samples = opt.local_epoch, opt.grad_averager.local_samples_accumulated
        self.batch = opt.pending_batch_size
        self.began = time.time()  # before this local step's optimizer step (and any averaging round it runs)

    def on_step_end(self, args, state, control, **kwargs):
        if self.spec.get("sleep_per_step"):
            time.sleep(self.spec["sleep_per_step"])
        line = {
            "kind": "local",
            "epoch_before": self.epoch_before,
            "epoch_after": state.global_step,
            "pre_samples": self.pre_samples,
            "batch": self.batch,
            "began": self.began,
            "t": time.time(),
        }
        self.records.write(json.dumps(line) + "\n")
        if state.global_step < self.epoch_before:  # a moderator reverted the swarm (trahiv.revert)
            self._params(state.global_step, "revert")
        if state.global_step > self.epoch_before:
            self._params(state.global_step, "step")
            published = self.trainer.swarm.metrics_publisher
            if published is not None and published.last_record is not None:  # what the aux peer must have read
                self.records.write(json.dumps({"kind": "metrics", **published.last_record.dict()}) + "\n")

    def on_train_end(self, args, state, control, **kwargs):
        self._params(state.global_step, "end")  # the model as training ended, before the peer leaves the swarm

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            row = {"kind": "log", "step": state.global_step, "loss": logs["loss"], "lr": logs.get("learning_rate")}
            self.records.write(json.dumps(row) + "\n")

    def _params(self, step: int, kind: str) -> None:
        named = [(n, p.detach().double()) for n, p in self.trainer.model.named_parameters() if p.requires_grad]
        line = {
            "kind": kind,
            "step": step,
            "checksum": sum(float(p.sum()) for _, p in named),
            "abs": sum(float(p.abs().sum()) for _, p in named),
            "digest": digest(self.trainer.model),  # the exact bits
        }
        if self.spec.get("toy_grad") is not None:
            line["values"] = named[0][1].tolist()
        if kind == "revert":  # exact weights, by name
            exact = [(n, p.detach().contiguous()) for n, p in self.trainer.model.named_parameters() if p.requires_grad]
            line["sha256"] = {n: hashlib.sha256(p.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
                              for n, p in exact}  # fmt: skip
        self.records.write(json.dumps(line) + "\n")


def digest(model) -> str:
    """sha256 of the trainable parameters' bytes, in order."""
    sha = hashlib.sha256()
    for _, p in model.named_parameters():
        if p.requires_grad:
            sha.update(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def build_model(spec: dict):
    if spec.get("toy_grad") is not None:
        return ToyModel(spec["toy_grad"], tensors=spec.get("toy_tensors", 1))
    model = transformers.AutoModelForCausalLM.from_pretrained(Path(spec["workdir"]) / "model")
    if spec.get("n_embd") and spec["n_embd"] != model.config.n_embd:  # a deliberately different model
        config = model.config
        config.n_embd = spec["n_embd"]
        model = transformers.GPT2LMHeadModel(config)
    if spec.get("lora"):
        import peft

        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True)
        model = peft.get_peft_model(model, lora)
    return model


def debug_logging() -> None:
    """With TRAHIV_TEST_DEBUG set, trahiv's DEBUG lines go to the peer's log (shares, holds, step timings), and so do
    hivemind's matchmaking and averager lines (who asked whom, who accepted, when a group assembled)."""
    if os.environ.get("TRAHIV_TEST_DEBUG"):
        import logging

        handler = logging.StreamHandler()
        handler.setFormatter(
            logging.Formatter("%(asctime)s.%(msecs)03d %(process)d [%(name)s] %(message)s", "%H:%M:%S")
        )
        for name in ("trahiv", "hivemind.averaging.matchmaking", "hivemind.averaging.averager"):
            logger = logging.getLogger(name)
            logger.addHandler(handler)
            logger.setLevel(logging.DEBUG)
            logger.propagate = False


def main(spec_path: str) -> int:
    debug_logging()
    parsed = PeerSpec.model_validate_json(Path(spec_path).read_text())
    spec = {**parsed.model_dump(exclude_unset=True), "faults": [fault.model_dump() for fault in parsed.faults]}
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    toy = spec.get("toy_grad") is not None
    opt = {
        "run_id": spec["run_id"],
        "target_batch_size": spec["target"],
        "matchmaking_time": spec.get("mm", 2.0),
        "averaging_timeout": 30.0,
        "verbose": True,
        **spec.get("opt", {}),
    }
    # reachable on loopback: no dial-back at start (client_mode "auto" is tested by test_nat.py and test_doctor.py)
    dht = {"initial_peers": spec.get("initial_peers", []), "nat_port_map": False, "client_mode": False,
           **spec.get("dht", {})}  # fmt: skip
    args = TrainingArguments(
        output_dir=str(out / "output"),
        per_device_train_batch_size=spec["batch_size"],
        max_steps=spec["max_steps"],
        learning_rate=spec.get("lr", 1.0 if toy else 3e-3),
        optim=spec.get("optim", "sgd" if toy else "adamw_torch"),
        lr_scheduler_type=spec.get("scheduler", "constant" if toy else "linear"),
        warmup_steps=0 if toy or spec.get("scheduler") == "constant" else 1,
        max_grad_norm=0.0 if toy else 1.0,
        dataloader_drop_last=toy,
        weight_decay=0.0,
        logging_steps=1,
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        save_strategy="steps" if spec.get("save_steps") else "no",
        save_steps=spec.get("save_steps") or 1,
        hivemind_config={"dht": dht, "opt": opt, **{k: spec[k] for k in ("metrics", "auth") if k in spec}},
        seed=spec.get("seed", 42),
    )
    armed = mp.Array("d", 2)  # [attack code, factor], set by a fault, taken by the averager's process
    attacks = spec.get("byzantine") or []
    attacks = attacks if isinstance(attacks, list) else [attacks]
    if attacks or any(f["kind"] in ("nan", "lie_samples") for f in spec.get("faults", [])):
        once = spec.get("byzantine_once", False)
        Swarm.grad_averager_cls = byzantine_averager(attacks, out / "attacks.jsonl", armed, once)
    if spec.get("poison_state"):
        SwarmOptimizer.state_averager_cls = PoisonedStateAverager
    if spec.get("progress_recheck_s") is not None:  # (read at each wait: the averager processes are not concerned)
        optimizer_module.PROGRESS_RECHECK_PERIOD = spec["progress_recheck_s"]
    if not spec.get("tells", True):  # (before the averager processes fork)

        async def tell_nobody(self, group_info):
            return None

        TellsGroupmates.tell_groupmates = tell_nobody
    dataset = BlockDataset.load(Path(spec["workdir"]) / "blocks.pt")
    model = build_model(spec)
    if spec.get("init_seed") is not None:  # weights of its own (as LoRA adapters initialized at random are)
        noise = torch.Generator().manual_seed(spec["init_seed"])
        with torch.no_grad():
            for param in model.parameters():
                if param.requires_grad:
                    param.add_(torch.randn(param.shape, generator=noise) * 0.01)
    begin_loss = eval_loss(model, dataset, spec["eval_blocks"]) if spec.get("eval_blocks") else None
    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    recorder = Recorder(trainer, spec, out)
    trainer.add_callback(recorder)
    if spec.get("faults"):
        trainer.add_callback(FaultInjector(spec["faults"], armed, recorder.records, trainer))
    result = trainer.train(resume_from_checkpoint=spec.get("resume"))
    done = {
        "global_step": trainer.state.global_step,
        "samples_contributed": trainer.swarm.optimizer.samples_contributed,
        "train_loss": result.training_loss,
        "averaging_rounds": trainer.swarm.optimizer.averaging_rounds(),  # type: ignore[union-attr]
        "metrics": trainer.swarm.metrics(),
    }
    if spec.get("toy_grad") is not None:  # the model as train() left it
        done["values"] = trainer.model.w.detach().tolist()
    if spec.get("eval_blocks"):
        done["eval_loss_begin"] = begin_loss
        done["eval_loss"] = eval_loss(trainer.model, dataset, spec["eval_blocks"])
    if spec.get("lora"):
        torch.save({n: p.detach() for n, p in trainer.model.named_parameters()}, out / "final.pt")
    (out / "done.json").write_text(json.dumps(done))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1]))
    except KeyboardInterrupt:
        sys.exit(130)
