"""Entry point of the `trahiv` command.

Every subcommand runs through `main`, the one place where errors become messages: an error the user can fix (bad
input, a file, an address, a refused token: see `trahiv.errors.user_message`) is printed as one message and exits with
code 2; a bug prints its type and message and exits with 1. `--debug` (or TRAHIV_DEBUG=1) adds the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

SUBCOMMANDS = ("dht", "demo", "memory", "auth_server", "aux_peer", "revert", "doctor")
DEBUG_HELP = "show tracebacks (also: environment variable TRAHIV_DEBUG=1)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trahiv", description="Train transformers together over the Internet.")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(f"trahiv.cli.{name}").register(commands)
    for sub in commands.choices.values():  # `trahiv dht --debug` works as well as `trahiv --debug dht`
        sub.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    return parser


def main(argv: list[str] | None = None) -> int:
    from trahiv.errors import DEBUG_ENV, debug_enabled, user_message

    args = build_parser().parse_args(argv)
    debug = args.debug or debug_enabled()
    if debug:
        os.environ[DEBUG_ENV] = "1"  # library code (and child processes) keep the engine's errors chained
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        message = user_message(e)
        if debug:
            traceback.print_exc()
        if message is None:  # not the user's mistake: say so, the traceback is for a bug report
            hint = "" if debug else " (run again with --debug for the traceback)"
            print(f"trahiv {args.command}: internal error: {type(e).__name__}: {e}{hint}", file=sys.stderr)
            return 1
        print(f"trahiv {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
