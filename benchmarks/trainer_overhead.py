"""Time per local step: one trahiv peer (alone in its swarm) against plain transformers.Trainer, same model and data.

Prints JSON. Run: .venv/bin/python benchmarks/trainer_overhead.py [--steps 64] [--repeats 2]
Each configuration runs in a fresh process, alternating, so both see the same machine state. The median local step
leaves out trahiv's collaborative steps (one in 8 local steps: the optimizer's update, which the Trainer makes at every
step); the mean counts them, and is the cost of training.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def run_one(mode: str, steps: int, workdir: Path) -> dict:
    import torch
    import transformers

    import trahiv

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=6, n_embd=512, n_head=8, vocab_size=8192, n_positions=128)
    model = transformers.GPT2LMHeadModel(config)
    data = torch.randint(0, 8192, (4096, 128))
    dataset = [{"input_ids": row, "labels": row} for row in data]
    times: list[float] = []
    in_step: list[float] = []  # seconds in optimizer.step() (trahiv: the local step's accumulation, or the swarm step)

    class Clock(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            in_step.append(-time.perf_counter())

        def on_optimizer_step(self, args, state, control, **kwargs):
            in_step[-1] += time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter())

    common = dict(
        output_dir=str(workdir / mode), per_device_train_batch_size=8, max_steps=steps, learning_rate=1e-4,
        report_to=[], save_strategy="no", disable_tqdm=True, use_cpu=True, logging_steps=10**6, seed=0,
    )  # fmt: skip
    if mode == "transformers":
        args = transformers.TrainingArguments(**common)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset)
    else:
        # one collaborative step every 8 local steps; max_steps counts collaborative steps
        common["max_steps"] = steps // 8
        hivemind_config = {"dht": {"nat_port_map": False}, "opt": {"run_id": "overhead", "target_batch_size": 64}}
        args = trahiv.TrainingArguments(**common, hivemind_config=hivemind_config)
        trainer = trahiv.Trainer(model=model, args=args, train_dataset=dataset)
    trainer.add_callback(Clock())
    trainer.train()
    intervals = [b - a for a, b in zip(times, times[1:], strict=False)][5:]  # skip warm-up steps
    steps_in = in_step[6:]  # the same steps as `intervals`
    return {"mode": mode, "local_steps": len(times), "median_s": statistics.median(intervals),
            "mean_s": statistics.mean(intervals), "optimizer_step_mean_s": statistics.mean(steps_in),
            "optimizer_step_median_s": statistics.median(steps_in)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=64, help="local steps per run (a multiple of 8)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--mode", choices=["transformers", "trahiv"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(run_one(args.mode, args.steps, Path(tmp))))
        return
    load_before = os.getloadavg()
    results: dict[str, list[float]] = {"transformers": [], "trahiv": []}
    means: dict[str, list[float]] = {"transformers": [], "trahiv": []}
    in_step: dict[str, list[list[float]]] = {"transformers": [], "trahiv": []}  # [mean, median, steps] per run
    for _ in range(args.repeats):
        for mode in results:
            cmd = [sys.executable, __file__, "--mode", mode, "--steps", str(args.steps)]
            out = subprocess.run(cmd, env=ENV, capture_output=True, text=True, check=True).stdout
            run = json.loads(out.strip().splitlines()[-1])
            results[mode].append(run["median_s"])
            means[mode].append(run["mean_s"])
            in_step[mode].append(
                [round(run["optimizer_step_mean_s"], 4), round(run["optimizer_step_median_s"], 4), run["local_steps"]]
            )
    base, ours = statistics.median(results["transformers"]), statistics.median(results["trahiv"])
    base_mean, ours_mean = statistics.median(means["transformers"]), statistics.median(means["trahiv"])
    print(json.dumps({
        "benchmark": "trainer_overhead", "model": "GPT-2 6x512, vocab 8192 (~25M params)", "batch": "8 x 128 tokens",
        "cpu_cores": os.cpu_count(), "transformers_s_per_step": round(base, 4), "trahiv_s_per_step": round(ours, 4),
        "overhead_percent": round(100 * (ours / base - 1), 1), "runs": results,
        "transformers_mean_s_per_step": round(base_mean, 4), "trahiv_mean_s_per_step": round(ours_mean, 4),
        "overhead_percent_of_means": round(100 * (ours_mean / base_mean - 1), 1), "mean_runs": means,
        "optimizer_step_s_mean_median_steps": in_step,
        "target_percent": 5, "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "command": "python benchmarks/trainer_overhead.py " + " ".join(sys.argv[1:]),
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
