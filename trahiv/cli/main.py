"""Entry point of the `trahiv` command."""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = ("dht", "demo", "memory", "auth_server", "aux_peer", "revert", "doctor")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trahiv", description="Train transformers together over the Internet.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(f"trahiv.cli.{name}").register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except ValueError as e:  # bad input: a clear message, no traceback
        print(f"trahiv {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
