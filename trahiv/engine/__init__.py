"""The engine boundary: the only package that touches hivemind 1.1.12's internals (private attributes, overridden
internal methods, bodies adapted from hivemind, each marked with the function it came from).

Everything else in trahiv uses hivemind's public API (DHT, PeerID, get_dht_time, validators) and these modules:
- `fixes`: engine bugs fixed once (signals, orphaned processes, numpy-2 8-bit decoding, log noise) and process helpers;
- `averagers`: the averagers (robust reducer, round reports, epoch-keyed matchmaking, checked state download,
  PowerSGD); policy (aggregation, deadlines, reports) comes from the engine-free `trahiv.averaging`;
- `optimizer`: the collaborative optimizer and progress tracker, and the builders of a peer's averagers;
- `exact`, `ring`: rounds that hand every peer the same bits; gradient rounds as a ring all-reduce (`opt.allreduce`);
- `gate`: the auth gate in front of an averager's RPCs;
- `state`: verbs on a running optimizer: download a checked state, replace the state at a step, set the step.
- `liveness`: the peer's engine processes watched (DHT, p2pd, averagers): one ending under it stops the peer.
- `trail`: an averager's matchmaking lines kept in memory, told when its round goes wrong.
- `tell`: a gradient round's groupmates told as it begins, so that a peer waiting at its share begins at once.
`internals.INTERNALS` lists every hivemind internal these rely on; tests/test_engine_boundary.py checks them.

Importing this package is cheap: the submodules (and hivemind) load when used.
"""

from trahiv.engine.fixes import (
    HIVEMIND_VERSION,
    apply,
    children_ignore_sigint,
    clear_interrupt,
    interrupt_on_signals,
    kill_descendants,
    raise_if_interrupted,
    start_parent_watchdog,
)

__all__ = [
    "HIVEMIND_VERSION",
    "apply",
    "children_ignore_sigint",
    "clear_interrupt",
    "interrupt_on_signals",
    "kill_descendants",
    "raise_if_interrupted",
    "start_parent_watchdog",
]
