"""By-hand check (issue 12, item 1): transformers' own `examples/pytorch/language-modeling/run_clm.py`, with only its
`Trainer`/`TrainingArguments` import switched to trahiv's, run as 2 peers on 127.0.0.1 (a `trahiv dht` bootstrap
peer, a tiny GPT-2 from a config, the demo's tokenizer and text, block 32, batch 4, target_batch_size 16, min_peers 2,
--max_steps 8) ends with identical weights on both peers.

Not a pytest test and not needed by CI: run_clm.py is not shipped with trahiv (nor with the transformers wheel), so
its path is an argument. Nothing is downloaded at run time (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE).

    PYTHONPATH=$PWD python scripts/run_clm_check.py /path/to/run_clm.py --runs 5

Prints one JSON line per run (max |w0-w1|, each peer's final step, averaging rounds, steps taken alone) and a summary
line. Every wait is bounded; only the processes this script started (and their children) are stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from swarm_helpers import ENV, alive, process_tree, start_bootstrap, stop  # noqa: E402

__all__ = ["main", "patch_run_clm"]

TRAHIV_IMPORT = "from trahiv import Trainer, TrainingArguments"
SOLO = "Skipped averaging: there are no other peers"
LOCAL_GRADS = "Proceeding with local gradients"


def patch_run_clm(source: str) -> tuple[str, list[str]]:
    """Switch only the Trainer/TrainingArguments import: drop the two names from `from transformers import (...)` and
    import them from trahiv right after that block. Returns the new text and the changes as diff-like lines."""
    lines = source.splitlines(keepends=True)
    start = [i for i, line in enumerate(lines) if line.rstrip() == "from transformers import ("]
    if len(start) != 1:
        raise ValueError(f"expected one 'from transformers import (' block, found {len(start)}")
    end = next(i for i in range(start[0], len(lines)) if lines[i].rstrip() == ")")
    names = {"    Trainer,", "    TrainingArguments,"}
    dropped = [i for i in range(start[0], end) if lines[i].rstrip() in names]
    if len(dropped) != 2:
        raise ValueError(f"expected Trainer and TrainingArguments in the import block, found {len(dropped)} of them")
    changes = [f"-{i + 1}: {lines[i].rstrip()}" for i in dropped] + [f"+{end + 1}: {TRAHIV_IMPORT}"]
    patched = lines[: end + 1] + [TRAHIV_IMPORT + "\n"] + lines[end + 1 :]
    for i in reversed(dropped):
        del patched[i]
    return "".join(patched), changes


def prepare(work: Path, run_clm: Path) -> tuple[Path, list[str]]:
    """The patched script, the demo's tokenizer (trained on the shipped text) and that text as train.txt."""
    from trahiv.demo import corpus_text, train_tokenizer

    script, changes = patch_run_clm(run_clm.read_text(encoding="utf-8"))
    (work / "run_clm_trahiv.py").write_text(script, encoding="utf-8")
    train_tokenizer(corpus_text()).save_pretrained(work / "tokenizer")
    (work / "train.txt").write_text(corpus_text(), encoding="utf-8")
    return work / "run_clm_trahiv.py", changes


def peer_command(work: Path, script: Path, out: Path, initial_peers: list[str], args: argparse.Namespace) -> list[str]:
    hivemind_config = {
        "dht": {"initial_peers": initial_peers, "nat_port_map": False, "client_mode": False},
        "opt": {"run_id": f"clm_{out.parent.name}", "target_batch_size": 16, "min_peers": 2, "verbose": True},
    }
    overrides = "n_layer=2,n_embd=64,n_head=2,n_positions=64,vocab_size=512,bos_token_id=0,eos_token_id=0"
    return [
        sys.executable, str(script), "--model_type", "gpt2", "--config_overrides", overrides,
        "--tokenizer_name", str(work / "tokenizer"), "--train_file", str(work / "train.txt"), "--do_train",
        "--block_size", "32", "--per_device_train_batch_size", "4", "--max_steps", str(args.max_steps),
        "--output_dir", str(out), "--use_cpu", "--report_to", "none", "--logging_steps", "1",
        "--save_strategy", "no", "--disable_tqdm", "true", "--hivemind_config", json.dumps(hivemind_config),
    ]  # fmt: skip


def start_peer(work: Path, script: Path, out: Path, initial_peers: list[str], args) -> subprocess.Popen:
    out.mkdir(parents=True)
    env = {**ENV, "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(out / "datasets_cache")}
    log = open(out.parent / f"{out.name}.log", "w")
    command = peer_command(work, script, out, initial_peers, args)
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=out)


