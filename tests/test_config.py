"""hivemind_config is parsed strictly before anything starts; without it, the Trainer is transformers' own."""

from __future__ import annotations

import json
import sys

import pytest

from trahiv.config import HivemindConfig

PEER = "/ip4/127.0.0.1/tcp/42749/p2p/12D3KooWMEGSxULAnyzgdnsfDLBV5wjy7CThowe4rVoRqrYEy5Rv"


def cfg(**opt):
    return {"dht": {}, "opt": {"run_id": "run", "target_batch_size": 100, **opt}}


def test_valid_config_keeps_engine_defaults():
    config = HivemindConfig.load({"opt": {"run_id": "spanish_qlora", "target_batch_size": 100, "verbose": True}})
    assert config.opt.target_batch_size == 100 and config.opt.verbose
    assert config.dht.kwargs()["host_maddrs"] == ["/ip4/127.0.0.1/tcp/0"]
    assert "bootstrap_timeout" not in config.dht.kwargs()  # unset: the engine's own default applies
    assert config.opt.allreduce == "auto" and config.opt.gradient_allreduce == "ring"


@pytest.mark.parametrize(
    ("opt", "expected"),
    [
        ({}, "ring"),
        ({"allreduce": "butterfly"}, "butterfly"),
        ({"aggregation": {"name": "centered_clip"}}, "butterfly"),  # CenteredClip needs every copy at one reducer
        ({"power_sgd_rank": 4}, "butterfly"),  # PowerSGD runs its own rounds
    ],
)
def test_gradient_rounds_run_as_a_ring_unless_something_needs_the_butterfly(opt, expected):
    config = HivemindConfig.load({"opt": {"run_id": "r", "target_batch_size": 8, **opt}})
    assert config.opt.gradient_allreduce == expected


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (cfg(target_batchsize=5), "did you mean 'target_batch_size'"),
        ({"dht": {"initial_peer": [PEER]}, "opt": cfg()["opt"]}, "did you mean 'initial_peers'"),
        ({"dht": {}, "optt": cfg()["opt"]}, "did you mean 'opt'"),
        ({"opt": {"target_batch_size": 100}}, "opt.run_id: Field required"),
        ({"dht": {}}, "opt: Field required"),
        (cfg(target_batch_size=0), "greater than 0"),
        (cfg(target_batch_size="many"), "opt.target_batch_size"),
        (cfg(run_id="has space"), "run_id 'has space'"),
        (cfg(grad_compression="zip"), "opt.grad_compression"),
        (cfg(delay_state_averaging=True), "delay_state_averaging=True is refused"),
        (cfg(allreduce="rings"), "opt.allreduce"),
        (cfg(allreduce="ring", aggregation={"name": "centered_clip"}), "allreduce 'ring' cannot be combined with"),
        (cfg(allreduce="ring", power_sgd_rank=4), "allreduce 'ring' cannot be combined with power_sgd_rank"),
        ({"dht": {"initial_peers": ["127.0.0.1:4000"]}, "opt": cfg()["opt"]}, "malformed multiaddr '127.0.0.1:4000'"),
        ({"dht": {"initial_peers": ["/ip4/127.0.0.1/tcp/4000"]}, "opt": cfg()["opt"]}, "no /p2p/<peer id>"),
        ({"dht": {"host_maddrs": ["/ip4/1.2.3.4/tcpp/0"]}, "opt": cfg()["opt"]}, "Unknown Protocol"),
        ("not-a-file.yaml", "neither a dict, a JSON string, nor an existing file"),
        ([1, 2], "must be a mapping"),
    ],
)
def test_bad_config_fails_with_clear_error(config, expected):
    with pytest.raises(ValueError, match=None) as error:
        HivemindConfig.load(config)
    assert expected in str(error.value), str(error.value)


def test_config_from_json_yaml_and_json_string(tmp_path):
    data = {"dht": {"initial_peers": [PEER]}, "opt": {"run_id": "run", "target_batch_size": 64}}
    (tmp_path / "swarm.json").write_text(json.dumps(data))
    (tmp_path / "swarm.yaml").write_text(
        f"dht:\n  initial_peers: ['{PEER}']\nopt:\n  run_id: run\n  target_batch_size: 64\n"
    )
    loaded = [
        HivemindConfig.load(tmp_path / "swarm.json"),
        HivemindConfig.load(str(tmp_path / "swarm.yaml")),
        HivemindConfig.load(json.dumps(data)),
    ]
    assert all(c == loaded[0] for c in loaded) and loaded[0].dht.initial_peers == [PEER]


def test_training_arguments_validate_at_construction(tmp_path):
    from trahiv import TrainingArguments

    with pytest.raises(ValueError, match="did you mean 'target_batch_size'"):
        TrainingArguments(output_dir=str(tmp_path), hivemind_config=cfg(target_batchsize=5), report_to=[])
    args = TrainingArguments(output_dir=str(tmp_path), hivemind_config=cfg(), report_to=[])
    assert args.hivemind.opt.run_id == "run" and args.ignore_data_skip
    assert TrainingArguments(output_dir=str(tmp_path), report_to=[]).hivemind is None


def test_hf_argument_parser_reads_hivemind_config_from_command_line(tmp_path):
    from transformers import HfArgumentParser

    from trahiv import TrainingArguments

    (tmp_path / "swarm.yaml").write_text("opt:\n  run_id: cli_run\n  target_batch_size: 32\n")
    parser = HfArgumentParser(TrainingArguments)
    for value in (str(tmp_path / "swarm.yaml"), json.dumps(cfg(run_id="cli_run", target_batch_size=32))):
        (args,) = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--hivemind_config", value])
        assert args.hivemind.opt.run_id == "cli_run" and args.hivemind.opt.target_batch_size == 32


def test_without_hivemind_config_trainer_is_transformers(tmp_path, workdir):
    """Same seed, same data: trahiv.Trainer without hivemind_config gives exactly transformers' losses."""
    import transformers

    import trahiv
    from trahiv.demo import BlockDataset

    losses = []
    for trainer_cls, args_cls in (
        (transformers.Trainer, transformers.TrainingArguments),
        (trahiv.Trainer, trahiv.TrainingArguments),
    ):
        transformers.set_seed(0)
        model = transformers.AutoModelForCausalLM.from_pretrained(workdir / "model")
        args = args_cls(
            output_dir=str(tmp_path / trainer_cls.__module__),
            max_steps=3,
            per_device_train_batch_size=4,
            logging_steps=1,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            disable_tqdm=True,
            seed=0,
        )
        trainer = trainer_cls(model=model, args=args, train_dataset=BlockDataset.load(workdir / "blocks.pt"))
        trainer.train()
        losses.append([row["loss"] for row in trainer.state.log_history if "loss" in row])
    assert losses[0] == losses[1] and len(losses[0]) == 3


def test_import_is_cheap():
    """`import trahiv` loads neither torch, transformers nor the engine."""
    import subprocess

    code = "import sys, trahiv; print(sorted(m for m in ('torch', 'transformers', 'hivemind') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
