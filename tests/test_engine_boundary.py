"""The engine boundary: trahiv/engine/ is the only code that touches hivemind internals, and every internal it relies
on is listed (trahiv.engine.internals) and checked against the installed engine."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import trahiv
from trahiv.engine import fixes, internals

PACKAGE = Path(trahiv.__file__).parent

# hivemind's public API, usable anywhere in trahiv
PUBLIC = {
    "hivemind": None,  # `import hivemind`: hivemind.DHT, hivemind.Optimizer, hivemind.GradScaler
    "hivemind.p2p": {"PeerID", "P2P", "P2PContext"},
    "hivemind.utils": {"get_dht_time", "ValueWithExpiration"},
    "hivemind.utils.timed_storage": {"get_dht_time", "ValueWithExpiration"},
    "hivemind.utils.auth": {"TokenAuthorizerBase"},
    "hivemind.utils.crypto": {"RSAPrivateKey"},
    "hivemind.utils.multiaddr": {"Multiaddr"},
    "hivemind.utils.nested": {"nested_flatten"},
    "hivemind.proto": {"runtime_pb2", "crypto_pb2", "averaging_pb2"},
    "hivemind.proto.auth_pb2": {"AccessToken"},
    "hivemind.dht.schema": {"BytesWithPublicKey", "RSASignatureValidator", "SchemaValidator"},
    "hivemind.compression": None,
    "hivemind.compression.base": {"TensorRole"},
    "hivemind.optim.state_averager": {"load_optimizer_state", "initialize_optimizer_state_", "dump_optimizer_state"},
}


def test_every_internal_the_boundary_relies_on_is_in_the_installed_engine():
    assert internals.check() == []
    assert len(internals.INTERNALS) > 50
    fixes.apply()  # patched methods are checked by the engine's own signatures (their __wrapped__)
    assert internals.check() == []


def test_a_moved_internal_is_named(monkeypatch):
    moved = [
        internals.Internal("hivemind.optim.optimizer:Optimizer", "_update_global_epoch", "method", "(self)"),
        internals.Internal("hivemind.optim.optimizer:Optimizer", "_gone_in_a_later_release", "method", "(self)"),
        internals.Internal("hivemind.optim.optimizer:Optimizer", "_never_assigned", "instance"),
        internals.Internal("hivemind.no_such_module:Thing", "x", "attribute"),
    ]
    monkeypatch.setattr(internals, "INTERNALS", tuple(moved))
    problems = internals.check()
    assert len(problems) == 4, problems
    assert "Optimizer._update_global_epoch changed: (self) -> (self, grad_scaler" in problems[0]
    assert "_gone_in_a_later_release is gone" in problems[1]
    assert "_never_assigned: no longer assigned" in problems[2]
    assert "hivemind.no_such_module:Thing is gone" in problems[3]


def _hivemind_imports(path: Path) -> list[tuple[str, str | None, int]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "hivemind":
            found += [(node.module or "", alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names if alias.name.split(".")[0] == "hivemind"]
    return found


def test_only_the_engine_imports_hivemind_internals():
    outside = [p for p in PACKAGE.rglob("*.py") if "engine" not in p.relative_to(PACKAGE).parts]
    assert len(outside) > 20
    wrong = []
    for path in outside:
        for module, name, line in _hivemind_imports(path):
            allowed = PUBLIC.get(module, set())
            if module not in PUBLIC or (allowed is not None and name not in allowed):
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line}: from {module} import {name}")
    assert wrong == [], "hivemind internals outside trahiv/engine/ (move the code behind the boundary):\n" + "\n".join(
        wrong
    )


def test_importing_the_boundary_does_not_start_the_engine():
    code = "import sys, trahiv.engine; assert 'hivemind' not in sys.modules, 'hivemind imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
