"""`trahiv aux`: an auxiliary peer (CPU only, no gradients): the swarm's stable entry point, which gathers the
trainers' metrics into a store and logs them to experiment trackers.

Other duties add their own flags and attach to the peer through EXTENSIONS: modules with
`add_arguments(parser)` and `attach(peer: AuxPeer, args)` (the latter calls `peer.add_service(...)`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

from trahiv.cli import write_addresses

EXTENSIONS: tuple[str, ...] = (  # each adds flags and attaches a service
    "trahiv.auxiliary.dashboard_service",
    "trahiv.auxiliary.state",
    "trahiv.auxiliary.helper",
)


def register(commands: argparse._SubParsersAction) -> None:
    from trahiv.auxiliary.trackers import TRACKERS
    from trahiv.cli.flags import add_flags
    from trahiv.config import DHTConfig

    parser = commands.add_parser(
        "aux", help="run an auxiliary peer: entry point, metrics store, experiment trackers (CPU only)"
    )
    parser.add_argument(
        "--config", required=True, help="the trainers' hivemind_config (JSON/YAML file or JSON string): run_id, dht"
    )
    parser.add_argument("--output-dir", default="aux_output", help="where the store and tracker logs go")
    parser.add_argument("--store", default=None, help="SQLAlchemy database URL (default: sqlite in --output-dir)")
    parser.add_argument("--report-to", nargs="+", default=["tensorboard"], choices=TRACKERS,
                        help="experiment trackers (wandb and trackio need their packages)")  # fmt: skip
    parser.add_argument("--tracker-project", default=None, help="W&B / trackio project (default: the run_id)")
    parser.add_argument(
        "--max-steps", type=int, default=None, help="the run's max_steps, for the dashboard's ETA (DiLoCo: outer steps)"
    )
    parser.add_argument("--period", type=float, default=2.0, help="seconds between reads of the swarm's metrics")
    parser.add_argument("--addresses-file", default=None, help="also write the join addresses there (JSON)")
    parser.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    group = parser.add_argument_group("DHT (a flag given overrides the config's dht section)")
    dht = add_flags(group, DHTConfig, notes={"identity_path": "created if missing"})
    for name in EXTENSIONS:
        importlib.import_module(name).add_arguments(parser)  # type: ignore[attr-defined]
    parser.set_defaults(run=run, flags_dht=dht)


def load_config(args: argparse.Namespace):
    """The hivemind_config with the DHT flags the user gave applied over its dht section (validated like the
    trainers'; a bad flag: one message naming it)."""
    from trahiv.config import HivemindConfig

    config = HivemindConfig.load(args.config)
    config.dht = args.flags_dht.build(args, base=config.dht.model_dump())
    return config


def run(args: argparse.Namespace) -> int:
    config = load_config(args)  # first: a bad config is told before the engine's imports (seconds)

    from trahiv.auxiliary.peer import AuxPeer
    from trahiv.cli.dht import _ensure_identity
    from trahiv.engine import interrupt_on_signals

    if config.dht.identity_path:
        _ensure_identity(config.dht.identity_path)
    peer = AuxPeer(
        config,
        output_dir=Path(args.output_dir),
        store_url=args.store,
        report_to=args.report_to,
        period=args.period,
        max_steps=args.max_steps,
        tracker_project=args.tracker_project,
        announce=lambda line: print(line, flush=True),
    )
    for name in EXTENSIONS:
        importlib.import_module(name).attach(peer, args)  # type: ignore[attr-defined]
    deadline = None if args.duration is None else time.monotonic() + args.duration
    crashed = False
    with interrupt_on_signals():  # Ctrl+C / SIGTERM: leave cleanly through `finally`
        try:
            peer.start()
            if args.addresses_file:
                write_addresses(args.addresses_file, peer.initial_peers)
            store = peer.store.url if peer.store is not None else peer.store_url  # (password hidden)
            print(f"Collecting metrics of run {peer.run_id!r} into {store}", file=sys.stderr, flush=True)
            while deadline is None or time.monotonic() < deadline:
                if not peer.alive():
                    crashed = True
                    break
                time.sleep(0.5)
        except KeyboardInterrupt:
            print("Stopping the auxiliary peer", file=sys.stderr)
        finally:
            peer.stop()
    if crashed:
        print(f"The auxiliary peer stopped: {peer.lost or 'its DHT process ended'}", file=sys.stderr)
        return 1
    return 0
