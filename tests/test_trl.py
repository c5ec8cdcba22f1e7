"""Drop-ins: trahiv.trl (TRL's SFT and DPO), trahiv.seq2seq, and `trahiv.collaborative` for any Trainer subclass."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import transformers
from swarm_helpers import Peer, start_bootstrap, start_peer

import trahiv
from trahiv.config import REDACTED

trl = pytest.importorskip("trl")
from trahiv.trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer  # noqa: E402

TOKEN = "trahiv-user-trl-secret-42"
SWARM = {"opt": {"run_id": "trl", "target_batch_size": 8}, "auth": {"server": "http://127.0.0.1:9", "token": TOKEN}}


def test_drop_ins_are_real_subclasses_and_keep_secrets(tmp_path):
    assert issubclass(SFTConfig, trl.SFTConfig) and issubclass(SFTConfig, trahiv.TrainingArguments)
    assert issubclass(SFTTrainer, trl.SFTTrainer) and issubclass(SFTTrainer, trahiv.Trainer)
    assert issubclass(DPOConfig, trl.DPOConfig) and issubclass(DPOTrainer, trl.DPOTrainer)
    assert issubclass(trahiv.Seq2SeqTrainer, transformers.Seq2SeqTrainer)
    assert issubclass(trahiv.Seq2SeqTrainingArguments, transformers.Seq2SeqTrainingArguments)
    assert trahiv.collaborative(trl.SFTTrainer, SFTConfig) is SFTTrainer  # one class per input
    for cls, extra in [(SFTConfig, {"max_length": 77}), (DPOConfig, {"beta": 0.3}),
                       (trahiv.Seq2SeqTrainingArguments, {"predict_with_generate": True})]:  # fmt: skip
        args = cls(output_dir=str(tmp_path), report_to=[], use_cpu=True, hivemind_config=SWARM, **extra)
        assert args.hivemind.opt.run_id == "trl" and all(getattr(args, k) == v for k, v in extra.items())
        for text in (str(args), repr(args), args.to_json_string(), str(args.to_sanitized_dict())):
            assert TOKEN not in text
        blob = pickle.dumps(args)
        assert TOKEN.encode() not in blob
        restored = pickle.loads(blob)
        assert type(restored) is cls and restored.to_dict()["hivemind_config"]["auth"]["token"] == REDACTED


def tiny_setup():
    from trahiv.demo import BLOCK_SIZE, corpus_text, tiny_gpt2_config, train_tokenizer

    tokenizer = train_tokenizer(corpus_text())
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(tiny_gpt2_config(vocab_size=len(tokenizer), n_embd=64, n_head=2))
    import datasets

    paragraphs = [p.strip() for p in corpus_text().split("\n\n") if p.strip()][:16]
    assert BLOCK_SIZE >= 64
    return tokenizer, model, datasets.Dataset.from_dict({"text": paragraphs})


def test_sft_alone_behaves_as_trl(tmp_path):
    """Without hivemind_config, trahiv.trl.SFTTrainer trains exactly as trl.SFTTrainer (same losses, same logs)."""
    histories = []
    for trainer_cls, config_cls in ((trl.SFTTrainer, trl.SFTConfig), (SFTTrainer, SFTConfig)):
        tokenizer, model, data = tiny_setup()
        args = config_cls(output_dir=str(tmp_path / trainer_cls.__module__), max_steps=3, per_device_train_batch_size=4,
                          max_length=64, bf16=False, use_cpu=True, report_to=[], logging_steps=1, save_strategy="no",
                          disable_tqdm=True, seed=3)  # fmt: skip
        trainer = trainer_cls(model=model, args=args, train_dataset=data, processing_class=tokenizer)
        trainer.train()
        histories.append([{k: v for k, v in row.items() if "runtime" not in k and "per_second" not in k}
                          for row in trainer.state.log_history])  # fmt: skip
    assert histories[0] == histories[1]
    assert "mean_token_accuracy" in histories[1][0]  # TRL's own metric: its log() ran


def test_plain_trahiv_arguments_are_converted_not_dropped(tmp_path):
    """trl.SFTTrainer rebuilds other arguments as its SFTConfig, which has no hivemind_config: the drop-in converts
    trahiv.TrainingArguments (with its token, in process) to trahiv.trl.SFTConfig instead."""
    from trahiv.dropin import convert_args

    args = trahiv.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, hivemind_config=SWARM)
    converted = convert_args(args, SFTConfig)
    assert isinstance(converted, SFTConfig) and converted.hivemind.auth.token.get_secret_value() == TOKEN
    with pytest.raises(TypeError, match="hivemind_config"):  # what TRL alone does with them
        trl.SFTConfig(**args.to_dict())


def start_trl_peer(tmp, name: str, **spec) -> Peer:
    """swarm_helpers.start_peer, with the TRL worker (forked from the warm fork server, as the other peers are)."""
    return start_peer(tmp, name, worker="trl_worker.py", **spec)


@pytest.mark.swarm
def test_two_sft_peers_with_lora_average_only_adapters(tmp_path, workdir):
    boot = start_bootstrap(tmp_path)
    common = dict(workdir=str(workdir), run_id="trl-sft", target=48, max_steps=3,
                  initial_peers=boot.initial_peers, opt={"min_peers": 2, "average_state_every": 1})  # fmt: skip
    try:  # (as tests/test_lora.py: several local steps per collaborative step, so that the peers average)
        a = start_trl_peer(tmp_path, "a", batch_size=8, **common)
        b = start_trl_peer(tmp_path, "b", batch_size=4, **common)
        ready = a.ready(timeout=180)
        done = [a.finish(), b.finish()]
    finally:
        boot.stop()
    final_a, final_b = (torch.load(p.out / "final.pt") for p in (a, b))
    initial = transformers.AutoModelForCausalLM.from_pretrained(workdir / "model").state_dict()
    adapters = [name for name in final_a if "lora_" in name]
    assert len(adapters) == 2 * 2  # lora_A and lora_B of c_attn in each of the 2 layers
    assert ready["averaged_tensors"] == len(adapters), "something besides the adapters is averaged"
    for name, value in final_a.items():
        if "lora_" in name:
            assert torch.allclose(value, final_b[name], atol=1e-6), f"{name} differs between peers"
        else:
            base_name = name.removeprefix("base_model.model.").replace(".base_layer", "")
            assert torch.equal(value, initial[base_name]) and torch.equal(final_b[name], initial[base_name])
    assert all(final_a[name].abs().sum() > 0 for name in adapters if "lora_B" in name), "the adapters did not train"
    for row in done:
        assert row["global_step"] == 3 and row["type"] == "trl.trainer.sft_trainer"
        assert row["averaging_rounds"]["complete"] > 0, row["averaging_rounds"]
        assert "mean_token_accuracy" in row["logged"] and "num_tokens" in row["logged"]  # TRL's logs, kept
    for peer in (a, b):  # a clean console (trahiv.console)
        assert "gemm_4bit_forward" not in peer.log() and "Task was destroyed" not in peer.log(), peer.log()[-3000:]


def test_collaborative_any_trainer_subclass(tmp_path):
    """A subclass without its own __init__ still runs trahiv.Trainer's (through the MRO), and its overrides stay."""

    class Custom(transformers.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            self.custom_calls = getattr(self, "custom_calls", 0) + 1
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    made = trahiv.collaborative(Custom, args_cls=trahiv.TrainingArguments)
    assert made.__mro__[1:4] == (Custom, trahiv.Trainer, transformers.Trainer)
    with pytest.raises(TypeError, match="transformers.Trainer subclass"):
        trahiv.collaborative(dict)
    _, model, _ = tiny_setup()
    args = trahiv.TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, report_to=[],
                                    use_cpu=True, save_strategy="no", disable_tqdm=True)  # fmt: skip
    data = [{"input_ids": torch.arange(8), "labels": torch.arange(8)} for _ in range(4)]
    trainer = made(model, args, train_dataset=data)  # positional args, as transformers.Trainer takes them
    assert trainer.swarm is None  # trahiv.Trainer.__init__ ran (alone: no hivemind_config)
    trainer.train()
    assert trainer.custom_calls >= 1


