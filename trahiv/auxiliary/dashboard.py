"""The auxiliary peer's dashboard: a web page and a JSON API over its MetricsStore (FastAPI, served by uvicorn).

    GET /                  the page: current collaborative step and ETA to max_steps, active peers, throughput, the
                           loss curve, active peers and throughput over time, the leaderboard of contributors (and
                           in a DiLoCo swarm each peer's outer step and averaging bytes). It
                           polls the API every `refresh_seconds` and redraws; charts by uPlot (vendored under
                           static/, MIT), nothing is loaded from another site
    GET /api/summary       the run at a glance (Summary)
    GET /api/steps         per collaborative step: loss, active peers, samples/s, samples (Steps); ?limit=N: the last N
    GET /api/leaderboard   contributors, most samples first, with their share (Leaderboard); ?limit=N: the first N
    GET /api/diloco        DiLoCo swarms: each peer's outer step, inner steps, averaging bytes sent / received
    GET /memory            the memory calculator (trahiv.web.memory_page), for volunteers sizing their machines

Bad or unknown query parameters answer 422 with FastAPI's {"detail": [{"loc", "msg"}]}. The dashboard only reads the
store, so the auxiliary peer's collector keeps writing from its own thread. `DashboardServer` runs the app with uvicorn
in a background thread (127.0.0.1 and a free port by default) for the auxiliary peer; `create_app` is the bare app.
"""

from __future__ import annotations

import html
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Protocol

from fastapi import FastAPI, Query, Request
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "ETA_WINDOW",
    "PAGE_MAX_POINTS",
    "STATIC_DIR",
    "Contributor",
    "DashboardServer",
    "Leaderboard",
    "LeaderboardQuery",
    "MetricsSource",
    "StepPoint",
    "Steps",
    "StepsQuery",
    "Summary",
    "create_app",
    "leaderboard",
    "step_rate_and_eta",
    "summarize",
]

STATIC_DIR = Path(__file__).parent / "static"
ETA_WINDOW = 20  # the step rate (hence the ETA) comes from the last this many recorded steps
MAX_LIMIT = 1_000_000
PAGE_MAX_POINTS = 10_000  # the page charts at most the last this many steps


class MetricsSource(Protocol):
    """What the dashboard reads: trahiv.auxiliary.store.MetricsStore's reading half."""

    def steps(self, limit: int | None = None) -> list[dict]: ...

    def contributors(self) -> list[dict]: ...

    def meta(self) -> dict[str, str]: ...


# --- the API's models ---------------------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StepPoint(_Strict):
    """One collaborative step as the auxiliary peer recorded it."""

    step: int = Field(ge=0, description="collaborative step")
    time: float = Field(description="unix time the step was recorded")
    loss: float | None = Field(description="the swarm's mean training loss; null if no peer reported one")
    active_peers: int = Field(ge=0, description="trainer peers in the swarm at that step")
    samples_per_second: float = Field(ge=0, description="the swarm's throughput")
    samples: int = Field(ge=0, description="samples accumulated for that step")


class Steps(_Strict):
    steps: list[StepPoint] = Field(description="ascending by step")


class Contributor(_Strict):
    rank: int = Field(ge=1, description="1 = most samples")
    peer_id: str
    name: str | None = Field(description="display name the peer chose, if any")
    device: str | None = Field(description="e.g. 'cuda: NVIDIA T4' or 'cpu'")
    samples: int = Field(ge=0, description="samples contributed to collaborative steps")
    seconds: float = Field(ge=0, description="time spent training in the swarm")
    share: float = Field(ge=0, le=1, description="fraction of all contributors' samples")
    first_seen: float = Field(description="unix time")
    last_seen: float = Field(description="unix time")


class Leaderboard(_Strict):
    contributors: list[Contributor] = Field(description="most samples first")
    total_contributors: int = Field(ge=0)
    total_samples: int = Field(ge=0)
    total_seconds: float = Field(ge=0)


class Summary(_Strict):
    run_id: str | None
    step: int | None = Field(description="latest collaborative step recorded; null before the first")
    max_steps: int | None = Field(description="the run's max_steps, if known")
    target_batch_size: int | None
    progress: float | None = Field(description="step / max_steps")
    loss: float | None = Field(description="loss at the latest step")
    active_peers: int | None = Field(description="trainer peers at the latest step")
    samples_per_second: float | None = Field(description="the swarm's throughput at the latest step")
    steps_per_hour: float | None = Field(description=f"collaborative steps per hour over the last {ETA_WINDOW} steps")
    eta_seconds: float | None = Field(description="time to max_steps at that rate; 0 when reached")
    eta_time: float | None = Field(description="unix time max_steps is expected (latest step time + eta_seconds)")
    last_step_time: float | None = Field(description="unix time of the latest step")
    total_samples: int = Field(ge=0, description="samples contributed by all peers")
    contributors: int = Field(ge=0, description="peers that ever contributed")
    server_time: float = Field(description="unix time of this answer (to compute ages without clock skew)")