def peer_report(out: Path) -> dict[str, Any]:
    """Final step and averaging rounds from trainer_state.json, steps alone from the log."""
    log = (out.parent / f"{out.name}.log").read_text(errors="replace")
    state_path = out / "trainer_state.json"
    state = json.loads(state_path.read_text()) if state_path.exists() else {}
    history = [row for row in state.get("log_history", []) if "collaborative_step" in row]
    last = history[-1] if history else {}
    prefix = "averaging_rounds_"
    return {
        "step": state.get("global_step"),
        "rounds": {k.removeprefix(prefix): v for k, v in last.items() if k.startswith(prefix)},
        "swarm_peers": [row.get("swarm_peers") for row in history],
        "solo_rounds": log.count(SOLO),
        "local_grad_steps": log.count(LOCAL_GRADS),
        "traceback": "Traceback" in log,
    }


def compare_weights(a: Path, b: Path) -> dict[str, Any]:
    """max |w0-w1| over the saved weights, how many of the values differ at all, and the largest |w| (for scale)."""
    from safetensors.torch import load_file

    if not (a / "model.safetensors").exists() or not (b / "model.safetensors").exists():
        return {"max_abs_diff": None}
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    if wa.keys() != wb.keys():
        raise ValueError(f"the peers saved different tensors: {sorted(wa.keys() ^ wb.keys())}")
    diffs = {k: (wa[k].float() - wb[k].float()).abs() for k in wa}
    return {
        "max_abs_diff": max(float(d.max()) for d in diffs.values()),
        "values_differing": sum(int((d > 0).sum()) for d in diffs.values()),
        "values": sum(d.numel() for d in diffs.values()),
        "max_abs_weight": max(float(w.abs().max()) for w in wa.values()),
    }


def finish(processes: list[subprocess.Popen], timeout: float) -> list[int | None]:
    """Wait for every process until a common deadline (noting their children: hivemind's p2pd daemons); stop what is
    left, and any child that outlived its parent. Returns the exit codes (None: stopped at the deadline)."""
    deadline = time.monotonic() + timeout
    children: set[int] = set()
    while time.monotonic() < deadline and any(p.poll() is None for p in processes):
        children.update(pid for p in processes if p.poll() is None for pid in process_tree(p.pid)[1:])
        time.sleep(0.5)
    codes = [p.poll() for p in processes]
    for process in processes:
        stop(process)
    for pid in alive(sorted(children)):
        os.kill(pid, 9)  # a child of a process this script started, left behind by its parent
    return codes


def one_run(index: int, work: Path, script: Path, args: argparse.Namespace) -> dict[str, Any]:
    run_dir = work / f"run{index}"
    run_dir.mkdir()
    began = time.monotonic()
    boot = start_bootstrap(run_dir)
    try:
        outs = [run_dir / "peer0", run_dir / "peer1"]
        peers = [start_peer(work, script, out, boot.initial_peers, args) for out in outs]
        codes = finish(peers, args.timeout)
    finally:
        boot.stop()
    reports = [peer_report(out) for out in outs]
    weights = compare_weights(*outs)
    diff = weights["max_abs_diff"]
    steps = [r["step"] for r in reports]
    return {
        "run": index,
        "identical": diff is not None and diff <= args.atol,
        "bitwise_identical": diff == 0.0,
        **weights,
        "steps": steps,
        "both_reached_max_steps": steps == [args.max_steps] * 2,
        "exit_codes": codes,
        "peers": reports,
        "seconds": round(time.monotonic() - began, 1),
        "logs": str(run_dir),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_clm", type=Path, help="transformers' examples/pytorch/language-modeling/run_clm.py")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for both peers of one run to finish")
    parser.add_argument(
        "--atol", type=float, default=1e-6, help="max |w0-w1| counted as identical (float32 rounding: see README)"
    )
    parser.add_argument("--workdir", type=Path, default=None, help="keep scripts, logs and weights here")
    args = parser.parse_args(argv)
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="run_clm_check_"))
    work.mkdir(parents=True, exist_ok=True)
    script, changes = prepare(work, args.run_clm)
    version = re.search(r'check_min_version\("([^"]+)"\)', script.read_text())
    print(json.dumps({"script": str(args.run_clm), "min_version": version and version[1], "changes": changes}))
    results = []
    for index in range(args.runs):
        results.append(one_run(index, work, script, args))
        print(json.dumps(results[-1]), flush=True)
    identical = sum(r["identical"] and r["both_reached_max_steps"] for r in results)
    diffs = [r["max_abs_diff"] for r in results if r["max_abs_diff"] is not None]
    bitwise = sum(r["bitwise_identical"] and r["both_reached_max_steps"] for r in results)
    summary = {
        "identical_runs": identical,
        "bitwise_identical_runs": bitwise,
        "runs": args.runs,
        "atol": args.atol,
        "max_abs_diff": max(diffs, default=None),
    }
    print(json.dumps({"summary": summary, "workdir": str(work)}))
    return 0 if identical == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
