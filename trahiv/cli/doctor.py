"""`trahiv doctor`: check in seconds that this machine can join the swarm; one line per check, a fix for each failure.

Exit status 0 when ready (warnings allowed), 1 when a check failed, 2 for a usage or configuration error.
"""

from __future__ import annotations

import argparse
import sys


def register(commands: argparse._SubParsersAction) -> None:
    from trahiv.cli.flags import add_flags
    from trahiv.config import DHTConfig

    parser = commands.add_parser("doctor", help="check that this machine can join the swarm (network, clock, auth)")
    parser.add_argument("--config", default=None, help="the swarm's hivemind_config (YAML/JSON file or JSON string)")
    dht = add_flags(
        parser, DHTConfig, only=("initial_peers",), notes={"initial_peers": "checked; overrides the config"}
    )
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for each peer (default 5)")
    parser.set_defaults(run=run, flags_dht=dht)


def run(args: argparse.Namespace) -> int:
    from trahiv.config import HivemindConfig
    from trahiv.doctor import diagnose, exit_code

    if args.config is not None:
        config = HivemindConfig.load(args.config)  # ValueError: printed by trahiv.cli.main, exit status 2
    else:
        config = HivemindConfig.load({"opt": {"run_id": "doctor", "target_batch_size": 1}})
    config.dht = args.flags_dht.build(args, base=config.dht.model_dump())  # only the flags given override
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be positive, got {args.timeout}")
    checks = diagnose(config, timeout=args.timeout).checks
    for check in checks:
        print(check.line(), flush=True)
    code = exit_code(checks)
    print("Ready to join." if code == 0 else "Not ready: fix the failed checks above.", file=sys.stderr)
    return code
