"""`trahiv memory`: how much GPU and CPU memory training a model takes, with 8-bit optimizers, offloading, gradient
checkpointing, parameter sharing or LoRA (the memory calculator of "Training Transformers Together")."""

from __future__ import annotations

import argparse
import json

from trahiv.memory import COMPONENTS, OPTIMIZER_BITS, PRECISIONS, PRESETS, GiB, MemoryEstimate, MemoryOptions

_LABELS = {
    "weights": "weights",
    "master_weights": "fp32 master weights",
    "gradients": "gradients",
    "optimizer_states": "optimizer states",
    "activations": "activations",
}


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "memory",
        help="estimate the GPU and CPU memory needed to train a model",
        epilog=f"presets: {', '.join(PRESETS)}",
    )
    parser.add_argument("model", help="a preset name (e.g. gpt2-xl, dalle) or a transformers config.json (or its dir)")
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per forward pass")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per sequence")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32", help="fp32, or fp16/bf16 mixed precision")
    parser.add_argument("--optimizer-bits", type=int, choices=OPTIMIZER_BITS, default=32, help="Adam state precision")
    parser.add_argument("--offload", action="store_true", help="keep optimizer states and master weights on CPU")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations in backward")
    parser.add_argument("--parameter-sharing", action="store_true", help="all layers share weights (ALBERT-style)")
    parser.add_argument("--lora-rank", type=int, default=None, help="train only LoRA adapters of this rank")
    parser.add_argument("--json", action="store_true", help="print the estimate as JSON (bytes)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from trahiv.memory import estimate, resolve_model

    options = MemoryOptions(
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        precision=args.precision,
        optimizer_bits=args.optimizer_bits,
        offload_optimizer=args.offload,
        gradient_checkpointing=args.gradient_checkpointing,
        parameter_sharing=args.parameter_sharing,
        lora_rank=args.lora_rank,
    )
    result = estimate(resolve_model(args.model), options)
    print(json.dumps(result.to_dict(), indent=2) if args.json else format_table(result))
    return 0


def format_table(result: MemoryEstimate) -> str:
    """The estimate as a text table in GiB, one row per component."""
    options = result.options
    lines = [
        f"Model: {result.model.name}: {result.params:,} parameters ({result.trainable_params:,} trainable)",
        f"Training: {_describe(options)}",
        "",
        f"{'component':<22}{'GPU (GiB)':>12}{'CPU (GiB)':>12}",
    ]
    for name in COMPONENTS:
        lines.append(f"{_LABELS[name]:<22}{_gib(getattr(result.gpu, name)):>12}{_gib(getattr(result.cpu, name)):>12}")
    lines.append(f"{'total':<22}{_gib(result.gpu.total):>12}{_gib(result.cpu.total):>12}")
    return "\n".join(lines)


def _describe(options: MemoryOptions) -> str:
    parts = [
        f"batch {options.batch_size} x {options.seq_len} tokens",
        options.precision,
        f"{options.optimizer_bits}-bit optimizer",
    ]
    parts += [label for flag, label in _FLAGS if getattr(options, flag)]
    if options.lora_rank is not None:
        parts.append(f"LoRA rank {options.lora_rank}")
    return ", ".join(parts)


_FLAGS = (
    ("offload_optimizer", "optimizer offloaded to CPU"),
    ("gradient_checkpointing", "gradient checkpointing"),
    ("parameter_sharing", "parameter sharing"),
)


def _gib(n_bytes: int) -> str:
    return f"{n_bytes / GiB:.2f}"