def test_dpo_alone_behaves_as_trl(tmp_path):
    """Without hivemind_config, trahiv.trl.DPOTrainer trains exactly as trl.DPOTrainer (same losses, same logs)."""
    import datasets

    pairs = {"prompt": ["The swarm", "A peer", "Volunteers"] * 2, "chosen": [" trains.", " joins.", " help."] * 2,
             "rejected": [" stops.", " crashes.", " leave."] * 2}  # fmt: skip
    histories = []
    for trainer_cls, config_cls in ((trl.DPOTrainer, trl.DPOConfig), (DPOTrainer, DPOConfig)):
        tokenizer, model, _ = tiny_setup()
        args = config_cls(output_dir=str(tmp_path / trainer_cls.__module__), max_steps=2, per_device_train_batch_size=2,
                          bf16=False, use_cpu=True, report_to=[], logging_steps=1, save_strategy="no",
                          disable_tqdm=True, seed=3)  # fmt: skip
        ref = copy.deepcopy(model)  # (a model built from a config has no Hub id to load the reference from)
        data = datasets.Dataset.from_dict(pairs)
        trainer = trainer_cls(model=model, ref_model=ref, args=args, train_dataset=data, processing_class=tokenizer)
        trainer.train()
        histories.append([{k: v for k, v in row.items() if "runtime" not in k and "per_second" not in k}
                          for row in trainer.state.log_history])  # fmt: skip
    assert histories[0] == histories[1]
    assert any("rewards/chosen" in row for row in histories[1])  # DPO's own metrics: its log() ran


@pytest.mark.swarm
def test_seq2seq_trains_with_a_swarm_and_generates(tmp_path):
    """trahiv.Seq2SeqTrainer: a tiny T5 trains as a (one-peer) swarm; predict_with_generate still generates."""
    config = transformers.T5Config(vocab_size=64, d_model=16, d_ff=32, d_kv=8, num_layers=1, num_heads=2,
                                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)  # fmt: skip
    model = transformers.T5ForConditionalGeneration(config)
    data = [{"input_ids": torch.arange(2, 10), "labels": torch.arange(10, 14)} for _ in range(8)]
    args = trahiv.Seq2SeqTrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, report_to=[], use_cpu=True,
        save_strategy="no", disable_tqdm=True, predict_with_generate=True,
        hivemind_config={"dht": {"nat_port_map": False}, "opt": {"run_id": "seq2seq", "target_batch_size": 4}},
    )  # fmt: skip
    trainer = trahiv.Seq2SeqTrainer(model=model, args=args, train_dataset=data)
    trainer.train()
    assert trainer.state.global_step == 2 and trainer.swarm is not None
    predictions = trainer.predict(data[:2]).predictions  # generated token ids (padded to the generation length)
    assert predictions.shape[0] == 2 and predictions.shape[1] > 1 and predictions.dtype.kind == "i"
