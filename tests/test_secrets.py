"""The swarm's auth token never leaves the process in clear: not in str/repr, to_dict/JSON, pickles, checkpoints,
logs or tracker files. It can come from the config, a file or the environment."""

from __future__ import annotations

import copy
import json
import logging
import pickle

import pytest
import torch
import transformers

from trahiv import Trainer, TrainingArguments
from trahiv.config import REDACTED, TOKEN_ENV, HivemindConfig

TOKEN = "trahiv-user-s3cr3t-0123456789abcdef"
SERVER = "http://127.0.0.1:9"


def swarm_config(**auth) -> dict:
    return {
        "dht": {"nat_port_map": False},
        "opt": {"run_id": "secrets", "target_batch_size": 8},
        "auth": {"server": SERVER, **auth},
    }


def make_args(tmp_path, hivemind_config, **kwargs) -> TrainingArguments:
    kwargs = {"report_to": [], **kwargs}
    return TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, hivemind_config=hivemind_config, **kwargs)


@pytest.mark.parametrize("form", ["dict", "json"])
def test_token_is_redacted_in_every_text_form(tmp_path, form):
    config = swarm_config(token=TOKEN)
    args = make_args(tmp_path, config if form == "dict" else json.dumps(config))
    assert args.hivemind.auth.token.get_secret_value() == TOKEN  # the process itself has it
    outputs = {
        "str": str(args),
        "repr": repr(args),
        "to_dict": str(args.to_dict()),
        "to_json_string": args.to_json_string(),
        "to_sanitized_dict": str(args.to_sanitized_dict()),
        "config repr": repr(args.hivemind),
        "config json": args.hivemind.model_dump_json(),
    }
    for where, text in outputs.items():
        assert TOKEN not in text, f"the token leaks in {where}"
    assert REDACTED in outputs["to_json_string"] and SERVER in outputs["to_json_string"]


def test_pickles_hold_no_token_and_unpickled_args_refuse_to_join(tmp_path, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    args = make_args(tmp_path, swarm_config(token=TOKEN))
    blob = pickle.dumps(args)
    assert TOKEN.encode() not in blob
    copied = copy.deepcopy(args)  # in-process copies keep it (transformers and TRL copy arguments)
    assert copied.hivemind.auth.token.get_secret_value() == TOKEN
    restored = pickle.loads(blob)
    assert restored.learning_rate == args.learning_rate
    with pytest.raises(ValueError, match="(?s)unpickled without their secrets.*token is <redacted>.*TRAHIV_AUTH_TOKEN"):
        restored.hivemind  # noqa: B018
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="token is <redacted>"):
        Trainer(model=model, args=restored)  # refuses before starting anything
    monkeypatch.setenv(TOKEN_ENV, TOKEN)  # given again: the unpickled arguments work
    assert pickle.loads(blob).hivemind.auth.token.get_secret_value() == TOKEN


def test_token_from_file_or_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    from_file = make_args(tmp_path, swarm_config(token_file=str(token_file)))
    assert from_file.hivemind.auth.token.get_secret_value() == TOKEN
    assert pickle.loads(pickle.dumps(from_file)).hivemind.auth.token.get_secret_value() == TOKEN  # read again
    with pytest.raises(ValueError, match=f"no token given.*{TOKEN_ENV}"):
        HivemindConfig.load(swarm_config())
    with pytest.raises(ValueError, match="either token or token_file"):
        HivemindConfig.load(swarm_config(token=TOKEN, token_file=str(token_file)))
    with pytest.raises(ValueError, match="token_file .* cannot be read"):
        HivemindConfig.load(swarm_config(token_file=str(tmp_path / "missing")))
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    from_env = make_args(tmp_path, swarm_config())
    assert from_env.hivemind.auth.token.get_secret_value() == TOKEN
    assert TOKEN not in from_env.to_json_string()


def test_checkpoints_logs_and_tracker_files_hold_no_token(tmp_path, caplog):
    """A plain transformers.Trainer (no swarm) with trahiv's arguments: it logs the arguments, writes TensorBoard's
    hparams and a checkpoint with training_args.bin; none of it may contain the token."""
    args = make_args(
        tmp_path,
        swarm_config(token=TOKEN),
        max_steps=1,
        per_device_train_batch_size=2,
        save_strategy="steps",
        save_steps=1,
        report_to=["tensorboard"],
        disable_tqdm=True,
    )
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64))
    data = [{"input_ids": torch.arange(8) % 64, "labels": torch.arange(8) % 64} for _ in range(4)]
    with caplog.at_level(logging.DEBUG):
        logging.getLogger("trahiv").info("Training/evaluation parameters %s", args)  # as run_clm.py logs them
        transformers.Trainer(model=model, args=args, train_dataset=data).train()
    files = [p for p in (tmp_path / "out").rglob("*") if p.is_file()]
    assert any(p.name == "training_args.bin" for p in files) and any("tfevents" in p.name for p in files)
    for path in files:
        assert TOKEN.encode() not in path.read_bytes(), f"the token leaks in {path.relative_to(tmp_path)}"
    assert TOKEN not in caplog.text
    saved = torch.load(next(p for p in files if p.name == "training_args.bin"), weights_only=False)
    assert saved.to_dict()["hivemind_config"]["auth"]["token"] == REDACTED
