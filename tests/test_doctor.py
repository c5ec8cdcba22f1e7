"""`trahiv doctor` against a bootstrap peer on 127.0.0.1, its pure checks, and client_mode 'auto'."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from email.utils import formatdate

import pytest
from swarm_helpers import ENV, start_bootstrap

from trahiv.config import DHTConfig, HivemindConfig
from trahiv.doctor import check_addresses, check_clock

TRAHIV = [sys.executable, "-m", "trahiv.cli.main"]
PUBLIC_PEER = "/ip4/44.0.0.7/tcp/31337/p2p/12D3KooWSs2VQwvuNVpN58BXcHVSKtvo5n2ztug9xUau8vpgNN2s"  # (never dialled)


def doctor(*args: str, dht: dict | None = None) -> tuple[int, str, float]:
    config = json.dumps(
        {"dht": {"nat_port_map": False, **(dht or {})}, "opt": {"run_id": "doc", "target_batch_size": 1}}
    )
    began = time.monotonic()
    done = subprocess.run([*TRAHIV, "doctor", "--config", config, *args], env=ENV, capture_output=True, text=True)
    return done.returncode, done.stdout + done.stderr, time.monotonic() - began


@pytest.mark.swarm
def test_doctor_reachable_peer_is_ready_unreachable_is_told_the_fix(tmp_path):
    bootstrap = start_bootstrap(tmp_path)
    try:
        code, out, seconds = doctor("--initial-peers", *bootstrap.initial_peers)
        assert code == 0, out
        assert "[ ok ] initial peer" in out and "dialled this peer back" in out and "Ready to join." in out
        assert seconds < 30, f"doctor took {seconds:.0f} s"
        # announced at a port nobody listens on: the bootstrap's dial-back fails, as from behind a NAT
        code, out, _ = doctor(
            "--initial-peers", *bootstrap.initial_peers, dht={"announce_maddrs": ["/ip4/127.0.0.1/tcp/9"]}
        )
        assert code == 1, out
        line = next(line for line in out.splitlines() if "reachable from the swarm" in line)
        assert line.startswith("[FAIL]") and "could not dial this peer back" in line and "client_mode: true" in line
        code, out, _ = doctor(
            "--initial-peers",
            *bootstrap.initial_peers,
            dht={"announce_maddrs": ["/ip4/127.0.0.1/tcp/9"], "client_mode": True},
        )
        assert code == 0 and "dht.client_mode is true: as it should be" in out, out
    finally:
        bootstrap.stop()


def test_doctor_dead_initial_peer_and_config_errors(tmp_path):
    dead = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWSs2VQwvuNVpN58BXcHVSKtvo5n2ztug9xUau8vpgNN2s"
    code, out, _ = doctor("--initial-peers", dead, "--timeout", "2")
    assert code == 1 and f"[FAIL] initial peer {dead}" in out and "fix:" in out, out
    code, out, _ = doctor(dht={"initial_pears": []})
    assert code == 2 and "did you mean 'initial_peers'" in out, out


@pytest.mark.swarm
def test_client_mode_auto_switches_when_not_dialled_back(tmp_path, caplog):
    from trahiv.swarm import start_dht

    bootstrap = start_bootstrap(tmp_path)
    try:
        for announce, expected in ((None, False), (["/ip4/127.0.0.1/tcp/9"], True)):
            config = DHTConfig(initial_peers=bootstrap.initial_peers, nat_port_map=False, announce_maddrs=announce)
            assert config.client_mode is None and "client_mode" not in config.kwargs()  # unset means 'auto'
            with caplog.at_level("INFO", logger="trahiv.connectivity"):
                dht = start_dht(config)
            try:
                assert dht.client_mode is expected
            finally:
                dht.shutdown()
        switched = [r.getMessage() for r in caplog.records if "Switching to client mode" in r.getMessage()]
        assert len(switched) == 1 and "/ip4/127.0.0.1/tcp/9" in switched[0]
    finally:
        bootstrap.stop()


def test_pure_checks():
    public = check_addresses(["/ip4/127.0.0.1/tcp/5", "/ip4/192.168.1.5/tcp/5"], [PUBLIC_PEER], client_mode=False)
    assert public.status == "fail" and "announce_maddrs" in public.fix
    assert check_addresses(["/ip4/45.0.0.4/tcp/5"], [PUBLIC_PEER], client_mode=False).status == "ok"
    assert check_addresses(["/ip4/127.0.0.1/tcp/5"], [], client_mode=False).status == "warn"
    assert check_addresses([], [PUBLIC_PEER], client_mode=True).status == "ok"
    now = time.time()
    assert check_clock(formatdate(now - 3, usegmt=True), now).status == "ok"
    late = check_clock(formatdate(now - 120, usegmt=True), now)
    assert late.status == "fail" and "120 s ahead" in late.detail and "timedatectl" in late.fix
    assert check_clock(None, now).status == "warn"
    for value in ("auto", True, False, None):
        assert HivemindConfig.load({"dht": {"client_mode": value}, "opt": {"run_id": "r", "target_batch_size": 1}})


def test_auth_server_and_clock_checks():
    import http.server
    import threading

    from trahiv.doctor import check_auth_server

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            found = self.path == "/api/experiments/doc"
            self.send_response(200 if found else 404)
            self.end_headers()
            self.wfile.write(b"{}")

        def date_time_string(self, timestamp=None):  # the Date header of a server 2 minutes behind
            return formatdate(time.time() - 120, usegmt=True)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"

    def config(run_id: str, server_url: str = url) -> HivemindConfig:
        auth = {"server": server_url, "token": "t", "timeout": 2.0}
        return HivemindConfig.load({"opt": {"run_id": run_id, "target_batch_size": 1}, "auth": auth})

    try:
        answers, clock = check_auth_server(config("doc"))
        assert answers.status == "ok" and clock.status == "fail" and "120 s ahead" in clock.detail
        unknown = check_auth_server(config("other"))[0]
        assert unknown.status == "fail" and "knows no experiment 'other'" in unknown.detail and unknown.fix
    finally:
        server.shutdown()
        server.server_close()
    (dead,) = check_auth_server(config("doc", url))  # the server is gone: no answer
    assert dead.status == "fail" and "does not answer" in dead.detail and "auth_server" in dead.fix


def test_a_rate_limited_dialback_is_a_warning_with_when_to_retry(monkeypatch):
    import asyncio

    from trahiv import doctor as doctor_module
    from trahiv.connectivity import DialBack

    async def busy(p2p, peer, maddrs, timeout):
        return DialBack(False, error="busy: ask again in 7 s", retry_after=7.0)

    monkeypatch.setattr(doctor_module, "request_dialback", busy)
    config = HivemindConfig.model_validate(
        {"dht": {"nat_port_map": False}, "opt": {"run_id": "d", "target_batch_size": 1}}
    )
    answer, check = asyncio.run(doctor_module._check_dialback(None, ["peerA", "peerB"], [], config, 1.0))
    assert answer is None and check.status == "warn", check  # a refusal says nothing about reachability
    assert "peerA, peerB" in check.detail and "again in 7 s" in check.fix, check
