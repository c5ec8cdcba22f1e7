"""A clean console: third-party notices that tell a trahiv user nothing they can act on are dropped where they arise.

- bitsandbytes 0.50.2 logs "Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'"
  (logger `bitsandbytes.backends.cpu.ops`) when imported on a CPU with AVX512-BF16, which transformers' Trainer and
  PEFT import: 4-bit CPU matmuls fall back to bitsandbytes' own kernel and work. Only that record is dropped; the
  logger's other messages still show.
"""

from __future__ import annotations

import logging

__all__ = ["NOTICES", "quiet_third_party_notices"]

NOTICES: dict[str, tuple[str, ...]] = {  # logger name -> message prefixes to drop
    "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward from kernels-community",),
}


class _DropNotices(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def quiet_third_party_notices() -> None:
    """Install the filters (idempotent); must run before the libraries are imported (their notices come at import)."""
    for name, prefixes in NOTICES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNotices) for f in logger.filters):
            logger.addFilter(_DropNotices(prefixes))