class StepsQuery(BaseModel):
    model_config = ConfigDict(extra="forbid")  # query strings are text: lax parsing, but no unknown parameters

    limit: int | None = Field(None, ge=1, le=MAX_LIMIT, description="only the last `limit` steps")


class LeaderboardQuery(BaseModel):
    model_config = ConfigDict(extra="forbid")

    limit: int | None = Field(None, ge=1, le=MAX_LIMIT, description="only the first `limit` contributors")


# --- computations (pure) ------------------------------------------------------------------------------------------


def step_rate_and_eta(
    steps: Sequence[StepPoint], max_steps: int | None, window: int = ETA_WINDOW
) -> tuple[float | None, float | None]:
    """(collaborative steps per second over the last `window` steps, seconds from the latest step to max_steps).

    Steps the auxiliary peer missed are fine: the rate is (step difference) / (time difference). The rate is None with
    fewer than two steps or no progress; the ETA is 0 once max_steps is reached, None without max_steps or a rate."""
    recent = list(steps)[-window:]
    rate = None
    if len(recent) >= 2:
        advanced, elapsed = recent[-1].step - recent[0].step, recent[-1].time - recent[0].time
        rate = advanced / elapsed if advanced > 0 and elapsed > 0 else None
    if max_steps is None or not recent:
        return rate, None
    remaining = max_steps - recent[-1].step
    if remaining <= 0:
        return rate, 0.0
    return rate, None if rate is None else remaining / rate


def summarize(source: MetricsSource, now: float | None = None) -> Summary:
    """The run at a glance: the latest step, the ETA from the recent steps, the contributors' totals."""
    meta = source.meta()
    max_steps = _int_meta(meta, "max_steps")
    recent = [StepPoint.model_validate(row) for row in source.steps(limit=ETA_WINDOW)]
    rate, eta = step_rate_and_eta(recent, max_steps)
    last = recent[-1] if recent else None
    contributors = source.contributors()
    return Summary(
        run_id=meta.get("run_id"),
        step=last.step if last else None,
        max_steps=max_steps,
        target_batch_size=_int_meta(meta, "target_batch_size"),
        progress=min(last.step / max_steps, 1.0) if last and max_steps else None,
        loss=last.loss if last else None,
        active_peers=last.active_peers if last else None,
        samples_per_second=last.samples_per_second if last else None,
        steps_per_hour=None if rate is None else rate * 3600.0,
        eta_seconds=eta,
        eta_time=None if eta is None or last is None else last.time + eta,
        last_step_time=last.time if last else None,
        total_samples=sum(int(row["samples"]) for row in contributors),
        contributors=len(contributors),
        server_time=time.time() if now is None else now,
    )


def leaderboard(source: MetricsSource, limit: int | None = None) -> Leaderboard:
    """Contributors ranked by samples (the first `limit`), each with their share of all samples."""
    rows = source.contributors()  # most samples first
    total = sum(int(row["samples"]) for row in rows)
    shown = rows if limit is None else rows[:limit]
    contributors = [
        Contributor(rank=rank, share=int(row["samples"]) / total if total else 0.0, **row)
        for rank, row in enumerate(shown, start=1)
    ]
    return Leaderboard(
        contributors=contributors,
        total_contributors=len(rows),
        total_samples=total,
        total_seconds=sum((float(row["seconds"]) for row in rows), 0.0),
    )


def _int_meta(meta: Mapping[str, str], key: str) -> int | None:
    """An integer the auxiliary peer wrote into the store's metadata; None if absent or empty."""
    value = meta.get(key)
    if value is None or value.strip() in ("", "None"):
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"the store's metadata {key}={value!r} is not an integer") from None


# --- the app ------------------------------------------------------------------------------------------------------


