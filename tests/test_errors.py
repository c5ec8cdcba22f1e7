"""Errors a volunteer can act on: one message (what, where, how to fix), exit code 2 for the `trahiv` command, and a
traceback only with --debug / TRAHIV_DEBUG=1."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from swarm_helpers import ENV, stop, wait_for
from test_auth import RUN_ID, start_server

from trahiv import TrainingArguments
from trahiv.swarm import SwarmJoinError

TRAHIV = [sys.executable, "-m", "trahiv.cli.main"]
UNREACHABLE = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWMEGSxULAnyzgdnsfDLBV5wjy7CThowe4rVoRqrYEy5Rv"


def trahiv(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*TRAHIV, *argv], env=env or ENV, capture_output=True, text=True, timeout=120)


def assert_one_message(result: subprocess.CompletedProcess, command: str, *expected: str) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "errors.pydantic.dev" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines and lines[0].startswith(f"trahiv {command}: error: "), result.stderr
    for text in expected:
        assert text in result.stderr, result.stderr
    return result.stderr


def test_dht_with_an_unreachable_initial_peer():
    result = trahiv("dht", "--no-nat-port-map", "--initial-peers", UNREACHABLE)
    assert_one_message(result, "dht", f"initial_peers=['{UNREACHABLE}']", "nothing answered", "Check that a peer")
    assert "ensure_bootstrap_success" not in result.stderr


def test_dht_with_a_malformed_host_maddr_and_the_debug_switch():
    result = trahiv("dht", "--no-nat-port-map", "--host-maddrs", "not-a-maddr")
    assert_one_message(result, "dht", "--host-maddrs", "malformed multiaddr 'not-a-maddr'")
    assert "ValidationError" not in result.stderr
    for debug in (["--debug", "dht"], ["dht", "--debug"]):
        shown = trahiv(*debug, "--no-nat-port-map", "--host-maddrs", "not-a-maddr")
        assert shown.returncode == 2 and "Traceback" in shown.stderr, shown.stderr
    shown = trahiv("dht", "--no-nat-port-map", "--host-maddrs", "not-a-maddr", env={**ENV, "TRAHIV_DEBUG": "1"})
    assert shown.returncode == 2 and "Traceback" in shown.stderr, shown.stderr


def test_aux_with_invalid_yaml_or_json_or_a_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("dht:\n  initial_peers: [a\nopt: {run_id: x}\n")
    result = trahiv("aux", "--config", str(bad))
    assert_one_message(result, "aux", "hivemind_config", str(bad), "not valid YAML", "line 3")
    assert_one_message(trahiv("aux", "--config", '{"opt": '), "aux", "hivemind_config", "not valid JSON", "line 1")
    missing = str(tmp_path / "missing.yaml")
    assert_one_message(trahiv("aux", "--config", missing), "aux", "hivemind_config", missing, "existing file")


def test_command_line_mistakes_are_told_before_the_engine_is_imported(tmp_path):
    """`trahiv dht` and `trahiv aux` check their input before importing hivemind and torch (~4 s of a 4.5 s answer)."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("opt: [1\n")
    mistakes = [
        ["dht", "--no-nat-port-map", "--host-maddrs", "not-a-maddr"],
        ["dht", "--no-nat-port-map", "--identity-path", str(tmp_path / "missing" / "key")],
        ["dht", "--auth-server", "http://127.0.0.1:9", "--run-id", "r", "--auth-token-file", str(tmp_path / "none")],
        ["aux", "--config", str(bad)],
        ["aux", "--config", json.dumps({"opt": {"run_id": "r"}, "dht": {"initial_peers": ["/ip4/127.0.0.1"]}})],
    ]
    script = (
        "import json, sys\nfrom trahiv.cli.main import main\n"
        f"codes = [main(argv) for argv in {mistakes!r}]\n"
        "print(json.dumps([codes, sorted(m for m in ('torch', 'hivemind') if m in sys.modules)]))"
    )
    result = subprocess.run([sys.executable, "-c", script], env=ENV, capture_output=True, text=True, timeout=120)
    codes, imported = json.loads(result.stdout.splitlines()[-1])
    assert codes == [2] * len(mistakes), result.stderr
    messages = [line for line in result.stderr.splitlines() if ": error: " in line]
    assert len(messages) == len(mistakes) and "Traceback" not in result.stderr, result.stderr
    for text in ("malformed multiaddr 'not-a-maddr'", "missing", "none: No such file", "not valid YAML", "/p2p/"):
        assert text in result.stderr, (text, result.stderr)
    assert imported == [], f"{imported} imported before the input was checked"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["auth-server", "--db", "not-a-url", "--port", "0"], "give a database URL such as sqlite:///"),
        (["dht", "--no-nat-port-map", "--identity-path", "/nonexistent/dir/key"], "/nonexistent/dir"),
        (
            ["dht", "--auth-server", "http://127.0.0.1:9", "--run-id", "r", "--auth-token-file", "/nonexistent/token"],
            "/nonexistent/token: No such file",
        ),
    ],
)
def test_other_commands_bad_paths_and_urls(argv, expected):
    assert_one_message(trahiv(*argv), argv[0], expected)


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("swarm.yaml", "opt:\n  run_id: x\n  target_batch_size: [1\n", "not valid YAML at line 4"),
        ("swarm.json", '{"opt": {"run_id": "x",\n "target_batch_size": 4,}}', "not valid JSON at line 2"),
    ],
)
def test_malformed_hivemind_config_file_names_the_key_the_file_and_the_line(tmp_path, name, text, expected):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError) as error:
        TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[], hivemind_config=str(path))
    message = str(error.value)
    assert message.startswith("hivemind_config:") and str(path) in message and expected in message, message
    assert error.value.__cause__ is None and error.value.__suppress_context__


