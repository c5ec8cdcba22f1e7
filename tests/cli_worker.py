"""`trahiv ARGV` in a process forked from the tests' fork server (tests/zygote.py): the command as its entry point
runs it (`trahiv.cli.main.main`), without a fresh interpreter's ~4 s of imports."""

from __future__ import annotations

from trahiv.cli.main import main as trahiv


def main(*argv: str) -> int:
    return trahiv(list(argv))
