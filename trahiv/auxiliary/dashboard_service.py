"""The dashboard as a duty of the auxiliary peer: `trahiv aux --dashboard-port PORT [--dashboard-host HOST]`.

An extension of `trahiv aux` (trahiv.cli.aux_peer.EXTENSIONS): `add_arguments` adds the flags, `attach` adds a
`DashboardService` to the AuxPeer, which serves the dashboard over the peer's MetricsStore once the peer has
started and prints `Dashboard: http://HOST:PORT/`. Cheap to import: the web stack loads when the dashboard starts.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from trahiv.auxiliary.dashboard import DashboardServer, MetricsSource
    from trahiv.auxiliary.peer import AuxService

__all__ = ["DEFAULT_HOST", "DashboardService", "Host", "add_arguments", "attach"]

DEFAULT_HOST = "127.0.0.1"


class Host(Protocol):
    """What the dashboard uses of the auxiliary peer (trahiv.auxiliary.peer.AuxPeer)."""

    @property
    def store(self) -> MetricsSource | None: ...

    def announce(self, line: str) -> None: ...

    def add_service(self, service: AuxService) -> None: ...


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("dashboard")
    group.add_argument(
        "--dashboard-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve the dashboard (web page + JSON API) on this port; 0: any free port (default: none)",
    )
    group.add_argument(
        "--dashboard-host",
        default=None,
        metavar="HOST",
        help=f"address the dashboard listens on (default: {DEFAULT_HOST}; 0.0.0.0: every interface)",
    )
    group.add_argument("--dashboard-refresh", type=float, default=5.0, metavar="SECONDS",
                       help="how often the page refreshes itself")  # fmt: skip


def attach(peer: Host, args: argparse.Namespace) -> None:
    """Add the dashboard to `peer` if --dashboard-port was given; bad flags fail here, before the peer starts."""
    if args.dashboard_port is None:
        if args.dashboard_host is not None:
            raise ValueError("--dashboard-host needs --dashboard-port (0: any free port)")
        return
    service = DashboardService(
        args.dashboard_host or DEFAULT_HOST,
        args.dashboard_port,
        refresh_seconds=args.dashboard_refresh,
        announce=peer.announce,
    )
    peer.add_service(service)


class DashboardService:
    """Serves the dashboard over the auxiliary peer's store while the peer runs (an AuxService)."""

    def __init__(
        self,
        host: str = DEFAULT_HOST,
        port: int = 0,
        *,
        refresh_seconds: float = 5.0,
        announce: Callable[[str], None] = print,
    ) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"--dashboard-port must be in 0..65535 (0: any free port), got {port}")
        if not refresh_seconds > 0:
            raise ValueError(f"--dashboard-refresh must be positive, got {refresh_seconds}")
        self.host, self.port, self.refresh_seconds, self.announce = host, port, refresh_seconds, announce
        self.server: DashboardServer | None = None

    @property
    def url(self) -> str | None:
        return None if self.server is None else self.server.url

    def start(self, peer: Host) -> None:
        from trahiv.auxiliary.dashboard import DashboardServer

        if peer.store is None:
            raise RuntimeError("the dashboard starts after the auxiliary peer opened its store")
        try:
            server = DashboardServer(peer.store, self.host, self.port, refresh_seconds=self.refresh_seconds)
        except OSError as e:  # a taken port, an address not on this machine: the operator's to fix
            raise ValueError(f"{e}; choose another --dashboard-port (0: any free port) or --dashboard-host") from None
        self.server = server.start()
        self.announce(f"Dashboard: {server.url}")

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