@pytest.mark.swarm
def test_trainer_with_an_unreachable_initial_peer_is_one_message(tmp_path):
    import transformers

    from trahiv import Trainer

    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        report_to=[],
        use_cpu=True,
        hivemind_config={"dht": {"initial_peers": [UNREACHABLE], "nat_port_map": False},
                         "opt": {"run_id": "errors", "target_batch_size": 8}},
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64))
    with pytest.raises(SwarmJoinError) as error:
        Trainer(model=model, args=args)
    assert "nothing answered at these addresses (3 attempts)" in str(error.value)  # tried again before giving up
    assert "ensure_bootstrap_success" not in str(error.value)
    assert error.value.__cause__ is None and error.value.__suppress_context__, "hivemind's traceback is chained"


@pytest.mark.swarm
@pytest.mark.timeout(300)
def test_peer_without_a_token_joining_a_moderated_swarm_is_told_it_needs_one(tmp_path):
    server = start_server(tmp_path / "server")
    dht = None
    try:
        status, body = server.api("POST", "/api/experiments", {"run_id": RUN_ID})
        assert status == 201, body
        (tmp_path / "token").write_text(server.add_user("boot"))
        addresses = tmp_path / "addresses.json"
        command = [*TRAHIV, "dht", "--no-nat-port-map", "--addresses-file", str(addresses), "--auth-server",
                   server.url, "--run-id", RUN_ID, "--auth-token-file", str(tmp_path / "token")]  # fmt: skip
        dht = subprocess.Popen(command, env=ENV, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "dht.log", "w"))
        peers = wait_for(lambda: addresses.exists() and addresses.read_text() and json.loads(addresses.read_text()),
                         120, "the moderated bootstrap peer")  # fmt: skip
        result = trahiv("dht", "--no-nat-port-map", "--initial-peers", *peers)
        assert_one_message(result, "dht", "this swarm requires a token (hivemind_config.auth", "moderator")
        assert "ensure_bootstrap_success" not in result.stderr
    finally:
        if dht is not None:
            stop(dht)
        server.stop()


# --- a clean console (trahiv/console.py) ---------------------------------------------------------------------------

PENDING_TASK = """
import asyncio, gc, sys
if sys.argv[2] == "trahiv":
    import trahiv  # installs the filters

async def waits():
    await asyncio.wait_for(asyncio.Event().wait(), 3600)

def pending_task():  # as hivemind's background loops leave them
    loop = asyncio.new_event_loop()
    task = loop.create_task(waits())
    loop.run_until_complete(asyncio.sleep(0.01))
    return loop, task

if sys.argv[1] == "during":
    loop, task = pending_task()
    del loop, task
    gc.collect()
else:
    kept = pending_task()  # collected when the interpreter exits
print("MARK", file=sys.stderr, flush=True)
"""


@pytest.mark.parametrize("when", ["during", "exit"])
def test_pending_tasks_are_reported_while_running_not_at_exit(when):
    def stderr(importer: str) -> str:
        result = subprocess.run([sys.executable, "-c", PENDING_TASK, when, importer], env=ENV, capture_output=True,
                                text=True, timeout=120)  # fmt: skip
        assert result.returncode == 0 and "MARK" in result.stderr, result.stderr
        return result.stderr

    without, with_trahiv = stderr("plain"), stderr("trahiv")
    before, after = with_trahiv.split("MARK")
    assert "Task was destroyed but it is pending!" in without  # the scenario does produce the message
    if when == "during":  # a task lost while the program runs is still reported
        assert "Task was destroyed but it is pending!" in before
    else:
        assert "Task was destroyed" not in after, with_trahiv


def test_importing_trahiv_first_quiets_bitsandbytes_kernels_notice():
    code = (
        "import logging, trahiv, peft, bitsandbytes; logging.getLogger('bitsandbytes.backends.cpu.ops').warning('kept')"
    )
    result = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "gemm_4bit_forward" not in result.stderr and "kept" in result.stderr, result.stderr
