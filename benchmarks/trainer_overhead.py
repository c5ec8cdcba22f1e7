"""Time per local step: one trahiv peer (alone in its swarm) against plain transformers.Trainer, same model and data.

Prints JSON. Run: .venv/bin/python benchmarks/trainer_overhead.py [--steps 60] [--repeats 2]
Each configuration runs in a fresh process, alternating, so both see the same machine state.
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

    class Clock(transformers.TrainerCallback):
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
    return {"mode": mode, "local_steps": len(times), "median_s": statistics.median(intervals),
            "mean_s": statistics.mean(intervals)}  # fmt: skip


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
    results: dict[str, list[float]] = {"transformers": [], "trahiv": []}
    for _ in range(args.repeats):
        for mode in results:
            cmd = [sys.executable, __file__, "--mode", mode, "--steps", str(args.steps)]
            out = subprocess.run(cmd, env=ENV, capture_output=True, text=True, check=True).stdout
            results[mode].append(json.loads(out.strip().splitlines()[-1])["median_s"])
    base, ours = statistics.median(results["transformers"]), statistics.median(results["trahiv"])
    print(json.dumps({
        "benchmark": "trainer_overhead", "model": "GPT-2 6x512, vocab 8192 (~25M params)", "batch": "8 x 128 tokens",
        "cpu_cores": os.cpu_count(), "transformers_s_per_step": round(base, 4), "trahiv_s_per_step": round(ours, 4),
        "overhead_percent": round(100 * (ours / base - 1), 1), "runs": results, "target_percent": 5,
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
