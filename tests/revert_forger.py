"""An allowlisted user who forges revert orders: `python tests/revert_forger.py SPEC.json`.

It joins the moderated swarm with a valid access token (so the DHT accepts its stores), then stores under
`{run_id}_revert` an order with a made-up signature, one signed by its own RSA key, and bytes that are no order.
It writes `stored.json` once they are stored, then waits (SIGTERM ends it).
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

from hivemind.utils import get_dht_time

from trahiv.auth import PeerAuth, keys
from trahiv.auth.revert import RevertOrder, SignedRevertOrder, sign_order
from trahiv.config import DHTConfig
from trahiv.revert import revert_key
from trahiv.swarm import start_dht


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    auth = PeerAuth.start(spec["server"], spec["token"], spec["run_id"])
    dht = start_dht(DHTConfig(initial_peers=spec["initial_peers"], nat_port_map=False), **auth.dht_kwargs())
    auth.attach(dht)
    order = RevertOrder(run_id=spec["run_id"], revert_id=1000, step=0, issued_at=time.time(), reason="forged")
    forged = {
        "bad-signature": SignedRevertOrder(order=order, signature="QUJD" * 64).to_bytes(),
        "other-key": sign_order(keys.generate_private_key(), order).to_bytes(),
        "garbage": b"not an order",
    }
    stored = {}
    for subkey, value in forged.items():
        stored[subkey] = bool(dht.store(revert_key(spec["run_id"]), value, get_dht_time() + 600, subkey=subkey))
    (out / "stored.json").write_text(json.dumps(stored))
    try:
        time.sleep(600)
    finally:
        auth.close()
        dht.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
