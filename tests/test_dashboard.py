"""The auxiliary peer's dashboard over a MetricsStore filled with known steps and contributors:
the JSON API (shapes, ETA, empty store, bad parameters), the page's files, the server, and the page itself rendered
by headless Chromium (Debian's chromium package; skipped where it is not installed, as on a non-root machine).

TRAHIV_WRITE_DOCS=1 also saves the browser test's screenshot as docs/dashboard.png (the README's picture)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from html.parser import HTMLParser
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from fastapi.testclient import TestClient

from trahiv.auxiliary.dashboard import (
    ETA_WINDOW,
    PAGE_MAX_POINTS,
    STATIC_DIR,
    DashboardServer,
    StepPoint,
    create_app,
    step_rate_and_eta,
    summarize,
)
from trahiv.auxiliary.dashboard_service import DashboardService, attach
from trahiv.auxiliary.store import MetricsStore
from trahiv.cli.main import build_parser

if TYPE_CHECKING:
    from trahiv.auxiliary.peer import AuxService  # (it imports hivemind: seconds)

REPO = Path(__file__).resolve().parents[1]
MISSED_STEP, NO_LOSS_STEP, LAST_STEP, MAX_STEPS, STEP_SECONDS = 15, 3, 30, 100, 20.0
# (peer_id, name, device, samples, seconds), added in this order; the leaderboard orders them by samples
CONTRIBUTORS = [
    ("12D3KooWBobBobBobBobBob", "bob", "cpu", 1500, 600.0),
    ("12D3KooWAliceAliceAlice", "alice", "cuda: NVIDIA T4", 3000, 540.0),
    ("12D3KooWAnonymousPeer42", None, "mps", 1260, 200.0),
    ("12D3KooWEveEveEveEveEve", "eve <laptop>", None, 40, 30.0),  # a name is text, never markup
]
BY_SAMPLES = sorted(CONTRIBUTORS, key=lambda c: -c[3])


def loss_at(step: int) -> float:
    return 6.0 * 0.93**step


def active_peers_at(step: int) -> int:
    return 2 + (step > 10) + (step > 20)


def fill(store: MetricsStore, start: float) -> None:
    """Steps 1..30 every 20 s (step 15 missed by the auxiliary peer, no loss reported at step 3), 4 contributors."""
    for step in range(1, LAST_STEP + 1):
        if step != MISSED_STEP:
            loss = float("nan") if step == NO_LOSS_STEP else loss_at(step)
            store.add_step(step, start + STEP_SECONDS * step, loss, active_peers_at(step), 9.6 + 0.1 * step, 192)
    for offset, (peer_id, name, device, samples, seconds) in enumerate(CONTRIBUTORS):
        store.upsert_contributor(peer_id, name, device, samples, seconds, start + LAST_STEP * STEP_SECONDS - 5 * offset)
    store.set_meta("run_id", "dashboard_test")
    store.set_meta("max_steps", str(MAX_STEPS))
    store.set_meta("target_batch_size", "192")


@pytest.fixture(scope="module")
def start() -> float:
    return time.time() - LAST_STEP * STEP_SECONDS - 10.0


@pytest.fixture(scope="module")
def filled(tmp_path_factory, start):
    """The known run, shared by the tests that only read it."""
    store = MetricsStore(f"sqlite:///{tmp_path_factory.mktemp('filled') / 'metrics.sqlite'}")
    fill(store, start)
    yield store
    store.close()


@pytest.fixture
def store(tmp_path, start):
    """The known run, for a test that changes it."""
    store = MetricsStore(f"sqlite:///{tmp_path / 'metrics.sqlite'}")
    fill(store, start)
    yield store
    store.close()


@pytest.fixture
def empty_store(tmp_path):
    store = MetricsStore(f"sqlite:///{tmp_path / 'empty.sqlite'}")
    yield store
    store.close()


@pytest.fixture(scope="module")
def client(filled) -> TestClient:
    return TestClient(create_app(filled))


# --- the API ------------------------------------------------------------------------------------------------------


def test_summary(client, start):
    before = time.time()
    summary = client.get("/api/summary").json()
    last_time = start + LAST_STEP * STEP_SECONDS
    eta = (MAX_STEPS - LAST_STEP) * STEP_SECONDS  # one step per 20 s over the last 20 steps (one missed)
    assert summary == {
        "run_id": "dashboard_test",
        "step": LAST_STEP,
        "max_steps": MAX_STEPS,
        "target_batch_size": 192,
        "progress": pytest.approx(LAST_STEP / MAX_STEPS),
        "loss": pytest.approx(loss_at(LAST_STEP)),
        "active_peers": 4,
        "samples_per_second": pytest.approx(9.6 + 0.1 * LAST_STEP),
        "steps_per_hour": pytest.approx(3600 / STEP_SECONDS),
        "eta_seconds": pytest.approx(eta),
        "eta_time": pytest.approx(last_time + eta),
        "last_step_time": pytest.approx(last_time),
        "total_samples": sum(c[3] for c in CONTRIBUTORS),
        "contributors": len(CONTRIBUTORS),
        "server_time": summary["server_time"],
    }
    assert before <= summary["server_time"] <= time.time()


def test_steps_all_and_the_last_few(client, start):
    steps = client.get("/api/steps").json()["steps"]
    recorded = [s for s in range(1, LAST_STEP + 1) if s != MISSED_STEP]
    assert [point["step"] for point in steps] == recorded
    assert steps[0] == {"step": 1, "time": pytest.approx(start + STEP_SECONDS), "loss": pytest.approx(loss_at(1)),
                        "active_peers": 2, "samples_per_second": pytest.approx(9.7), "samples": 192}  # fmt: skip
    assert next(p for p in steps if p["step"] == NO_LOSS_STEP)["loss"] is None  # nan from the collector: no loss
    assert [p["step"] for p in client.get("/api/steps", params={"limit": 3}).json()["steps"]] == [28, 29, 30]
    assert len(client.get("/api/steps", params={"limit": 10**6}).json()["steps"]) == len(recorded)


def test_leaderboard_by_samples_with_shares(client, start):
    board = client.get("/api/leaderboard").json()
    total = sum(c[3] for c in CONTRIBUTORS)
    assert board["total_contributors"] == len(CONTRIBUTORS) and board["total_samples"] == total
    assert board["total_seconds"] == pytest.approx(sum(c[4] for c in CONTRIBUTORS))
    rows = board["contributors"]
    assert [(r["rank"], r["peer_id"], r["name"], r["device"], r["samples"], r["seconds"]) for r in rows] == [
        (rank, *c) for rank, c in enumerate(BY_SAMPLES, start=1)
    ]
    assert [r["share"] for r in rows] == pytest.approx([c[3] / total for c in BY_SAMPLES])
    bob = next(r for r in rows if r["name"] == "bob")
    assert bob["first_seen"] == bob["last_seen"] == pytest.approx(start + LAST_STEP * STEP_SECONDS)
    top = client.get("/api/leaderboard", params={"limit": 2}).json()
    assert [r["name"] for r in top["contributors"]] == ["alice", "bob"] and top["total_contributors"] == 4


def test_empty_store(empty_store):
    client = TestClient(create_app(empty_store))
    summary = client.get("/api/summary").json()
    assert {key for key, value in summary.items() if value is not None} == {"total_samples", "contributors",
                                                                           "server_time"}  # fmt: skip
    assert summary["total_samples"] == summary["contributors"] == 0
    assert client.get("/api/steps").json() == {"steps": []}
    assert client.get("/api/leaderboard").json() == {
        "contributors": [], "total_contributors": 0, "total_samples": 0, "total_seconds": 0.0
    }  # fmt: skip
    assert client.get("/").status_code == 200


@pytest.mark.parametrize("path", ["/api/steps", "/api/leaderboard"])
@pytest.mark.parametrize(
    ("params", "field", "message"),
    [
        ({"limit": "0"}, "limit", "greater than or equal to 1"),
        ({"limit": "-5"}, "limit", "greater than or equal to 1"),
        ({"limit": "ten"}, "limit", "valid integer"),
        ({"limit": "2.5"}, "limit", "valid integer"),
        ({"limit": str(10**7)}, "limit", "less than or equal to 1000000"),
        ({"limits": "3"}, "limits", "Extra inputs are not permitted"),  # a typo is not silently ignored
    ],
)
def test_bad_query_parameters_are_a_422_with_the_reason(client, path, params, field, message):
    response = client.get(path, params=params)
    assert response.status_code == 422
    errors = response.json()["detail"]
    assert any(e["loc"] == ["query", field] and message in e["msg"] for e in errors), errors


# --- the step rate and the ETA ------------------------------------------------------------------------------------


def points(*step_times: tuple[int, float]) -> list[StepPoint]:
    return [
        StepPoint(step=s, time=t, loss=1.0, active_peers=1, samples_per_second=1.0, samples=1) for s, t in step_times
    ]


@pytest.mark.parametrize(
    ("steps", "max_steps", "rate", "eta"),
    [
        (points((1, 100.0), (2, 110.0), (3, 120.0)), 10, 0.1, 70.0),
        (points((1, 100.0), (4, 130.0)), 10, 0.1, 60.0),  # steps the auxiliary peer missed still count
        (points((1, 100.0), (2, 110.0)), None, 0.1, None),  # no max_steps: a rate, no ETA
        (points((5, 100.0)), 10, None, None),  # one step: no rate yet
        (points((5, 100.0), (5, 110.0)), 10, None, None),  # no progress: no rate
        (points((9, 100.0), (10, 110.0)), 10, 0.1, 0.0),  # max_steps reached
        (points((12, 100.0)), 10, None, 0.0),  # past it (max_steps lowered): reached, even without a rate
        ([], 10, None, None),
    ],
    ids=["steady", "missed-steps", "no-max-steps", "one-step", "stalled", "reached", "past", "empty"],
)
def test_step_rate_and_eta(steps, max_steps, rate, eta):
    assert step_rate_and_eta(steps, max_steps) == (pytest.approx(rate) if rate else None, eta)


def test_eta_follows_the_recent_rate():
    slow = [(step, 1000.0 * step) for step in range(1, 51)]  # 1000 s per step at first...
    fast = [(50 + step, 50_000.0 + 10.0 * step) for step in range(1, ETA_WINDOW + 1)]  # ...then 10 s per step
    rate, eta = step_rate_and_eta(points(*slow, *fast), max_steps=100)
    assert rate == pytest.approx(0.1) and eta == pytest.approx((100 - 50 - ETA_WINDOW) * 10.0)


def test_malformed_metadata_is_a_clear_error(store):
    store.set_meta("max_steps", "ten")
    with pytest.raises(ValueError, match="the store's metadata max_steps='ten' is not an integer"):
        summarize(store)


# --- the page's files and the server ------------------------------------------------------------------------------


def test_page_loads_only_its_own_files(client):
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "http://" not in page.text and "https://" not in page.text, "nothing from another site"
    assert not re.search(r"(src|href)=\"//", page.text)
    assert 'data-summary="/api/summary"' in page.text and 'data-steps="/api/steps"' in page.text
    assert f'data-max-points="{PAGE_MAX_POINTS}"' in page.text and 'data-refresh-ms="5000"' in page.text
    assets = re.findall(r'(?:src|href)="(/static/[^"]+)"', page.text)
    assert {"/static/uPlot.iife.min.js", "/static/dashboard.js", "/static/dashboard.css"} <= set(assets)
    for asset in assets:
        assert client.get(asset).status_code == 200, asset
    assert "Leon Sorokin" in client.get("/static/uPlot.LICENSE.txt").text  # the vendored library's MIT license
    assert client.get("/memory").status_code == 200  # the memory calculator, for volunteers sizing their machines


def test_static_files_are_shipped():
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '"auxiliary/static/*"' in pyproject, "the dashboard's static files must be in the package data"
    names = {path.name for path in STATIC_DIR.iterdir()}
    assert {"index.html", "dashboard.js", "dashboard.css", "uPlot.iife.min.js", "uPlot.min.css"} <= names
    assert "uPlot.LICENSE.txt" in names


def test_bad_refresh_and_port_fail_at_once(filled):
    with pytest.raises(ValueError, match="refresh_seconds must be positive"):
        create_app(filled, refresh_seconds=0)
    with pytest.raises(ValueError, match=r"dashboard port must be in 0\.\.65535"):
        DashboardServer(filled, port=70000)


def test_server_on_a_free_port_and_a_taken_port(filled):
    with DashboardServer(filled, port=0, refresh_seconds=2.0) as server:
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/", server.url) and server.port > 0
        with urllib.request.urlopen(f"{server.url}api/summary", timeout=5) as response:
            assert b'"run_id":"dashboard_test"' in response.read()
        with pytest.raises(OSError, match=f"the dashboard cannot listen on 127.0.0.1:{server.port}"):
            DashboardServer(filled, port=server.port)
    DashboardServer(filled, port=server.port).stop()  # the port is released on stop: a restart can take it again


# --- the page in headless Chromium --------------------------------------------------------------------------------


class LateStep:
    """The store, plus one step recorded right after the page first fetched the history: the page must show it
    without being reloaded."""

    def __init__(self, store: MetricsStore, start: float):
        self.store, self.start, self.added = store, start, False

    def steps(self, limit: int | None = None) -> list[dict]:
        rows = self.store.steps(limit)
        if limit == PAGE_MAX_POINTS and not self.added:  # the page's chart request
            step = LAST_STEP + 1
            self.store.add_step(step, self.start + STEP_SECONDS * step, loss_at(step), 4, 12.7, 192)
            self.added = True
        return rows

    def contributors(self) -> list[dict]:
        return self.store.contributors()

    def meta(self) -> dict[str, str]:
        return self.store.meta()


def chromium(url: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    command = [shutil.which("chromium") or "chromium", "--headless", "--no-sandbox", "--disable-gpu",
               "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run",
               "--disable-extensions", f"--user-data-dir={tmp_path / 'chromium-profile'}", "--hide-scrollbars",
               "--window-size=1280,1200", "--virtual-time-budget=4000", *args, url]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, encoding="utf-8", timeout=60)


class Page(HTMLParser):
    """What the test reads from the rendered DOM: elements by id (tag, attributes, text) and the leaderboard's rows."""

    def __init__(self, dom: str):
        super().__init__()
        self.by_id: dict[str, dict[str, Any]] = {}
        self.rows: list[dict[str, Any]] = []
        self.canvases: list[str] = []  # the id of the chart container each canvas is in
        self._open: list[dict[str, Any]] = []
        self.feed(dom)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        element: dict[str, Any] = {"tag": tag, "attrs": dict(attrs), "text": ""}
        if element["attrs"].get("id"):
            self.by_id[element["attrs"]["id"]] = element
        if tag == "tr" and "data-peer-id" in element["attrs"]:
            self.rows.append({"peer_id": element["attrs"]["data-peer-id"], "cells": {}})
        if tag == "td" and self.rows and any(e["tag"] == "tr" and "data-peer-id" in e["attrs"] for e in self._open):
            self.rows[-1]["cells"][element["attrs"].get("class", "")] = element
        if tag == "canvas":
            self.canvases += [e["attrs"]["id"] for e in self._open if e["attrs"].get("id", "").endswith("-chart")]
        if tag not in ("meta", "link", "br", "img", "input", "canvas"):
            self._open.append(element)

    def handle_endtag(self, tag: str) -> None:
        while self._open and self._open.pop()["tag"] != tag:
            pass

    def handle_data(self, data: str) -> None:
        for element in self._open:
            element["text"] += data

    def text(self, element_id: str) -> str:
        return " ".join(self.by_id[element_id]["text"].split())