def create_app(source: MetricsSource, *, refresh_seconds: float = 5.0, title: str = "trahiv dashboard") -> FastAPI:
    """The dashboard over `source` (a MetricsStore); the page polls the API every `refresh_seconds`."""
    if not refresh_seconds > 0:
        raise ValueError(f"refresh_seconds must be positive, got {refresh_seconds}")
    from trahiv.web.memory_page import create_router as memory_router

    app = FastAPI(title=title, summary="a collaborative training run: loss, peers, throughput, contributors")
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    app.include_router(memory_router())

    @app.get("/api/summary", name="summary", summary="the run at a glance")
    def summary_api() -> Summary:
        return summarize(source)

    @app.get("/api/steps", name="steps", summary="the history, one point per collaborative step")
    def steps_api(query: Annotated[StepsQuery, Query()]) -> Steps:
        return Steps(steps=[StepPoint.model_validate(row) for row in source.steps(limit=query.limit)])

    @app.get("/api/leaderboard", name="leaderboard", summary="contributors by samples contributed")
    def leaderboard_api(query: Annotated[LeaderboardQuery, Query()]) -> Leaderboard:
        return leaderboard(source, query.limit)

    @app.get("/api/diloco", name="diloco", summary="DiLoCo swarms: each peer's outer step and averaging bytes")
    def diloco_api() -> dict[str, Any]:
        rows = source.diloco_peers() if hasattr(source, "diloco_peers") else []
        return {"diloco": source.meta().get("mode") == "diloco", "peers": rows}

    @app.get("/", name="page", response_class=HTMLResponse, summary="the dashboard page")
    def page(request: Request) -> HTMLResponse:
        return HTMLResponse(render_page(request, refresh_seconds, title))

    return app


def render_page(request: Request, refresh_seconds: float, title: str) -> str:
    """The page's HTML: the API's and the static files' paths (behind a proxy's root_path too) and the refresh rate."""
    paths = {
        "__STATIC__": request.url_for("static", path="").path.rstrip("/"),
        "__SUMMARY__": request.url_for("summary").path,
        "__STEPS__": request.url_for("steps").path,
        "__LEADERBOARD__": request.url_for("leaderboard").path,
        "__DILOCO__": request.url_for("diloco").path,
        "__MEMORY__": request.url_for("memory_page").path,
        "__DOCS__": _docs_path(request),
    }
    replacements = {key: html.escape(value) for key, value in paths.items()}
    replacements |= {
        "__TITLE__": html.escape(title),
        "__REFRESH_MS__": str(round(refresh_seconds * 1000)),
        "__MAX_POINTS__": str(PAGE_MAX_POINTS),
    }
    page = (STATIC_DIR / "index.html").read_text(encoding="utf-8")
    for key, value in replacements.items():
        page = page.replace(key, value)
    return page


def _docs_path(request: Request) -> str:
    docs = request.app.docs_url or "/docs"
    return f"{request.scope.get('root_path', '')}{docs}"


# --- serving ------------------------------------------------------------------------------------------------------


class DashboardServer:
    """The dashboard served by uvicorn in a daemon thread, next to the auxiliary peer's own work.

    The socket is bound at construction, so a taken port fails at once (OSError) and `url` is known before `start()`;
    port 0 picks a free port."""

    def __init__(
        self, source: MetricsSource, host: str = "127.0.0.1", port: int = 0, *, refresh_seconds: float = 5.0
    ) -> None:
        import uvicorn

        if not 0 <= port <= 65535:
            raise ValueError(f"dashboard port must be in 0..65535 (0: any free port), got {port}")
        app = create_app(source, refresh_seconds=refresh_seconds)
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        self._socket = _bind(host, port)
        self.host, self.port = host, self._socket.getsockname()[1]
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        if self.host in ("0.0.0.0", "::"):  # listening everywhere: this machine's loopback reaches it
            host = "127.0.0.1" if self.host == "0.0.0.0" else "[::1]"
        return f"http://{host}:{self.port}/"

    def start(self, timeout: float = 30.0) -> DashboardServer:
        """Serve in a background thread; return once uvicorn accepts requests (RuntimeError if not in `timeout` s)."""
        if self._thread is not None:
            raise RuntimeError("the dashboard server was already started")
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, name="trahiv-dashboard", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the dashboard server on {self.url} stopped while starting")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the dashboard server on {self.url} did not start within {timeout:.0f} s")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving (open requests get `timeout` seconds) and release the port."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():  # a request that hangs: stop waiting for it
                self._server.force_exit = True
                self._thread.join(1.0)
        self._socket.close()

    def __enter__(self) -> DashboardServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"DashboardServer({self.url!r})"


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        sock.set_inheritable(True)
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"the dashboard cannot listen on {host}:{port}: {e.strerror}") from None
    return sock
