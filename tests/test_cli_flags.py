"""CLI flags generated from the pydantic config models (trahiv/cli/flags.py): one process, no swarm, no DHT.

Each command's help shows the model's description and default; a field added to a model shows up as a flag without
touching the commands; a bad value gives one message naming the flag (exit code 2); the flags tests and the README use
still parse to the same config; only the flags the user gave override a config file's values."""

from __future__ import annotations

import argparse
import json
import re
from typing import Literal

import pytest
from pydantic import Field

from trahiv.auxiliary.state import StateKeeperConfig
from trahiv.cli.flags import add_flags
from trahiv.cli.main import build_parser, main
from trahiv.config import DHTConfig, _Section
from trahiv.errors import UserError
from trahiv.web.memory_page import MemoryQuery

RUN = {"opt": {"run_id": "flags_run", "target_batch_size": 8}}
PEER = "/ip4/127.0.0.1/tcp/31337/p2p/QmXfANcrDYnt5LTXKcgBStHCmyAiYTDdsTadRwVMWBjKe7"


def _subparser(command: str) -> argparse.ArgumentParser:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices[command]


def _help(command: str) -> str:
    return " ".join(_subparser(command).format_help().split())  # (argparse wraps lines)


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize(
    ("command", "model", "field", "flag", "default"),
    [
        ("dht", DHTConfig, "wait_timeout", "--wait-timeout", "3.0"),
        ("dht", DHTConfig, "host_maddrs", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"),
        ("dht", DHTConfig, "nat_port_map", "--no-nat-port-map", "on"),
        ("aux", DHTConfig, "num_workers", "--num-workers", "4"),
        ("aux", StateKeeperConfig, "poll_interval", "--state-poll", "5.0"),
        ("aux", StateKeeperConfig, "keep_checkpoints", "--keep-checkpoints", "3"),
        ("doctor", DHTConfig, "initial_peers", "--initial-peers", None),
        ("memory", MemoryQuery, "seq_len", "--seq-len", "512"),
        ("memory", MemoryQuery, "offload", "--offload", "off"),
    ],
)
def test_help_shows_the_models_description_and_default(command, model, field, flag, default):
    text = _help(command)
    description = " ".join(model.model_fields[field].description.split())
    assert flag in text
    entry = re.escape(description) + r"[^-]*" + (re.escape(f"(default: {default})") if default else "")
    assert re.search(entry, text), f"{command} {flag}: {description!r} (default {default}) not in the help"


class Toy(_Section):
    name: str = Field("toy", description="the toy's name")
    size: int = Field(3, ge=1, description="how big")
    rate: float | None = Field(None, gt=0, description="how fast")
    loud: bool = Field(False, description="make noise")
    tags: list[str] = Field(default_factory=list, description="labels")
    shape: Literal["cube", "ball"] = Field("cube", description="what it looks like")
    extras: dict[str, int] = Field(default_factory=dict, description="config-file only")


def _toy_parser(model: type[_Section] = Toy, **kwargs) -> tuple[argparse.ArgumentParser, object]:
    parser = argparse.ArgumentParser(prog="toy", exit_on_error=False)
    return parser, add_flags(parser, model, **kwargs)


def test_every_field_type_becomes_a_flag_and_builds_the_model_back():
    parser, flags = _toy_parser()
    args = parser.parse_args(["--size", "5", "--rate", "0.5", "--loud", "--tags", "a", "b", "--shape", "ball"])
    assert flags.build(args) == Toy(size=5, rate=0.5, loud=True, tags=["a", "b"], shape="ball")
    assert flags.build(parser.parse_args([])) == Toy()  # no flag given: the model's defaults
    assert not hasattr(parser.parse_args([]), "extras")  # a dict has no flag (the config file's)
    assert flags.build(parser.parse_args(["--no-loud"]), base={"loud": True}).loud is False
    with pytest.raises(argparse.ArgumentError, match="invalid choice"):
        parser.parse_args(["--shape", "pyramid"])
    text = " ".join(parser.format_help().split())
    assert "--loud, --no-loud make noise (default: off)" in text and "--size SIZE how big (default: 3)" in text


def test_a_field_added_to_the_model_shows_up_without_touching_the_cli():
    class Toy2(Toy):
        colour: str = Field("red", description="the paint")

    parser, flags = _toy_parser(Toy2)
    assert "the paint (default: red)" in " ".join(parser.format_help().split())
    assert flags.build(parser.parse_args(["--colour", "blue"])).colour == "blue"
    # and the real models: every DHTConfig field is a flag of `trahiv dht` and of `trahiv aux`
    for command in ("dht", "aux"):
        options = {o for a in _subparser(command)._actions for o in a.option_strings}
        assert {"--" + name.replace("_", "-") for name in DHTConfig.model_fields} <= options, command


def test_a_bad_value_is_one_message_naming_the_flag(capsys):
    assert main(["dht", "--no-nat-port-map", "--wait-timeout", "-1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "trahiv dht: error: invalid value: --wait-timeout: Input should be greater than 0", err
    assert main(["dht", "--no-nat-port-map", "--host-maddrs", "not-a-maddr"]) == 2
    assert "--host-maddrs: malformed multiaddr 'not-a-maddr'" in capsys.readouterr().err
    # a renamed flag is named as the user typed it
    args = _parse("aux", "--config", json.dumps(RUN), "--model", "m", "--state-poll", "0")
    with pytest.raises(UserError, match=r"^invalid value: --state-poll: Input should be greater than 0$"):
        args.flags_state.build(args, base={"checkpoint_dir": "c"})


def test_existing_flags_parse_to_the_same_config():
    args = _parse("dht", "--no-nat-port-map", "--initial-peers", PEER, "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                  "/ip4/127.0.0.1/udp/0/quic", "--identity-path", "key", "--addresses-file", "a.json")  # fmt: skip
    expected = DHTConfig(initial_peers=[PEER], host_maddrs=["/ip4/127.0.0.1/tcp/0", "/ip4/127.0.0.1/udp/0/quic"],
                         identity_path="key", nat_port_map=False)  # fmt: skip
    assert args.flags_dht.build(args) == expected and args.addresses_file == "a.json"
    args = _parse("dht", "--auth-server", "http://127.0.0.1:9", "--run-id", "r", "--auth-token-file", "t")
    assert args.flags_auth.values(args) == {"server": "http://127.0.0.1:9", "token_file": "t"}
    assert args.flags_run_id.value(args, "run_id") == "r" and args.flags_dht.build(args) == DHTConfig()
    args = _parse("aux", "--config", "{}", "--model", "m", "--checkpoint-every", "1", "--keep-checkpoints", "2",
                  "--state-poll", "0.5", "--no-resume", "--push-to-hub", "--hub-repo", "o/m")  # fmt: skip
    state = args.flags_state.build(args, base={"checkpoint_dir": "out/checkpoints"})
    assert state == StateKeeperConfig(model="m", checkpoint_dir="out/checkpoints", checkpoint_every=1,
                                      keep_checkpoints=2, poll_interval=0.5, resume=False, push_to_hub=True,
                                      hub_repo="o/m")  # fmt: skip
    args = _parse("memory", "gpt2-xl", "--batch-size", "2", "--precision", "fp16", "--optimizer-bits", "8", "--offload")
    assert args.flags_memory.build(args, model="gpt2-xl") == MemoryQuery(
        model="gpt2-xl", batch_size=2, precision="fp16", optimizer_bits=8, offload=True
    )


def test_only_the_flags_given_override_the_config_file():
    from trahiv.cli.aux_peer import load_config

    config = {**RUN, "dht": {"initial_peers": [PEER], "wait_timeout": 7.0, "nat_port_map": True}}
    args = _parse("aux", "--config", json.dumps(config), "--no-nat-port-map", "--num-workers", "2")
    dht = load_config(args).dht
    assert dht.initial_peers == [PEER] and dht.wait_timeout == 7.0  # from the file: no flag given
    assert dht.nat_port_map is False and dht.num_workers == 2  # the flags given
    args = _parse("doctor", "--config", json.dumps(config))
    assert args.flags_dht.build(args, base=config["dht"]).initial_peers == [PEER]