@pytest.mark.skipif(
    shutil.which("chromium") is None,
    reason="Debian's chromium is not installed (scripts/setup.sh installs it when run as root)",
)
def test_page_in_headless_chromium(store, start, tmp_path):
    with DashboardServer(LateStep(store, start), port=0, refresh_seconds=1.0) as server:
        done = chromium(server.url, tmp_path, "--dump-dom")
        assert done.returncode == 0, done.stderr[-2000:]
        page = Page(done.stdout)
        png = tmp_path / "dashboard.png"
        shot = chromium(server.url, tmp_path, f"--screenshot={png}")
    assert page.by_id["dashboard"]["attrs"].get("data-loaded") == "true", page.text("error")
    assert page.by_id["error"]["attrs"].get("hidden") is not None, page.text("error")
    # the loss chart: drawn by uPlot, one point per step with a loss, including the step recorded after loading
    recorded = [s for s in range(1, LAST_STEP + 2) if s != MISSED_STEP]
    assert page.by_id["loss-chart"]["attrs"]["data-points"] == str(len(recorded) - 1)  # step 3 has no loss
    assert page.by_id["peers-chart"]["attrs"]["data-points"] == str(len(recorded))
    assert {"loss-chart", "peers-chart", "throughput-chart"} <= set(page.canvases)
    # the cards: refreshed by itself to step 31 of 100
    assert page.text("step") == str(LAST_STEP + 1) and page.text("max-steps") == f"/ {MAX_STEPS}"
    assert page.text("step-label") == "Collaborative step" and page.text("step-rate").endswith(" steps/h")
    assert page.by_id["diloco-board"]["attrs"].get("hidden") is not None  # (a synchronous swarm)
    assert page.text("run-id") == "dashboard_test" and page.text("active-peers") == "4"
    assert page.text("eta") == "23 min"  # 69 steps at 20 s each
    assert page.text("loss") == f"{loss_at(LAST_STEP + 1):.3f}" and page.text("throughput") == "12.7"
    # the leaderboard: the right rows, most samples first; names are text
    rows = [(r["peer_id"], r["cells"]["name"]["text"], r["cells"]["num samples"]["text"]) for r in page.rows]
    assert (
        rows
        == [  # the name (or the end of the peer id), then the whole peer id
            (peer_id, f"{name or 'peer …' + peer_id[-8:]}{peer_id}", f"{samples:,}")
            for peer_id, name, _, samples, _ in BY_SAMPLES
        ]
    )
    assert [r["cells"]["rank"]["text"] for r in page.rows] == ["1", "2", "3", "4"]
    assert "eve &lt;laptop&gt;" in done.stdout and "<laptop>" not in done.stdout
    # the screenshot
    assert shot.returncode == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", shot.stderr[-2000:]
    assert png.stat().st_size > 20_000, "the screenshot looks blank"
    print(f"dashboard screenshot: {png}")
    if os.environ.get("TRAHIV_WRITE_DOCS") == "1":
        (REPO / "docs").mkdir(exist_ok=True)
        shutil.copyfile(png, REPO / "docs" / "dashboard.png")


