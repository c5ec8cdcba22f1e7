"""hivemind's multiaddr parser, without importing hivemind.

hivemind 1.1.12 vendors py-multiaddr as `hivemind.utils.multiaddr`: pure Python, its own modules plus base58, cid,
idna, netaddr and varint. Imported as such it runs `hivemind/__init__.py` first, which imports torch and every
hivemind module: about 3 CPU-seconds before a command could say that an address is malformed (`trahiv dht
--host-maddrs x` answered in 4.5 s, a config file's typo in `trahiv aux` in 4.6 s). `multiaddr_class()` loads the
same files as a package of their own (found with `importlib.util.find_spec`, which does not run hivemind's
`__init__`), or returns hivemind's own class once hivemind is imported.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

__all__ = ["multiaddr_class"]

ENGINE_MODULE = "hivemind.utils.multiaddr"
_STANDALONE = "trahiv.engine._hivemind_multiaddr"  # (its relative imports resolve under this name)


def multiaddr_class() -> Any:
    """hivemind's `Multiaddr` class (`Multiaddr("/ip4/...")` parses, raises on a malformed address)."""
    module = sys.modules.get(ENGINE_MODULE) or sys.modules.get(_STANDALONE)
    if module is None:
        found = importlib.util.find_spec("hivemind")
        if found is None or not found.submodule_search_locations:
            raise ImportError("hivemind is not installed")
        folder = Path(list(found.submodule_search_locations)[0], *ENGINE_MODULE.split(".")[1:])
        spec = importlib.util.spec_from_file_location(
            _STANDALONE, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[_STANDALONE] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[_STANDALONE]
            raise
    return module.Multiaddr
