"""Benchmark 4, convergence: N trahiv peers (real processes on 127.0.0.1, a bootstrap DHT, `min_peers` = N so they start
together) train the demo's tiny GPT-2 from the same initial weights, against one plain `transformers.Trainer` process
with the same global batch (N x per-peer batch), the same number of optimizer steps, optimizer and LR schedule.
Both are evaluated on the same held-out blocks; prints JSON.

Run:
    .venv/bin/python benchmarks/convergence.py --compression none   # 4 peers x 2 samples x 4 local steps, 30 steps
    .venv/bin/python benchmarks/convergence.py --compression size_adaptive   # the Internet setting
    .venv/bin/python benchmarks/convergence.py --compression size_adaptive --state-compression fp16
    .venv/bin/python benchmarks/convergence.py --compression none --data-order shared   # the same samples

hivemind's target_batch_size is a minimum: peers keep computing until they see the swarm reach it, so the swarm's
real samples per step (reported) exceed the global batch, by far when local steps are short against the progress
reports' latency (here ~0.1 s steps on 2 shared cores: ~3.5x). The JSON reports them per collaborative step.

Data (--corpus demo, the default): the demo's blocks (trahiv.demo.prepare_workdir), 67 for training: 30 steps of 32
samples read each about 14 times. --corpus stdlib: 20,000 blocks of the Python standard library's source, none
read twice (prepare_stdlib_workdir). Demo: the last stretch of the text is held out: its blocks, and every
half-shifted block overlapping it, are never trained on. Each trahiv peer shuffles the training blocks in its
own order (seeded by its identity); the single process sees the same number of samples in one order. Last partial
batches are dropped in both, so every optimizer step sees exactly the global batch. The baseline is also run with
--baseline-seeds data orders, to show how much the final loss moves with the data order alone (the noise floor).
--data-order shared removes that noise from the comparison: the Trainer reads one permutation in order and each
trahiv peer reads its share of each of the Trainer's batches (`shared_order`), so swarm and Trainer train on the same
samples step by step whenever every peer computes exactly its share.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
HELD_OUT = 8  # contiguous blocks at the end of the text, never trained on


# --- data -------------------------------------------------------------------------------------------------------


def split_blocks(workdir: Path, held_out: int = HELD_OUT) -> tuple[int, int]:
    """Write train.pt and eval.pt from blocks.pt: the last `held_out` contiguous blocks (and the half-shifted blocks
    overlapping them) are the evaluation set, the rest minus any block overlapping it the training set."""
    import torch

    from trahiv.demo import BLOCK_SIZE

    blocks = torch.load(workdir / "blocks.pt")
    contiguous = (len(blocks) + 1) // 2  # prepare_workdir: n contiguous blocks, then n-1 shifted by half a block
    shifted = blocks[contiguous:]
    assert len(shifted) == contiguous - 1 and torch.equal(shifted[0, : BLOCK_SIZE // 2], blocks[0, BLOCK_SIZE // 2 :])
    first_eval = contiguous - held_out
    # shifted block j covers [j + 1/2, j + 3/2) blocks of text: it overlaps the evaluation text iff j + 1 >= first_eval
    train = torch.cat([blocks[:first_eval], shifted[: first_eval - 1]])
    evaluation = torch.cat([blocks[first_eval:contiguous], shifted[first_eval:]])
    torch.save(train, workdir / "train.pt")
    torch.save(evaluation, workdir / "eval.pt")
    return len(train), len(evaluation)


def prepare_stdlib_workdir(
    workdir: Path, seed: int, train_blocks: int = 20_000, eval_blocks: int = 64
) -> tuple[int, int]:
    """A corpus that is not repeated: the demo's text gives 67 training blocks, so 100 steps of 8 samples are 12 epochs
    and the eval loss at the end measures overfitting more than training. This one is the Python standard library's
    own source (on every machine that runs this, nothing downloaded), files in sorted order: every 10th file is
    held out for evaluation (`eval_blocks` blocks taken evenly from them), the others give `train_blocks` blocks of
    BLOCK_SIZE tokens. Tokenizer (trained on the training files) and tiny GPT-2 as trahiv.demo's; writes model/,
    tokenizer/, train.pt, eval.pt."""
    import sysconfig

    import torch
    from transformers import GPT2LMHeadModel

    from trahiv.demo import BLOCK_SIZE, tiny_gpt2_config, train_tokenizer

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    held, trained = files[::10], [f for i, f in enumerate(files) if i % 10]
    train_text = "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in trained)
    eval_text = "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in held)
    tokenizer = train_tokenizer(train_text[:2_000_000])
    tokenizer.save_pretrained(workdir / "tokenizer")
    torch.manual_seed(seed)
    GPT2LMHeadModel(tiny_gpt2_config(vocab_size=len(tokenizer))).save_pretrained(workdir / "model")

    def blocks(text: str, limit: int) -> torch.Tensor:
        ids = tokenizer(text[: limit * BLOCK_SIZE * 8])["input_ids"]  # (a token is at most a few characters)
        usable = min(len(ids) // BLOCK_SIZE, limit) * BLOCK_SIZE
        return torch.tensor(ids[:usable], dtype=torch.long).view(-1, BLOCK_SIZE)

    train = blocks(train_text, train_blocks)
    evaluation = blocks(eval_text, 4_000)
    evaluation = evaluation[torch.linspace(0, len(evaluation) - 1, eval_blocks).long()]
    torch.save(train, workdir / "train.pt")
    torch.save(evaluation, workdir / "eval.pt")
    return len(train), len(evaluation)


def prepare_data(workdir: Path, corpus: str, seed: int) -> tuple:
    """--corpus demo (the demo's text, split_blocks) or stdlib (prepare_stdlib_workdir): (train, eval) block counts."""
    if corpus == "stdlib":
        return prepare_stdlib_workdir(workdir, seed=seed)
    from trahiv.demo import prepare_workdir

    prepare_workdir(workdir, seed=seed)
    return split_blocks(workdir)


def eval_loss(model, blocks) -> float:
    import torch

    was_training = model.training
    model.eval()
    with torch.no_grad():
        loss = float(model(input_ids=blocks, labels=blocks)["loss"])
    model.train(was_training)
    return loss


def training_arguments(cls, spec: dict, out: Path, batch: int, **extra: Any):
    return cls(
        output_dir=str(out / "output"), per_device_train_batch_size=batch, max_steps=spec["steps"],
        learning_rate=spec["lr"], optim="adamw_torch", lr_scheduler_type=spec["scheduler"],
        warmup_steps=spec["warmup"], weight_decay=0.0, max_grad_norm=spec["max_grad_norm"], dataloader_drop_last=True,
        logging_steps=10**6, report_to=[], disable_tqdm=True, use_cpu=True, save_strategy="no", seed=spec["seed"],
        **extra,
    )  # fmt: skip


def make_recorder(spec: dict, eval_blocks, get_swarm=None):
    """A callback that times training and evaluates the model at every optimizer (collaborative) step."""
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        def __init__(self) -> None:
            self.started = self.ended = 0.0
            self.curve: list[tuple[int, float, float]] = []  # (step, seconds, eval loss)
            self.local_steps = 0
            self.step_samples: dict[int, int] = {}  # collaborative step -> this peer's samples in it
            self.metrics: dict[str, Any] = {}
            self.last = 0
            self.lr: list[float] = []

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.started = time.monotonic()  # (after trahiv's wait for min_peers and its catch-up)
            self.last = state.global_step
            self.curve.append((state.global_step, 0.0, eval_loss(model, eval_blocks)))

        def on_step_end(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
            self.local_steps += 1
            self.step_samples[self.last] = self.step_samples.get(self.last, 0) + spec["local_batch"]
            if state.global_step > self.last:
                self.last = state.global_step
                if lr_scheduler is not None:
                    self.lr.append(lr_scheduler.get_last_lr()[0])
                if spec.get("curve", True):
                    seconds = time.monotonic() - self.started
                    self.curve.append((state.global_step, seconds, eval_loss(model, eval_blocks)))

        def on_train_end(self, args, state, control, **kwargs):
            self.ended = time.monotonic()
            if get_swarm is not None:  # before trahiv's Trainer shuts the swarm down
                self.metrics = get_swarm().metrics()

    return Recorder()


def seed_data_order_by_rank(spec: dict) -> None:
    """With spec["data_order"] == "rank", a peer shuffles its data with a seed from (--seed, its rank) instead of its
    random identity: runs of the same command then read the same samples, and a synchronous run (one local step per
    peer and step) and a DiLoCo run train on the same samples, so their eval losses compare pairwise."""
    if spec.get("data_order") != "rank":
        return
    from trahiv.swarm import Swarm

    fixed = 1_000_003 * spec["seed"] + spec["rank"]
    Swarm.peer_seed = lambda self, base_seed=0: fixed  # type: ignore[method-assign]


def sequential_if_shared(spec: dict) -> dict:
    return {"train_sampling_strategy": "sequential"} if spec.get("data_order") == "shared" else {}


def shared_order(train, spec: dict, rank: int | None = None):
    """With spec["data_order"] == "shared": the one Trainer (`rank` None) reads one permutation of the training
    blocks (seeded by spec["seed"]) in order, step k the blocks [G k, G (k + 1)) of it (G the global batch), and
    trahiv peer `rank` reads its share of each of those steps, [G k + S rank, G k + S (rank + 1)) with S = G / peers:
    when every peer computes its share of every collaborative step, the swarm's averaged gradient is the Trainer's
    (same samples; dropout draws differ), so the two eval losses compare without the data order's own spread.
    Otherwise `train` itself (each trahiv peer shuffles by its identity or, with "rank", by (seed, rank))."""
    if spec.get("data_order") != "shared":
        return train
    import torch

    width = spec["global_batch"]
    rows = 2 * spec["steps"] + 2  # (slack: a peer that computed more than its share reads on)
    generator = torch.Generator().manual_seed(spec["seed"])
    epochs = -(-rows * width // len(train))
    order = torch.cat([torch.randperm(len(train), generator=generator) for _ in range(epochs)])[: rows * width]
    if rank is None:
        indices = order[: spec["steps"] * width]
    else:
        share = width // spec["peers"]
        indices = order.view(rows, width)[:, rank * share : (rank + 1) * share].reshape(-1)
    return torch.utils.data.Subset(train, indices.tolist())


# --- the two kinds of worker (each its own process) ---------------------------------------------------------------


def peer_worker(spec: dict) -> dict:
    import torch
    import transformers

    from trahiv import Trainer, TrainingArguments
    from trahiv.demo import BlockDataset

    torch.set_num_threads(spec["threads"])
    if spec.get("debug"):  # trahiv's debug lines in the peer's log: shares, waits for the others' reports
        logging.getLogger("trahiv.swarm").setLevel(logging.DEBUG)
    if spec.get("no_progress_refresh"):  # A/B: without SwarmOptimizer's progress re-fetch near the target
        from trahiv.engine.optimizer import SwarmOptimizer

        SwarmOptimizer._refresh_progress_if_due = lambda self: None
    seed_data_order_by_rank(spec)
    workdir, out = Path(spec["workdir"]), Path(spec["out"])
    train, eval_blocks = BlockDataset.load(workdir / "train.pt"), torch.load(workdir / "eval.pt")
    train = shared_order(train, spec, spec["rank"])
    model = transformers.AutoModelForCausalLM.from_pretrained(workdir / "model")
    opt = {
        "run_id": spec["run_id"], "target_batch_size": spec["global_batch"], "min_peers": spec["peers"],
        "min_peers_timeout": spec["min_peers_timeout"], "matchmaking_time": spec["matchmaking_time"],
        "averaging_timeout": spec["averaging_timeout"], "grad_compression": spec["compression"],
        "state_averaging_compression": spec["state_compression"], "load_state_compression": spec["state_compression"],
        **spec["opt"],
    }  # fmt: skip
    dht = {"initial_peers": spec["initial_peers"], "host_maddrs": ["/ip4/127.0.0.1/tcp/0"], "nat_port_map": False}
    args = training_arguments(TrainingArguments, spec, out, spec["batch"], hivemind_config={"dht": dht, "opt": opt},
                              **sequential_if_shared(spec))  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=train)
    recorder = make_recorder({**spec, "local_batch": spec["batch"], "curve": spec["rank"] == 0}, eval_blocks,
                             lambda: trainer.swarm)  # fmt: skip
    trainer.add_callback(recorder)
    trainer.train()
    wall = recorder.ended - recorder.started
    return {
        "rank": spec["rank"], "eval_loss": eval_loss(trainer.model, eval_blocks), "wall_s": wall,
        "local_steps": recorder.local_steps, "collaborative_steps": trainer.state.global_step,
        "samples": trainer.swarm.optimizer.samples_contributed, "step_samples": recorder.step_samples,
        "metrics": recorder.metrics, "curve": recorder.curve, "lr": recorder.lr,
        "checksum": float(sum(p.detach().double().sum() for p in trainer.model.parameters())),
    }  # fmt: skip


def baseline_worker(spec: dict) -> dict:
    import torch
    import transformers

    from trahiv.demo import BlockDataset

    torch.set_num_threads(spec["threads"])
    workdir, out = Path(spec["workdir"]), Path(spec["out"])
    train, eval_blocks = BlockDataset.load(workdir / "train.pt"), torch.load(workdir / "eval.pt")
    train = shared_order(train, spec)
    model = transformers.AutoModelForCausalLM.from_pretrained(workdir / "model")
    global_batch = spec["global_batch"]
    args = training_arguments(transformers.TrainingArguments, spec, out, global_batch, **sequential_if_shared(spec))
    trainer = transformers.Trainer(model=model, args=args, train_dataset=train)
    recorder = make_recorder({**spec, "local_batch": global_batch}, eval_blocks)
    trainer.add_callback(recorder)
    trainer.train()
    if spec.get("save_model"):  # (benchmarks/diloco.py --warm-start: every run then starts from this model)
        trainer.save_model(spec["save_model"])
    return {
        "seed": spec["seed"], "eval_loss": eval_loss(trainer.model, eval_blocks),
        "wall_s": recorder.ended - recorder.started, "steps": trainer.state.global_step,
        "samples": trainer.state.global_step * global_batch, "curve": recorder.curve, "lr": recorder.lr,
    }  # fmt: skip


# --- the orchestrator -------------------------------------------------------------------------------------------


class Processes:
    """Every process this benchmark starts, each in its own session: stopped (with its children) on exit."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        atexit.register(self.stop_all)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.stop_all()
        sys.exit(128 + signum)

    def start(self, command: list[str], log: Path) -> subprocess.Popen:
        with open(log, "w") as f:
            proc = subprocess.Popen(command, env=ENV, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                    start_new_session=True)  # fmt: skip
        self.procs.append(proc)
        return proc

    @staticmethod
    def stop(proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)
        # its engine processes (DHT, p2pd, averagers) stay in its group and outlive a peer that failed and exited
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)

    def stop_all(self) -> None:
        for proc in self.procs:
            self.stop(proc)


def run_worker(procs: Processes, mode: str, spec: dict, folder: Path, timeout: float) -> subprocess.Popen:
    folder.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "out": str(folder)}
    (folder / "spec.json").write_text(json.dumps(spec))
    command = [sys.executable, __file__, f"--{mode}", str(folder / "spec.json")]
    return procs.start(command, folder / "log.txt")


def wait_result(proc: subprocess.Popen, folder: Path, deadline: float) -> dict:
    try:
        proc.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        Processes.stop(proc)
        log = (folder / "log.txt").read_text()[-3000:]
        raise RuntimeError(f"{folder.name} did not finish in time:\n{log}") from None
    result = folder / "result.json"
    if proc.returncode != 0 or not result.exists():
        raise RuntimeError(f"{folder.name} exited with {proc.returncode}:\n{(folder / 'log.txt').read_text()[-3000:]}")
    return json.loads(result.read_text())


def start_bootstrap(procs: Processes, tmp: Path, timeout: float = 60) -> list[str]:
    addresses = tmp / "bootstrap.json"
    command = [sys.executable, "-m", "trahiv.cli.main", "dht", "--no-nat-port-map", "--addresses-file", str(addresses),
               "--host-maddrs", "/ip4/127.0.0.1/tcp/0"]  # fmt: skip
    proc = procs.start(command, tmp / "bootstrap.log")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the bootstrap peer exited:\n{(tmp / 'bootstrap.log').read_text()[-3000:]}")
        with contextlib.suppress(ValueError, OSError):
            if addresses.exists() and addresses.stat().st_size and (peers := json.loads(addresses.read_text())):
                return peers
        time.sleep(0.2)
    raise RuntimeError(f"the bootstrap peer did not start in {timeout} s")


def summarize_swarm(results: list[dict], target: int) -> dict:
    by_step: dict[int, list[int]] = {}
    for result in results:
        for step, samples in result["step_samples"].items():
            by_step.setdefault(int(step), []).append(samples)
    steps = sorted(by_step)
    totals = [sum(by_step[s]) for s in steps]
    wall = max(r["wall_s"] for r in results)
    losses = [r["eval_loss"] for r in results]
    rounds = {k: [r["metrics"].get(f"averaging_rounds_{k}", 0) for r in results] for k in ("complete", "partial",
                                                                                          "failed")}  # fmt: skip
    return {
        "eval_loss": results[0]["eval_loss"],
        "eval_loss_per_peer": [round(x, 5) for x in losses],
        "peers_identical": len({round(r["checksum"], 3) for r in results}) == 1,
        "wall_s": round(wall, 2),
        "samples": sum(r["samples"] for r in results),
        "samples_per_s": round(sum(r["samples"] for r in results) / wall, 2),
        "collaborative_steps": [r["collaborative_steps"] for r in results],
        "local_steps_per_peer": [r["local_steps"] for r in results],
        "samples_per_collaborative_step": totals,
        "steps_not_at_target": sum(t != target for t in totals),
        "averaging_rounds_per_peer": rounds,
        "ring_rounds_per_peer": [r["metrics"].get("averaging_rounds_ring", 0) for r in results],  # of the complete
        "lr_first_last": [results[0]["lr"][:3], results[0]["lr"][-2:]],
        "curve": [[s, round(t, 2), round(loss, 5)] for s, t, loss in results[0]["curve"]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2, help="samples per local step and peer")
    parser.add_argument(
        "--local-steps",
        type=int,
        default=4,
        help="local steps of each peer per collaborative step: global batch = peers x batch x this",
    )
    parser.add_argument("--steps", type=int, default=30, help="optimizer (collaborative) steps")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=4, help="warm-up steps of the LR schedule")
    parser.add_argument("--scheduler", default="linear")
    parser.add_argument(
        "--max-grad-norm",
        type=float,
        default=0.0,
        help="gradient clipping (0: off; trahiv clips each peer's local gradient, not the average)",
    )
    parser.add_argument(
        "--compression",
        default="none",
        help="grad/state compression of the peers: none, fp16, size_adaptive, uniform8bit, ...",
    )
    parser.add_argument(
        "--state-compression",
        help="compression of averaged parameters and optimizer state, and of downloaded state (default: --compression)",
    )
    parser.add_argument("--matchmaking-time", type=float, default=2.0)
    parser.add_argument("--averaging-timeout", type=float, default=30.0)
    parser.add_argument("--opt", default="{}", help='extra hivemind_config["opt"] entries for the peers (JSON)')
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corpus", choices=["demo", "stdlib"], default="demo", help="see prepare_stdlib_workdir")
    parser.add_argument("--baseline-seeds", type=int, default=3, help="baseline runs with data orders seed, seed+1...")
    parser.add_argument(
        "--data-order",
        choices=["identity", "rank", "shared"],
        default="identity",
        help="identity: each peer shuffles by its random identity (trahiv's default); rank: by (seed, rank); shared: "
        "the Trainer's order of --seed split into the peers' shares of each step (see shared_order)",
    )
    parser.add_argument("--timeout", type=float, default=540, help="seconds for the whole swarm run")
    parser.add_argument("--output", help="also write the JSON there")
    parser.add_argument("--keep", help="work in this folder and keep it (logs of every process), not a temporary one")
    parser.add_argument("--debug", action="store_true", help="peers log trahiv's debug lines (with --keep)")
    parser.add_argument("--no-progress-refresh", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--baseline", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for mode, function in (("worker", peer_worker), ("baseline", baseline_worker)):
        if getattr(args, mode):
            spec = json.loads(Path(getattr(args, mode)).read_text())
            result = function(spec)
            (Path(spec["out"]) / "result.json").write_text(json.dumps(result))
            return

    load_before = os.getloadavg()
    procs = Processes()
    cores = os.cpu_count() or 1
    keep = contextlib.nullcontext(args.keep) if args.keep else None
    with keep or tempfile.TemporaryDirectory(prefix="trahiv-convergence-") as tmp_name:
        tmp = Path(tmp_name)
        n_train, n_eval = prepare_data(tmp / "work", args.corpus, args.seed)
        spec = {
            "workdir": str(tmp / "work"), "peers": args.peers, "batch": args.batch, "steps": args.steps,
            "lr": args.lr, "warmup": args.warmup, "scheduler": args.scheduler, "max_grad_norm": args.max_grad_norm,
            "seed": args.seed, "global_batch": args.peers * args.batch * args.local_steps,
            "data_order": args.data_order,
        }  # fmt: skip

        baselines = []
        for offset in range(args.baseline_seeds):
            folder = tmp / f"baseline{offset}"
            proc = run_worker(procs, "baseline", {**spec, "seed": args.seed + offset, "threads": cores}, folder, 0)
            baselines.append(wait_result(proc, folder, time.monotonic() + args.timeout))
        load_mid = os.getloadavg()

        initial_peers = start_bootstrap(procs, tmp)
        peer_spec = {
            **spec, "initial_peers": initial_peers, "run_id": f"convergence{os.getpid()}",
            "compression": args.compression, "matchmaking_time": args.matchmaking_time,
            "state_compression": args.state_compression or args.compression,
            "averaging_timeout": args.averaging_timeout, "min_peers_timeout": 120.0, "opt": json.loads(args.opt),
            "threads": max(1, cores // args.peers), "no_progress_refresh": args.no_progress_refresh,
            "debug": args.debug,
        }  # fmt: skip
        started = time.monotonic()
        peers = [
            (run_worker(procs, "worker", {**peer_spec, "rank": rank}, tmp / f"peer{rank}", 0), tmp / f"peer{rank}")
            for rank in range(args.peers)
        ]
        deadline = started + args.timeout
        results = [wait_result(proc, folder, deadline) for proc, folder in peers]
        total_wall = time.monotonic() - started
        load_after = os.getloadavg()
        procs.stop_all()

        # the same number of samples as the swarm really used: hivemind's target_batch_size is a minimum, and peers
        # keep computing until they see that the swarm reached it (see the README)
        swarm_samples = sum(r["samples"] for r in results)
        matched_batch = max(1, round(swarm_samples / args.steps))
        matched = []
        runs = args.baseline_seeds if spec["global_batch"] != matched_batch <= n_train else 0  # (drop_last)
        for offset in range(runs):
            folder = tmp / f"matched{offset}"
            matched_spec = {**spec, "seed": args.seed + offset, "threads": cores, "global_batch": matched_batch}
            proc = run_worker(procs, "baseline", matched_spec, folder, 0)
            matched.append(wait_result(proc, folder, time.monotonic() + args.timeout))

    swarm = summarize_swarm(results, spec["global_batch"])
    base = baselines[0]
    base_losses = [b["eval_loss"] for b in baselines]
    rel = swarm["eval_loss"] / base["eval_loss"] - 1
    report = {
        "benchmark": "convergence",
        "command": " ".join([".venv/bin/python", "benchmarks/convergence.py", *sys.argv[1:]]),
        "model": "demo tiny GPT-2 (2 layers x 128, vocab 512, 0.47M params), blocks of 64 tokens",
        "corpus": args.corpus, "train_blocks": n_train, "eval_blocks": n_eval, "data_order": args.data_order,
        "peers": args.peers, "batch_per_peer": args.batch, "local_steps_per_collaborative_step": args.local_steps,
        "global_batch": spec["global_batch"],
        "steps": args.steps, "optimizer": "adamw_torch", "lr": args.lr, "scheduler": args.scheduler,
        "warmup_steps": args.warmup, "max_grad_norm": args.max_grad_norm, "compression": args.compression,
        "state_compression": args.state_compression or args.compression,
        "matchmaking_time": args.matchmaking_time,
        "eval_loss_initial": round(base["curve"][0][2], 5),
        "eval_loss_transformers": round(base["eval_loss"], 5),
        "eval_loss_trahiv": round(swarm["eval_loss"], 5),
        "relative_difference_percent": round(100 * rel, 2),
        "target_percent": 2.0,
        "target_met": abs(rel) <= 0.02,
        "transformers_data_order_spread": {
            "eval_losses": [round(x, 5) for x in base_losses],
            "max_relative_difference_percent": round(100 * (max(base_losses) / min(base_losses) - 1), 2),
        },
        "transformers_same_samples": {
            "global_batch": matched_batch,
            "eval_losses": [round(m["eval_loss"], 5) for m in matched],
            "relative_difference_percent": round(100 * (swarm["eval_loss"] / matched[0]["eval_loss"] - 1), 2)
            if matched
            else None,
        },
        "transformers": {"wall_s": round(base["wall_s"], 2), "samples": base["samples"],
                         "samples_per_s": round(base["samples"] / base["wall_s"], 2), "threads": cores,
                         "lr_first_last": [base["lr"][:3], base["lr"][-2:]],
                         "curve": [[s, round(t, 2), round(x, 5)] for s, t, x in base["curve"]]},  # fmt: skip
        "trahiv": {**swarm, "wall_s_including_startup": round(total_wall, 2), "threads_per_peer": peer_spec["threads"]},
        "cpu_cores": cores,
        "load_average_1_5_15": {"start": load_before, "after_baseline": load_mid, "end": load_after},
    }  # fmt: skip
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")


if __name__ == "__main__":
    main()