# --- `trahiv aux --dashboard-port` --------------------------------------------------------------------------------


def aux_args(*flags: str) -> argparse.Namespace:
    config = '{"opt": {"run_id": "dashboard_cli", "target_batch_size": 16}}'
    return build_parser().parse_args(["aux", "--config", config, *flags])


class StandInPeer:
    """What `attach` and the service use of an AuxPeer (the real one starts a DHT: see the `trahiv aux` test below)."""

    def __init__(self, store: MetricsStore | None = None):
        self.store = store
        self.services: list[AuxService] = []
        self.lines: list[str] = []

    def add_service(self, service: AuxService) -> None:
        self.services.append(service)

    def announce(self, line: str) -> None:
        self.lines.append(line)


def test_dashboard_flags_attach_a_service():
    peer = StandInPeer()
    attach(peer, aux_args())
    assert peer.services == []  # no flag: no dashboard
    attach(peer, aux_args("--dashboard-port", "0", "--dashboard-host", "127.0.0.1", "--dashboard-refresh", "2"))
    [service] = peer.services
    assert (service.host, service.port, service.refresh_seconds) == ("127.0.0.1", 0, 2.0)
    for flags, message in [
        (("--dashboard-port", "65536"), r"--dashboard-port must be in 0\.\.65535"),
        (("--dashboard-host", "0.0.0.0"), "--dashboard-host needs --dashboard-port"),
        (("--dashboard-port", "0", "--dashboard-refresh", "0"), "--dashboard-refresh must be positive"),
    ]:
        with pytest.raises(ValueError, match=message):
            attach(StandInPeer(), aux_args(*flags))


