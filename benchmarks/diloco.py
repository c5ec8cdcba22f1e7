"""DiLoCo vs synchronous trahiv, a tiny reproduction of DiLoCo's comparison (Douillard et al. 2023) on one machine.

At equal inner steps (--steps) and per-peer batch (--batch), on the demo's tiny GPT-2 from the same initial weights:
  (a) one worker: plain transformers.Trainer, batch B, --steps steps;
  (b) synchronous trahiv, N peers, one local step of B per collaborative step (global batch N x B), --steps steps;
  (c) DiLoCo, N peers, batch B each, --steps inner steps, for each H in --inner-steps;
  (d) DiLoCo with 8-bit pseudo-gradients (--quantized, default uniform8bit), at the first H;
  (e) DiLoCo at the first H with one peer killed (SIGKILL) once the swarm passed a third of the outer steps;
  (f) one worker at the swarm's global batch N x B (plain transformers.Trainer, deterministic): in exact arithmetic
      the update (b) makes (the sample-weighted mean of the peers' gradients is the gradient of their samples
      together), on other samples in another order, with other dropout draws.
Each reports the eval loss on held-out blocks (the convergence benchmark's split) and the bytes each peer's averagers
sent and received (`averaging_bytes_sent` / `_received`, cumulative). Prints JSON (and writes it with --output).

Targets (issue "Train over home Internet links"): (c) within 2% of (b)'s eval loss; at H=50, at least 50x fewer bytes
than (b). Compute utilization over shaped links is measured by benchmarks/compute_utilization.py, not here.

Data (--corpus): `demo` is the demo's text, 67 training blocks: 100 steps of 4 x 2 samples read each block 12 times,
and the eval loss at the end measures overfitting as much as training (the synchronous run, which overshoots its
target batch, overfits most). `stdlib` is the Python standard library's own source (no download): 20,000 training
blocks, none read twice, held-out files for evaluation; DiLoCo's paper trained on C4 without repetition.
--data-order rank (the default) seeds each peer's data order by (--seed, its rank): every run, (b) and (c) alike (one
local step of B per peer and step), reads the same samples (their losses still move by a fraction of a percent
between runs: a float's difference in an average grows over the steps); identity shuffles by the peers' random
identities, as trahiv does. --outer-lr / --outer-momentum set DiLoCo's outer step (0.7 and Nesterov 0.9, the paper's);
--warm-start N first trains one worker N steps of N x B and starts every run from that model, as the paper started
from a pretrained model.

Run (small defaults, a few minutes on 2 cores):
    .venv/bin/python benchmarks/diloco.py --corpus stdlib --output benchmarks/results/diloco_4peers_stdlib.json
    .venv/bin/python benchmarks/diloco.py --corpus stdlib --steps 300 --skip d e   # a longer comparison
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import convergence  # noqa: E402  (benchmarks/convergence.py: data split, process handling, the two baselines)


def diloco_worker(spec: dict) -> dict:
    """One DiLoCo peer: an unchanged Trainer script with hivemind_config["diloco"]."""
    import torch
    import transformers
    from transformers import TrainerCallback

    from trahiv import Trainer, TrainingArguments
    from trahiv.demo import BlockDataset

    torch.set_num_threads(spec["threads"])
    convergence.seed_data_order_by_rank(spec)
    workdir, out = Path(spec["workdir"]), Path(spec["out"])
    train, eval_blocks = BlockDataset.load(workdir / "train.pt"), torch.load(workdir / "eval.pt")
    model = transformers.AutoModelForCausalLM.from_pretrained(workdir / "model")
    opt = {"run_id": spec["run_id"], "target_batch_size": 1, "min_peers": spec["peers"], "min_peers_timeout": 120.0,
           "matchmaking_time": spec["matchmaking_time"], "averaging_timeout": spec["averaging_timeout"]}  # fmt: skip
    dht = {"initial_peers": spec["initial_peers"], "host_maddrs": ["/ip4/127.0.0.1/tcp/0"], "nat_port_map": False}
    diloco = {"inner_steps": spec["inner_steps"], "compression": spec["compression"], "overlap": spec["overlap"],
              "fragments": spec.get("fragments", 1), "outer_lr": spec["outer_lr"],
              "outer_momentum": spec["outer_momentum"], "nesterov": spec["outer_momentum"] > 0}  # fmt: skip
    config = {"dht": dht, "opt": opt, "diloco": diloco}
    args = convergence.training_arguments(TrainingArguments, spec, out, spec["batch"], hivemind_config=config)
    trainer = Trainer(model=model, args=args, train_dataset=train)

    class Progress(TrainerCallback):  # the orchestrator reads the outer step (to kill a peer mid-run)
        started = 0.0

        def on_train_begin(self, args, state, control, **kwargs):
            self.started = time.monotonic()

        def on_step_end(self, args, state, control, **kwargs):
            (out / "outer_step").write_text(str(trainer.swarm.diloco.outer_step))

    progress = Progress()
    trainer.add_callback(progress)
    trainer.train()
    diloco_opt = trainer.swarm.diloco
    return {
        "rank": spec["rank"], "eval_loss": convergence.eval_loss(trainer.model, eval_blocks),
        "wall_s": time.monotonic() - progress.started, "global_step": trainer.state.global_step,
        "outer_step": diloco_opt.outer_step, "syncs": diloco_opt.syncs, "metrics": diloco_opt.metrics(),
    }  # fmt: skip


def run_diloco(procs: Any, tmp: Path, name: str, spec: dict, inner_steps: int, compression: str, kill: bool) -> dict:
    """N DiLoCo peers; with `kill`, the last one is SIGKILLed once the first passed a third of the outer steps."""
    (tmp / name).mkdir()
    initial_peers = convergence.start_bootstrap(procs, tmp / name)
    peer_spec = {**spec, "initial_peers": initial_peers, "run_id": f"diloco{os.getpid()}{name}",
                 "inner_steps": inner_steps, "compression": compression}  # fmt: skip
    started = time.monotonic()
    peers = []
    for rank in range(spec["peers"]):
        folder = tmp / name / f"peer{rank}"
        folder.mkdir(parents=True)
        (folder / "spec.json").write_text(json.dumps({**peer_spec, "rank": rank, "out": str(folder)}))
        command = [sys.executable, __file__, "--diloco-worker", str(folder / "spec.json")]
        peers.append((procs.start(command, folder / "log.txt"), folder))
    deadline = started + spec["timeout"]
    killed_at = None
    if kill:
        victim, watch = peers[-1][0], peers[0][1] / "outer_step"
        target = max(1, spec["steps"] // inner_steps // 3)
        while time.monotonic() < deadline and killed_at is None:
            with contextlib.suppress(ValueError, OSError):
                if watch.exists() and int(watch.read_text() or 0) >= target:
                    victim.kill()
                    killed_at = target
            time.sleep(0.2)
    survivors = peers[:-1] if killed_at is not None else peers
    results = [convergence.wait_result(proc, folder, deadline) for proc, folder in survivors]
    procs.stop_all()
    return summarize(results, time.monotonic() - started, {"killed_at_outer_step": killed_at} if kill else {})


def summarize(results: list[dict], wall: float, extra: dict) -> dict:
    sent = [r["metrics"].get("averaging_bytes_sent", 0) for r in results]
    received = [r["metrics"].get("averaging_bytes_received", 0) for r in results]
    rounds = {k: [r["metrics"].get(f"averaging_rounds_{k}", 0) for r in results] for k in ("complete", "partial",
                                                                                          "failed")}  # fmt: skip
    return {
        "eval_loss": round(sum(r["eval_loss"] for r in results) / len(results), 5),
        "eval_loss_per_peer": [round(r["eval_loss"], 5) for r in results],
        "bytes_sent_per_peer": round(sum(sent) / len(sent)),
        "bytes_received_per_peer": round(sum(received) / len(received)),
        "averaging_rounds_per_peer": rounds,
        "wall_s_including_startup": round(wall, 2),
        **({"syncs": [r["syncs"] for r in results]} if "syncs" in results[0] else {}),
        # (with fragments a sync carries one fragment: the peak a link must carry at once drops that many fold)
        **(
            {
                "bytes_sent_per_sync_per_peer": round(
                    sum(sent) / len(sent) / max(1, sum(r["outer_step"] for r in results) / len(results))
                )
            }
            if "outer_step" in results[0]
            else {}
        ),
        **extra,
    }


def run_synchronous(procs: Any, tmp: Path, spec: dict) -> dict:
    """(b): convergence.py's trahiv peers, one local step per collaborative step."""
    folder = tmp / "synchronous"
    folder.mkdir()
    initial_peers = convergence.start_bootstrap(procs, folder)
    peer_spec = {**spec, "initial_peers": initial_peers, "run_id": f"sync{os.getpid()}", "compression": "none",
                 "state_compression": "none", "min_peers_timeout": 120.0, "opt": {}, "no_progress_refresh": False,
                 "global_batch": spec["peers"] * spec["batch"]}  # fmt: skip
    started = time.monotonic()
    peers = [(convergence.run_worker(procs, "worker", {**peer_spec, "rank": r}, folder / f"peer{r}", 0),
              folder / f"peer{r}") for r in range(spec["peers"])]  # fmt: skip
    results = [convergence.wait_result(proc, f, started + spec["timeout"]) for proc, f in peers]
    procs.stop_all()
    summary = summarize(results, time.monotonic() - started, {})
    summary["samples"] = sum(r["samples"] for r in results)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2, help="samples per inner (local) step and peer")
    parser.add_argument("--steps", type=int, default=100, help="inner steps (and synchronous steps)")
    parser.add_argument("--inner-steps", type=int, nargs="+", default=[10, 50], help="H values for (c)")
    parser.add_argument("--quantized", default="uniform8bit", help="the 8-bit compression of (d)")
    parser.add_argument("--compression", default="fp16", help="pseudo-gradient compression of (c) and (e)")
    parser.add_argument("--lr", type=float, default=3e-3, help="inner AdamW learning rate (and (a), (b)'s)")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--scheduler", default="linear")
    parser.add_argument("--matchmaking-time", type=float, default=2.0)
    parser.add_argument("--averaging-timeout", type=float, default=30.0)
    parser.add_argument("--overlap", action="store_true", help="DiLoCo runs sync in the background (`overlap`)")
    parser.add_argument("--fragments", type=int, default=1, help="streaming DiLoCo: fragments synced in turn")
    parser.add_argument(
        "--corpus",
        choices=["demo", "stdlib"],
        default="demo",
        help="demo: 67 training blocks (repeated); stdlib: 20,000 (never repeated)",
    )
    parser.add_argument("--warm-start", type=int, default=0, help="first train N x B for this many steps, alone")
    parser.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo's outer SGD learning rate")
    parser.add_argument("--outer-momentum", type=float, default=0.9, help="outer Nesterov momentum (0: plain SGD)")
    parser.add_argument(
        "--skip", nargs="*", default=[], choices=["a", "b", "c", "d", "e", "f"], help="configs not to run"
    )
    parser.add_argument("--seed", type=int, default=0, help="initial weights, (a)'s data order, with --data-order rank")
    parser.add_argument(
        "--data-order",
        choices=["rank", "identity"],
        default="rank",
        help="rank: each peer's order seeded by (--seed, rank), the same in every run and mode; identity: by the "
        "peer's random identity, as trahiv does",
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds for each swarm run")
    parser.add_argument("--output", help="also write the JSON there")
    parser.add_argument("--keep", help="work in this folder and keep it (logs of every process)")
    parser.add_argument("--diloco-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.diloco_worker:
        spec = json.loads(Path(args.diloco_worker).read_text())
        (Path(spec["out"]) / "result.json").write_text(json.dumps(diloco_worker(spec)))
        return

    procs = convergence.Processes()
    cores = os.cpu_count() or 1
    load_before = os.getloadavg()
    keep = contextlib.nullcontext(args.keep) if args.keep else None
    report: dict[str, Any] = {"benchmark": "diloco", "command": " ".join(["benchmarks/diloco.py", *sys.argv[1:]])}
    with keep or tempfile.TemporaryDirectory(prefix="trahiv-diloco-") as tmp_name:
        tmp = Path(tmp_name)
        data = convergence.prepare_data(tmp / "work", args.corpus, args.seed)
        spec = {"workdir": str(tmp / "work"), "peers": args.peers, "batch": args.batch, "steps": args.steps,
                "lr": args.lr, "warmup": args.warmup, "scheduler": args.scheduler, "max_grad_norm": 0.0,
                "seed": args.seed, "matchmaking_time": args.matchmaking_time, "timeout": args.timeout,
                "averaging_timeout": args.averaging_timeout, "threads": max(1, cores // args.peers),
                "overlap": args.overlap, "fragments": args.fragments, "outer_lr": args.outer_lr,
                "outer_momentum": args.outer_momentum, "data_order": args.data_order}  # fmt: skip
        runs: dict[str, Any] = {}
        if args.warm_start:  # DiLoCo's paper started its runs from a model pretrained by one worker (24k steps)
            folder = tmp / "warm_start"
            warm = {**spec, "steps": args.warm_start, "global_batch": args.peers * args.batch, "threads": cores,
                    "save_model": str(tmp / "work" / "model")}  # fmt: skip
            proc = convergence.run_worker(procs, "baseline", warm, folder, 0)
            warmed = convergence.wait_result(proc, folder, time.monotonic() + args.timeout)
            runs["warm_start"] = {"steps": args.warm_start, "batch": warm["global_batch"],
                                  "eval_loss": round(warmed["eval_loss"], 5)}  # fmt: skip
        if "a" not in args.skip:
            folder = tmp / "one_worker"
            proc = convergence.run_worker(procs, "baseline", {**spec, "global_batch": args.batch, "threads": cores},
                                          folder, 0)  # fmt: skip
            one = convergence.wait_result(proc, folder, time.monotonic() + args.timeout)
            runs["a_one_worker"] = {"eval_loss": round(one["eval_loss"], 5), "wall_s": round(one["wall_s"], 2)}
        if "b" not in args.skip:
            runs["b_synchronous"] = run_synchronous(procs, tmp, spec)
        if "f" not in args.skip:
            folder = tmp / "one_worker_global_batch"
            batch = {**spec, "global_batch": args.peers * args.batch, "threads": cores, "curve": False}
            proc = convergence.run_worker(procs, "baseline", batch, folder, 0)
            one = convergence.wait_result(proc, folder, time.monotonic() + args.timeout)
            runs["f_one_worker_global_batch"] = {
                "eval_loss": round(one["eval_loss"], 5), "wall_s": round(one["wall_s"], 2), "samples": one["samples"]
            }  # fmt: skip
        first = args.inner_steps[0]
        for h in args.inner_steps if "c" not in args.skip else []:
            runs[f"c_diloco_H{h}"] = run_diloco(procs, tmp, f"H{h}", spec, h, args.compression, kill=False)
        if "d" not in args.skip:
            runs[f"d_diloco_H{first}_{args.quantized}"] = run_diloco(procs, tmp, "8bit", spec, first, args.quantized,
                                                                     kill=False)  # fmt: skip
        if "e" not in args.skip:
            runs[f"e_diloco_H{first}_one_killed"] = run_diloco(procs, tmp, "killed", spec, first, args.compression,
                                                               kill=True)  # fmt: skip
    sync = runs.get("b_synchronous")
    for name, run in runs.items():
        if sync is not None and name.startswith(("c_", "d_", "e_", "f_")):
            run["eval_loss_vs_synchronous_percent"] = round(100 * (run["eval_loss"] / sync["eval_loss"] - 1), 2)
            if "bytes_sent_per_peer" in run:
                ratio = sync["bytes_sent_per_peer"] / max(run["bytes_sent_per_peer"], 1)
                run["bytes_sent_reduction_vs_synchronous"] = round(ratio, 1)
    report.update({
        "model": "demo tiny GPT-2, blocks of 64 tokens", "peers": args.peers, "batch_per_peer": args.batch,
        "inner_steps_total": args.steps, "inner_optimizer": "adamw_torch", "lr": args.lr,
        "compression": args.compression, "overlap": args.overlap, "fragments": args.fragments,
        "outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum, "warm_start_steps": args.warm_start,
        "seed": args.seed, "data_order": args.data_order, "corpus": args.corpus, "train_eval_blocks": data,
        "runs": runs, "cpu_cores": cores, "load_average_1_5_15": {"start": load_before, "end": os.getloadavg()},
    })  # fmt: skip
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")


if __name__ == "__main__":
    main()
