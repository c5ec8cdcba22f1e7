"""A clean console: third-party notices that tell a trahiv user nothing they can act on are dropped where they arise.

- bitsandbytes 0.50.2 logs "Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'"
  (logger `bitsandbytes.backends.cpu.ops`) when imported on a CPU with AVX512-BF16, which transformers' Trainer and
  PEFT import: 4-bit CPU matmuls fall back to bitsandbytes' own kernel and work. Only that record is dropped; the
  logger's other messages still show.
- asyncio logs "Task was destroyed but it is pending!" (logger `asyncio`) for each task left in hivemind's
  background event loops (the `wait_for` of an RPC or a matchmaking wait, in the trainer's own process) when the
  interpreter garbage-collects them at exit: the swarm was already left cleanly (`Swarm.shutdown`), these loops
  belong to daemon threads that exit with the process. Dropped only while the interpreter is finalizing
  (`sys.is_finalizing()`), so a task lost while trahiv runs is still reported. (Seen at the end of 2-peer runs:
  tests/test_trl.py; checked with a filter that recorded the pid, thread and `sys.is_finalizing()` of each one.)
"""

from __future__ import annotations

import logging
import sys

__all__ = ["AT_EXIT", "NOTICES", "quiet_third_party_notices"]

NOTICES: dict[str, tuple[str, ...]] = {  # logger name -> message prefixes to drop
    "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward from kernels-community",),
}


AT_EXIT: dict[str, tuple[str, ...]] = {  # logger name -> message prefixes to drop while the interpreter exits
    "asyncio": ("Task was destroyed but it is pending!",),
}


class _DropNotices(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


class _DropAtExit(_DropNotices):
    def filter(self, record: logging.LogRecord) -> bool:
        return not sys.is_finalizing() or super().filter(record)


def quiet_third_party_notices() -> None:
    """Install the filters (idempotent); must run before the libraries are imported (their notices come at import)."""
    for table, kind in ((NOTICES, _DropNotices), (AT_EXIT, _DropAtExit)):
        for name, prefixes in table.items():
            logger = logging.getLogger(name)
            if not any(type(f) is kind for f in logger.filters):
                logger.addFilter(kind(prefixes))
