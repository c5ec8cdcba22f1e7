"""The `trahiv` command: one module per subcommand, each registering its own parser."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_addresses(path: str | os.PathLike, addresses: list[str]) -> None:
    """Write join addresses (JSON) for scripts that wait for the file: whole or not at all (write, then rename)."""
    target = Path(path)
    partial = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    partial.write_text(json.dumps(addresses))
    os.replace(partial, target)
