"""A DiLoCo trainer peer for tests/test_diloco.py and benchmarks/diloco.py: `python tests/diloco_worker.py SPEC.json`.

An unchanged Trainer script with `hivemind_config["diloco"]`. It writes into SPEC["out"]:
- ready.json     once training begins: peer id, the step it starts from (a joiner: the swarm's)
- records.jsonl  one line per outer step reached ("sync": outer step, global step, trainable values' checksum, the
                 values themselves for the toy model, and a sha256 of every trainable tensor and of every outer
                 parameter), and the Trainer's logs
- done.json      at the end: global step, outer step, metrics (rounds, bytes), eval loss with SPEC["eval_blocks"]
- final.pt       with SPEC["save_final"]: the final named parameters
With SPEC["byzantine"] = {"attack": ..., "factor": x} the peer corrupts its pseudo-gradients before every all-reduce
(the attacks of tests/peer_worker.py). SPEC["revert_delay"] = s: a revert order is applied only s seconds after it
is first seen. SPEC["save_steps"] saves Trainer checkpoints every that many inner steps and
SPEC["resume"] resumes from one; both add "state" records (at "save" and at "begin": steps, and sha256 of the outer
parameters, momenta, model parameters and inner optimizer state).
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import psutil
import torch
from hivemind.averaging.allreduce import AllreduceException
from peer_spec import DiLoCoPeerSpec
from peer_worker import build_model, corrupt_, debug_logging, eval_loss
from transformers import TrainerCallback

from trahiv import Trainer, TrainingArguments
from trahiv.demo import BlockDataset
from trahiv.diloco import DiLoCoAverager, DiLoCoOptimizer


class SyncRecorder(TrainerCallback):
    def __init__(self, trainer: Trainer, spec: dict, out: Path):
        self.trainer, self.spec, self.out = trainer, spec, out
        self.records = open(out / "records.jsonl", "a", buffering=1)
        self.outer_step = -1

    def on_train_begin(self, args, state, control, **kwargs):
        swarm = self.trainer.swarm
        self._maybe_record(state)
        if self.spec.get("save_steps") or self.spec.get("resume"):
            self._record_state("begin", state)
        ready = {"peer_id": swarm.peer_id, "pid": os.getpid(), "start_step": state.global_step}
        (self.out / "ready.tmp").write_text(json.dumps(ready))
        (self.out / "ready.tmp").rename(self.out / "ready.json")

    def on_step_end(self, args, state, control, **kwargs):
        if self.spec.get("sleep_per_step"):
            time.sleep(self.spec["sleep_per_step"])
        if state.global_step == self.spec.get("hold_at_step"):  # until another process is there (e.g. a joiner)
            deadline = time.monotonic() + 120
            while not Path(self.spec["hold_until"]).exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        self._maybe_record(state)

    def on_save(self, args, state, control, **kwargs):
        self._record_state("save", state)

    def _record_state(self, at: str, state) -> None:
        diloco = self.trainer.swarm.diloco
        inner = [t for s in diloco.inner.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
        line = {
            "kind": "state",
            "at": at,
            "global_step": state.global_step,
            "outer_step": diloco.outer_step,
            "inner_done": diloco.inner_done,
            "outer_params": digest(diloco.outer_params),
            "momenta": digest(diloco.momenta),
            "momenta_norm": sum(float(m.norm()) for m in diloco.momenta),
            "model": digest([p for p in diloco.params]),
            "inner_state": digest(inner),
        }
        self.records.write(json.dumps(line) + "\n")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs:
            self.records.write(json.dumps({"kind": "log", "step": state.global_step, **logs}) + "\n")

    def _maybe_record(self, state) -> None:
        diloco = self.trainer.swarm.diloco
        if diloco.outer_step == self.outer_step:
            return
        self.outer_step = diloco.outer_step
        named = [(n, p.detach()) for n, p in self.trainer.model.named_parameters() if p.requires_grad]
        line = {
            "kind": "sync",
            "outer_step": diloco.outer_step,
            "global_step": state.global_step,
            "checksum": sum(float(p.double().sum()) for _, p in named),
            "sha256": {
                n: hashlib.sha256(p.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
                for n, p in named
            },  # fmt: skip
            "syncs": dict(diloco.syncs),  # how the syncs so far ended (averaged, alone, ...)
            "t": time.time(),
        }
        # the outer parameters (the model's after a sync; with `overlap` the model keeps the inner steps made while
        # the sync ran in the background on top of them)
        outer_of = {id(p): t for p, t in zip(diloco.params, diloco.outer_params, strict=True)}  # (optimizer order)
        outer = {n: outer_of[id(p)] for n, p in self.trainer.model.named_parameters() if p.requires_grad}
        line["outer_sha256"] = {
            n: hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
            for n, t in outer.items()
        }  # fmt: skip
        if self.spec.get("toy_grad") is not None:
            line["values"] = named[0][1].tolist()
            line["outer_values"] = outer[named[0][0]].tolist()
            line["outer_by_tensor"] = {n: t.tolist() for n, t in outer.items()}
        self.records.write(json.dumps(line) + "\n")


def digest(tensors) -> str:
    sha = hashlib.sha256()
    for t in tensors:
        sha.update(t.detach().float().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def delay_revert_orders(seconds: float) -> None:
    """Apply a revert order only `seconds` after first seeing it (a peer slower to revert than the others)."""
    from trahiv.revert import DiLoCoRevertFollower

    apply, first_seen = DiLoCoRevertFollower.maybe_apply, {}

    def maybe_apply(self, opt):
        signed = self.watcher.pending(self.applied_id)
        if (
            signed is not None
            and time.monotonic() - first_seen.setdefault(signed.order.revert_id, time.monotonic()) < seconds
        ):
            return False
        return apply(self, opt)

    DiLoCoRevertFollower.maybe_apply = maybe_apply  # type: ignore[method-assign]


def byzantine_averager(attack: dict) -> type[DiLoCoAverager]:
    class ByzantineDiLoCoAverager(DiLoCoAverager):
        async def _run_allreduce_inplace_(self, tensors, group_info, **kwargs):
            with torch.no_grad():
                corrupt_(tensors, attack["attack"], attack.get("factor", 1.0))
            await super()._run_allreduce_inplace_(tensors, group_info, **kwargs)

    return ByzantineDiLoCoAverager


def recording_averager(base: type[DiLoCoAverager], path: Path) -> type[DiLoCoAverager]:
    """An averager that appends to `path`, for each all-reduce, the norm of the pseudo-gradients this peer sent (all
    its tensors as one vector), of the aggregate it got back, and of their difference."""

    def norm(tensors) -> float:
        return float(torch.linalg.vector_norm(torch.cat([t.detach().reshape(-1).double() for t in tensors])))

    class RecordingDiLoCoAverager(base):  # type: ignore[misc,valid-type]
        async def _run_allreduce_inplace_(self, tensors, group_info, **kwargs):
            sent = [t.detach().clone() for t in tensors]
            await super()._run_allreduce_inplace_(tensors, group_info, **kwargs)
            moved = norm([t - s for t, s in zip(tensors, sent, strict=True)])
            line = {"sent": norm(sent), "received": norm(tensors), "moved": moved, "group": len(group_info.peer_ids)}
            with open(path, "a") as file:
                file.write(json.dumps(line) + "\n")

    return RecordingDiLoCoAverager


def faulty_averager(base: type[DiLoCoAverager], at_round: int, fault: str, root: int) -> type[DiLoCoAverager]:
    """An averager whose all-reduce number `at_round` (from 1) meets `fault`:
    - "fail": it fails at once: its group counted it in, and it sends nothing (as when its search ended as the group
      assembled); so does every later all-reduce of that group (its search, which goes on, asks the groupmate whose
      part for it arrives for the group and is sent it: trahiv.engine.fixes, 15);
    - "crash": as soon as it is over for the groupmates too (it returned, and each of them closed its stream of the
      parts this peer reduced: it had them all; 10 s at most), SIGKILL the peer's process tree (from `root`: the
      training process, its DHT, p2pd and averagers)."""

    class FaultyDiLoCoAverager(base):  # type: ignore[misc,valid-type]
        rounds = 0
        failed_group: bytes | None = None

        async def _run_allreduce_inplace_(self, tensors, group_info, **kwargs):
            type(self).rounds += 1
            if fault == "fail" and group_info.group_id == type(self).failed_group:
                raise AllreduceException("injected: this peer's all-reduce of that group failed again")
            if type(self).rounds != at_round:
                return await super()._run_allreduce_inplace_(tensors, group_info, **kwargs)
            if fault == "fail":
                type(self).failed_group = group_info.group_id
                raise AllreduceException("injected: this peer's all-reduce failed before it sent a part")
            await super()._run_allreduce_inplace_(tensors, group_info, **kwargs)
            deadline = time.monotonic() + 10
            while self._serving > 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            tree = psutil.Process(root)
            for proc in [*tree.children(recursive=True), tree]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    if proc.pid != os.getpid():
                        proc.kill()
            os.kill(os.getpid(), signal.SIGKILL)

    return FaultyDiLoCoAverager


def inject_sync_events(spec: dict) -> None:
    """The sync faults and events of the spec (see DiLoCoPeerSpec), each at its outer step."""
    wait_for_peers, average = DiLoCoOptimizer._wait_for_peers, DiLoCoOptimizer._average

    def _wait_for_peers(self) -> bool:
        if self.outer_step == spec.get("signal_sync_at"):
            Path(spec["signal_file"]).write_text(json.dumps({"outer_step": self.outer_step}))
        return wait_for_peers(self)

    def _average(self, weight: int) -> str:
        if self.outer_step == spec.get("fail_sync_at"):
            self.syncs["failed"] += 1
            return "failed"
        if self.outer_step == spec.get("hold_sync_at"):
            deadline = time.monotonic() + 120
            while not Path(spec["hold_until"]).exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        return average(self, weight)

    DiLoCoOptimizer._wait_for_peers = _wait_for_peers  # type: ignore[method-assign]
    DiLoCoOptimizer._average = _average  # type: ignore[method-assign]
    adopt = DiLoCoOptimizer._adopt_after_a_missed_sync

    def _adopt_after_a_missed_sync(self) -> bool:
        time.sleep(spec.get("adopt_delay", 0.0))
        return adopt(self)

    DiLoCoOptimizer._adopt_after_a_missed_sync = _adopt_after_a_missed_sync  # type: ignore[method-assign]
    download, stale = DiLoCoOptimizer._download, [spec.get("stale_download", False)]

    def _download(self, prefer: str | None) -> tuple[dict, list[torch.Tensor]] | None:
        loaded = download(self, prefer)
        if stale[0] and self._catching_up and loaded is not None:
            stale[0], held = False, int(loaded[0]["epoch"])
            Path(spec["hold_until"]).write_text(json.dumps({"served": held}))
            deadline = time.monotonic() + 120
            while not any(r.outer_step > held for r in self._others().values()) and time.monotonic() < deadline:
                time.sleep(0.05)
            Path(spec["out"], "stale_download.json").write_text(json.dumps({"held": held}))
        return loaded

    DiLoCoOptimizer._download = _download  # type: ignore[method-assign]
    if not spec.get("serve_late", True):
        DiLoCoOptimizer.serve_late_peers = lambda self: None  # type: ignore[method-assign]


def main(spec_path: str) -> int:
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints every thread's stack (a stuck peer)
    debug_logging()
    spec = DiLoCoPeerSpec.model_validate_json(Path(spec_path).read_text()).model_dump(exclude_unset=True)
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    toy = spec.get("toy_grad") is not None
    opt = {"run_id": spec["run_id"], "target_batch_size": 1, "matchmaking_time": spec.get("mm", 2.0),
           "averaging_timeout": 30.0, **spec.get("opt", {})}  # fmt: skip
    dht = {"initial_peers": spec.get("initial_peers", []), "nat_port_map": False, "client_mode": False}
    diloco = {"inner_steps": spec["inner_steps"], **spec.get("diloco", {})}
    args = TrainingArguments(
        output_dir=str(out / "output"),
        per_device_train_batch_size=spec["batch_size"],
        max_steps=spec["max_steps"],
        learning_rate=spec.get("lr", 0.1 if toy else 3e-3),
        optim=spec.get("optim", "sgd" if toy else "adamw_torch"),
        lr_scheduler_type=spec.get("scheduler", "constant" if toy else "linear"),
        warmup_steps=0 if toy else 2,
        max_grad_norm=0.0 if toy else 1.0,
        dataloader_drop_last=True,
        weight_decay=0.0,
        logging_steps=spec.get("logging_steps", 5),
        report_to=spec.get("report_to", []),
        disable_tqdm=True,
        use_cpu=True,
        save_strategy="steps" if spec.get("save_steps") else "no",
        save_steps=spec.get("save_steps") or 1,
        hivemind_config={
            "dht": dht,
            "opt": opt,
            "diloco": diloco,
            **({"auth": spec["auth"]} if "auth" in spec else {}),
        },
        seed=spec.get("seed", 42),
    )
    if spec.get("byzantine"):
        DiLoCoOptimizer.averager_cls = byzantine_averager(spec["byzantine"])
    if spec.get("record_allreduce"):
        DiLoCoOptimizer.averager_cls = recording_averager(DiLoCoOptimizer.averager_cls, out / "allreduce.jsonl")
    for fault in ("fail", "crash"):  # the sync of outer step N is the peer's all-reduce N + 1 (every sync averaged)
        if spec.get(f"{fault}_round_at_sync") is not None:
            at_round = spec[f"{fault}_round_at_sync"] + 1
            DiLoCoOptimizer.averager_cls = faulty_averager(DiLoCoOptimizer.averager_cls, at_round, fault, os.getpid())
    if not spec.get("download_at_start", True):  # as when the download from the peer to start from fails
        DiLoCoOptimizer.join = lambda self: False  # type: ignore[method-assign]
    inject_sync_events(spec)
    if spec.get("revert_delay"):
        delay_revert_orders(spec["revert_delay"])
    dataset = BlockDataset.load(Path(spec["workdir"]) / "blocks.pt")
    model = build_model(spec)
    begin_loss = eval_loss(model, dataset, spec["eval_blocks"]) if spec.get("eval_blocks") else None
    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    trainer.add_callback(SyncRecorder(trainer, spec, out))
    result = trainer.train(resume_from_checkpoint=spec.get("resume"))
    diloco_opt = trainer.swarm.diloco
    done = {
        "global_step": trainer.state.global_step,
        "outer_step": diloco_opt.outer_step,
        "train_loss": result.training_loss,
        "metrics": diloco_opt.metrics(),
        "syncs": diloco_opt.syncs,
    }
    if spec.get("eval_blocks"):
        done["eval_loss_begin"] = begin_loss
        done["eval_loss"] = eval_loss(trainer.model, dataset, spec["eval_blocks"])
    if spec.get("save_final"):
        torch.save({n: p.detach() for n, p in trainer.model.named_parameters()}, out / "final.pt")
    (out / "done.json").write_text(json.dumps(done))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1]))
    except KeyboardInterrupt:
        sys.exit(130)
