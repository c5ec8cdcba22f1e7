"""`trahiv memory`: how much GPU and CPU memory training a model takes, with 8-bit optimizers, offloading, gradient
checkpointing, parameter sharing or LoRA (the memory calculator of "Training Transformers Together").

`trahiv memory --serve` runs the same calculator as a web page (trahiv.web.memory_page) with uvicorn; MODEL and the
options, if given, are then the page's starting values (a config.json becomes one more model to choose)."""

from __future__ import annotations

import argparse
import json
import signal
from typing import Any

from trahiv.memory import (
    COMPONENT_LABELS,
    COMPONENTS,
    PRESETS,
    GiB,
    MemoryEstimate,
    MemoryOptions,
)

__all__ = ["format_table", "register", "run"]


def register(commands: argparse._SubParsersAction) -> None:
    from trahiv.cli.flags import add_flags
    from trahiv.web.memory_page import MemoryQuery  # (fastapi: a few hundred ms, as the page's own model is the source)

    parser = commands.add_parser(
        "memory",
        help="estimate the GPU and CPU memory needed to train a model",
        epilog=f"presets: {', '.join(PRESETS)}",
    )
    parser.add_argument(
        "model",
        nargs="?",
        help="a preset name (e.g. gpt2-xl, dalle) or a transformers config.json (or its dir); optional with --serve",
    )
    flags = add_flags(parser, MemoryQuery, exclude=("model",))  # MODEL: the positional argument above
    parser.add_argument("--json", action="store_true", help="print the estimate as JSON (bytes)")
    parser.add_argument("--serve", action="store_true", help="run the calculator as a web page (GET /memory)")
    parser.add_argument("--host", default="127.0.0.1", help="with --serve: the address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="with --serve: the port to listen on")
    parser.set_defaults(run=run, parser=parser, flags_memory=flags)


def run(args: argparse.Namespace) -> int:
    from trahiv.memory import estimate, resolve_model

    if args.serve:
        return serve(args)
    if args.model is None:
        args.parser.error("the following arguments are required: model (unless --serve)")
    result = estimate(resolve_model(args.model), _options(args))
    print(json.dumps(result.to_dict(), indent=2) if args.json else format_table(result))
    return 0


def _options(args: argparse.Namespace) -> MemoryOptions:
    """The options from the flags (MemoryQuery's fields), checked by MemoryOptions as the library checks them."""
    values = args.flags_memory.values(args)
    values["offload_optimizer"] = values.pop("offload")
    return MemoryOptions(**values)


def serve(args: argparse.Namespace) -> int:
    """The web page, with MODEL and the options as its starting values, until Ctrl+C or SIGTERM."""
    import uvicorn

    from trahiv.memory import resolve_model
    from trahiv.web.memory_page import DEFAULT_MODEL, create_app

    if args.json:
        args.parser.error("--json and --serve exclude each other")
    _options(args)  # the options' own checks, as without --serve
    extra: dict[str, Any] = {}
    model = DEFAULT_MODEL if args.model is None else args.model
    shape = resolve_model(model)
    if shape.name not in PRESETS:  # a config.json: one more model on the page
        extra[shape.name] = shape
    defaults = args.flags_memory.build(args, model=shape.name)
    print(f"Memory calculator: http://{_url_host(args.host)}:{args.port}/memory", flush=True)
    # uvicorn stops gracefully on SIGTERM, then raises the signal again: exit 0 then, as `trahiv dht` does
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        uvicorn.run(create_app(extra, defaults), host=args.host, port=args.port, log_level="info")
    except _Terminated:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


class _Terminated(Exception):
    """SIGTERM arrived."""


def _terminated(signum: int, frame: Any) -> None:
    raise _Terminated


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


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
        gpu, cpu = _gib(getattr(result.gpu, name)), _gib(getattr(result.cpu, name))
        lines.append(f"{COMPONENT_LABELS[name]:<22}{gpu:>12}{cpu:>12}")
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