def test_service_on_a_taken_port_says_what_to_do(filled):
    peer = StandInPeer(filled)
    running = DashboardService(port=0, announce=peer.announce)
    running.start(peer)
    try:
        assert peer.lines == [f"Dashboard: {running.url}"]
        port = int(str(running.url).rsplit(":", 1)[1].strip("/"))
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port}.*choose another --dashboard-port"):
            DashboardService(port=port).start(peer)
    finally:
        running.stop()
    assert running.url is None
    with pytest.raises(RuntimeError, match="after the auxiliary peer opened its store"):
        DashboardService().start(StandInPeer())


@pytest.mark.swarm
def test_trahiv_aux_serves_the_dashboard(tmp_path):
    config = '{"opt": {"run_id": "dashboard_cli", "target_batch_size": 16}, "dht": {"nat_port_map": false}}'
    command = [sys.executable, "-m", "trahiv.cli.main", "aux", "--config", config, "--output-dir", str(tmp_path),
               "--report-to", "none", "--max-steps", "40", "--dashboard-port", "0", "--duration", "30"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = None
        deadline = time.monotonic() + 60
        while url is None and time.monotonic() < deadline:  # the lines come in order; readline waits for the next
            line = process.stdout.readline() if process.stdout else ""
            assert line, f"trahiv aux exited ({process.poll()}) before printing the dashboard's URL"
            url = line.removeprefix("Dashboard: ").strip() if line.startswith("Dashboard: ") else None
        assert url and re.fullmatch(r"http://127\.0\.0\.1:\d+/", url), url
        with urllib.request.urlopen(f"{url}api/summary", timeout=10) as response:
            summary = json.loads(response.read())
        assert (summary["run_id"], summary["max_steps"], summary["step"]) == ("dashboard_cli", 40, None)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise AssertionError("trahiv aux did not stop within 20 s of SIGTERM") from None
    assert code == 0, process.stdout.read() if process.stdout else ""


@pytest.mark.skipif(
    shutil.which("chromium") is None,
    reason="Debian's chromium is not installed (scripts/setup.sh installs it when run as root)",
)
def test_empty_run_in_headless_chromium(empty_store, tmp_path):
    with DashboardServer(empty_store, port=0) as server:
        done = chromium(server.url, tmp_path, "--dump-dom")
    assert done.returncode == 0, done.stderr[-2000:]
    page = Page(done.stdout)
    assert page.by_id["dashboard"]["attrs"].get("data-loaded") == "true", page.text("error")  # no script error
    assert "hidden" not in page.by_id["empty"]["attrs"] and "hidden" not in page.by_id["no-contributors"]["attrs"]
    assert page.rows == [] and page.by_id["loss-chart"]["attrs"]["data-points"] == "0"
    assert (page.text("step"), page.text("eta"), page.text("loss")) == ("–", "no max_steps", "–")
