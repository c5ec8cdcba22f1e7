"""Drop-in `Trainer` and `TrainingArguments`: one `hivemind_config` turns a Trainer script into a swarm peer.

Without `hivemind_config` both behave exactly like transformers'. With it:
- the optimizer the Trainer would build (``optim``, learning rate, weight-decay groups) runs inside hivemind.Optimizer,
  and the LR schedule advances once per *collaborative* step, inside hivemind;
- ``state.global_step`` is the collaborative step: ``max_steps``, ``logging_steps``, ``save_steps``, checkpoint names
  and resume all count collaborative steps;
- each peer shuffles its data with a seed derived from its identity;
- Ctrl+C / SIGTERM leave the swarm cleanly.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from transformers.trainer_callback import DefaultFlowCallback, IntervalStrategy, SaveStrategy
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from trahiv.config import HivemindConfig, redact

logger = logging.getLogger("trahiv.trainer")

__all__ = ["CollaborativeFlowCallback", "Trainer", "TrainingArguments"]


@dataclass
class TrainingArguments(transformers.TrainingArguments):
    """transformers.TrainingArguments plus `hivemind_config` (a dict, a JSON string, or a JSON/YAML file path)."""

    hivemind_config: dict | str | None = field(
        default=None,
        repr=False,  # a dataclass-made repr (subclasses) must not show the token: see `__str__`
        metadata={
            "help": 'Join a swarm: {"dht": {hivemind.DHT kwargs}, "opt": {"run_id": ..., "target_batch_size": ..., '
            "other hivemind.Optimizer kwargs}}, as a dict, a JSON string or the path of a JSON/YAML file."
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self._hivemind_error: str | None = None
        self._hivemind = None if self.hivemind_config is None else HivemindConfig.load(self.hivemind_config)
        if self._hivemind is not None:
            # Local data order is per-peer random and unrelated to the collaborative step: never skip batches.
            self.ignore_data_skip = True

    @property
    def hivemind(self) -> HivemindConfig | None:
        """The parsed, validated `hivemind_config` (None when training alone)."""
        error = getattr(self, "_hivemind_error", None)
        if error is not None:  # unpickled without its token (see __setstate__)
            raise ValueError(error)
        return self._hivemind

    # --- secrets stay in this process: the auth token is redacted wherever the arguments leave it ------------

    def __str__(self) -> str:
        return _redacted_str(self)

    __repr__ = __str__

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        if "hivemind_config" in d:
            d["hivemind_config"] = redact(self.hivemind_config)
        return d

    def __getstate__(self) -> dict[str, Any]:
        """Pickles (the Trainer's training_args.bin) hold the config with its token redacted."""
        state = dict(self.__dict__)
        state["hivemind_config"] = redact(self.hivemind_config)
        state["_hivemind"] = None
        return state

    def __reduce_ex__(self, protocol: Any) -> Any:
        base = type(self).__dict__.get("_trahiv_base")
        if base is None:
            return super().__reduce_ex__(protocol)
        from trahiv.dropin import rebuild_args  # a class made by trahiv.collaborative_args(base): made again

        return rebuild_args, (base, self.__getstate__())

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._hivemind_error = None
        if self.hivemind_config is not None:  # the token again from token_file / TRAHIV_AUTH_TOKEN, if it can be
            try:
                self._hivemind = HivemindConfig.load(self.hivemind_config)
            except ValueError as e:
                self._hivemind_error = f"these TrainingArguments were unpickled without their secrets: {e}"

    def __copy__(self) -> TrainingArguments:
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def __deepcopy__(self, memo: dict[int, Any]) -> TrainingArguments:  # in-process copies keep the token
        new = object.__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update({k: copy.deepcopy(v, memo) for k, v in self.__dict__.items()})
        return new


def _redacted_str(args: transformers.TrainingArguments) -> str:
    """transformers' `TrainingArguments.__str__` (every field, `*_token` hidden) with `hivemind_config` redacted."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
    values = {k: f"<{k.upper()}>" if k.endswith("_token") else v for k, v in values.items()}
    if "hivemind_config" in values:
        values["hivemind_config"] = redact(values["hivemind_config"])
    lines = [f"{k}={v},\n" for k, v in sorted(values.items())]
    return f"{type(args).__name__}(\n{''.join(lines)})"


class SwarmScheduler:
    """What the Trainer sees as its LR scheduler: the real schedule lives inside hivemind and advances once per
    collaborative step, so `step()` here does nothing; state and current LR come from hivemind's scheduler."""

    def __init__(self, optimizer: Any):
        self.optimizer = optimizer

    def step(self, *args: Any, **kwargs: Any) -> None:
        return None

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.opt.param_groups]

    def state_dict(self) -> dict[str, Any]:
        inner = self.optimizer.state_averager.scheduler
        return {} if inner is None else inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from trahiv.engine.state import catch_up_scheduler

        inner = self.optimizer.state_averager.scheduler
        if inner is not None and state_dict:
            inner.load_state_dict(state_dict)
            catch_up_scheduler(self.optimizer)  # with the restored collaborative step


class PeerShuffleSampler(torch.utils.data.Sampler[int]):
    """A new random order every epoch, seeded by the peer's identity, so peers do not read the data in one order.
    (Not a RandomSampler: accelerate would replace that with one seeded like every other peer's.)"""

    def __init__(self, size: int, seed: int):
        self.size, self.seed, self.epoch = size, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.size

    def __iter__(self):
        generator = torch.Generator().manual_seed((self.seed + self.epoch) % 2**63)
        return iter(torch.randperm(self.size, generator=generator).tolist())


class CollaborativeFlowCallback(DefaultFlowCallback):
    """DefaultFlowCallback over collaborative steps: logs, saves, evaluates and stops by the swarm's step."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.last_step = 0

    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self.trainer
        swarm = trainer.swarm
        opt = swarm.optimizer
        if state.global_step > opt.local_epoch:  # resumed from a checkpoint saved by this trainer
            from trahiv.engine.state import set_step

            set_step(opt, state.global_step)
        swarm.mark_ready()
        swarm.wait_for_peers()
        swarm.catch_up()
        state.global_step = self.last_step = opt.local_epoch
        state.max_steps = trainer.collaborative_max_steps
        state.compute_steps(args, state.max_steps)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        trainer, step = self.trainer, self.trainer.swarm.optimizer.local_epoch
        trainer.local_steps_since_log += 1
        trainer.local_steps_total += 1
        trainer.local_steps_since_record += 1
        last, self.last_step = self.last_step, step
        state.global_step = step
        trainer.swarm.publish_model()
        if step > last:
            trainer.publish_metrics()
            trainer.step_overheads_pending = True  # left out of this peer's throughput (`_maybe_log_save_evaluate`)

        def crossed(every: int) -> bool:
            return every > 0 and step // every > last // every

        if step > last:
            if (last == 0 and args.logging_first_step) or (
                args.logging_strategy == IntervalStrategy.STEPS and crossed(state.logging_steps)
            ):
                control.should_log = True
            if args.eval_strategy == IntervalStrategy.STEPS and crossed(state.eval_steps) and args.eval_delay <= step:
                control.should_evaluate = True
            if args.save_strategy == SaveStrategy.STEPS and crossed(state.save_steps):
                control.should_save = True
        if step >= state.max_steps:
            control.should_training_stop = True
            if args.save_strategy == SaveStrategy.STEPS and step > last:
                control.should_save = True
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self.trainer.swarm.optimizer.serve_late_peers()  # (not after an interruption: called only at the end)
        return control


class Trainer(transformers.Trainer):
    """transformers.Trainer that trains with a swarm when `args.hivemind_config` is set."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.swarm = None
        self.collaborative_max_steps = 0
        self.local_steps_since_log = self.local_steps_total = self.local_steps_since_record = 0
        self.step_overheads_pending = False  # a collaborative step ended: its bookkeeping is not a batch's time
        self._loss_since_record: torch.Tensor | None = None  # summed on the device: no sync per local step
        config: HivemindConfig | None = getattr(self.args, "hivemind", None)
        if config is None:
            return
        if self.optimizer is not None or self.lr_scheduler is not None:
            raise ValueError(
                "hivemind_config cannot be combined with Trainer(optimizers=(optimizer, scheduler)): the swarm builds "
                "its optimizer from factories. Choose it with TrainingArguments(optim=...) or "
                "Trainer(optimizer_cls_and_kwargs=(cls, kwargs)), and the schedule with lr_scheduler_type."
            )
        if config.opt.reuse_grad_buffers and config.diloco is None:
            raise ValueError(
                'hivemind_config["opt"]["reuse_grad_buffers"] = True cannot work in a Trainer: hivemind would sum the '
                "local steps' gradients in .grad, and the Trainer zeroes .grad after every local step (only the last "
                "one's would be averaged). Leave it False (the default)"
            )
        from trahiv.swarm import Swarm, model_fingerprint  # starts the engine only for swarm peers

        self.swarm = swarm = Swarm(config)
        if swarm.metrics_publisher is not None:
            from trahiv.metrics import device_kind

            swarm.metrics_publisher.device = device_kind(self.args.device)
        try:
            model: Any = self.model
            tensors = [p for group in self._parameter_groups(model) for p in group["params"]]  # the swarm's order
            optimizer = None  # [DiLoCo] the inner optimizer is each peer's own: its state never travels
            if config.diloco is None:
                cls = (self.optimizer_cls_and_kwargs or self.get_optimizer_cls_and_kwargs(self.args, model))[0]
                optimizer = f"{cls.__module__}.{cls.__qualname__}"
            swarm.check_model(model_fingerprint(model.named_parameters(), tensors, optimizer))
        except BaseException:
            swarm.shutdown()
            raise
        use_peer_seed = getattr(self.train_dataset, "use_peer_seed", None)
        if callable(use_peer_seed):  # a trahiv.data stream without an explicit seed shuffles by this peer's identity
            use_peer_seed(swarm.peer_seed(self.args.seed))
        handler = self.callback_handler
        flow: DefaultFlowCallback = CollaborativeFlowCallback(self)
        if config.diloco is not None:  # [DiLoCo] state.global_step counts inner steps
            from trahiv.diloco import DiLoCoFlowCallback

            flow = DiLoCoFlowCallback(self)
        handler.callbacks = [flow if isinstance(cb, DefaultFlowCallback) else cb for cb in handler.callbacks]

    # --- lifecycle ------------------------------------------------------------------------------------------

    def train(self, *args: Any, **kwargs: Any):
        if self.swarm is None:
            return super().train(*args, **kwargs)
        from trahiv.engine import interrupt_on_signals
        from trahiv.swarm import SwarmLostError

        with interrupt_on_signals():
            try:
                return super().train(*args, **kwargs)
            except SwarmLostError as error:
                raise self._save_after_losing_the_swarm(error) from None
            finally:
                self.swarm.shutdown()

    def _save_after_losing_the_swarm(self, error: Exception) -> Exception:
        """An engine process ended under this peer (`SwarmLostError`): save its training state as a checkpoint, as
        `save_strategy` would, so that the steps it trained since its last one are not lost. Not when that state may
        be half updated (the loss interrupted a step's update: `whole_step`) or `save_strategy` is 'no'. The error
        returned says where the checkpoint is, or why there is none."""
        assert self.swarm is not None and self.model is not None
        if self.args.save_strategy == SaveStrategy.NO:
            return error
        opt = self.swarm.diloco if self.swarm.diloco is not None else self.swarm.optimizer
        if opt is None:  # (lost before training began)
            return error
        step = opt.whole_step()
        if step is None:
            return type(error)(f"{error}. Its training state was not saved as a checkpoint: the engine process ended "
                               "while this peer was updating its weights")  # fmt: skip
        if step == 0:
            return error
        folder = os.path.join(self._get_output_dir(trial=None), f"{PREFIX_CHECKPOINT_DIR}-{step}")
        if not os.path.isdir(folder):  # (else saved at this step already, by `save_steps`)
            self.state.global_step = step  # (the Trainer counts a step once its flow callback has run)
            try:
                self._save_checkpoint(self.model, trial=None)
            except Exception as e:  # the original error is what the user must see
                logger.warning(f"Could not save this peer's training state at step {step}: {e!r}")
                return error
        return type(error)(f"{error}. Its training state at step {step} is saved in {folder}: "
                           f"resume_from_checkpoint={folder!r} continues from it")  # fmt: skip

    def samples_per_local_step(self) -> int:
        world = max(self.args.world_size, 1)
        return self.args.per_device_train_batch_size * self.args.gradient_accumulation_steps * world

    def set_initial_training_values(self, args, dataloader, *rest, **kwargs):
        if self.swarm is None or config_of(self).diloco is not None:  # [DiLoCo] max_steps counts inner steps
            return super().set_initial_training_values(args, dataloader, *rest, **kwargs)
        self.collaborative_max_steps = self._collaborative_max_steps(dataloader)
        target = config_of(self).opt.target_batch_size
        # The local loop must be able to run until the swarm reaches max_steps: at worst this peer trains alone.
        local_budget = 2 * self.collaborative_max_steps * math.ceil(target / self.samples_per_local_step()) + 10
        user_max_steps, args.max_steps = args.max_steps, local_budget
        try:
            return super().set_initial_training_values(args, dataloader, *rest, **kwargs)
        finally:
            args.max_steps = user_max_steps

    def _collaborative_max_steps(self, dataloader) -> int:
        if self.args.max_steps > 0:
            return self.args.max_steps
        dataset = getattr(dataloader, "dataset", None)
        if dataset is None or not hasattr(dataset, "__len__"):
            raise ValueError("with hivemind_config and a dataset without length, set max_steps (collaborative steps)")
        # an epoch is the swarm processing the whole dataset once
        return max(1, math.ceil(self.args.num_train_epochs * len(dataset) / config_of(self).opt.target_batch_size))

    # --- optimizer and schedule ---------------------------------------------------------------------------------

    def create_optimizer(self, model=None):
        if self.swarm is None or self.optimizer is not None:
            return super().create_optimizer(model)
        opt_model = self.model if model is None else model
        groups = self._parameter_groups(opt_model)
        if self.optimizer_cls_and_kwargs is not None:
            optimizer_cls, optimizer_kwargs = self.optimizer_cls_and_kwargs
        else:
            optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
        special = {"params", "model", "optimizer_dict"} & set(optimizer_kwargs)
        if special:
            raise ValueError(f"optim={self.args.optim!r} builds its own parameter list ({special}); not supported")
        if config_of(self).diloco is None:  # [DiLoCo] outer copies are fp32 whatever the dtype
            self._check_dtypes(groups)
        max_steps, args = self.collaborative_max_steps, self.args
        full_precision = _embedding_positions(opt_model, groups) if _is_8bit(optimizer_cls, optimizer_kwargs) else []

        def make_optimizer(param_groups):
            optimizer = optimizer_cls(param_groups, **optimizer_kwargs)
            if full_precision:  # as transformers does: embeddings keep 32-bit optimizer states
                _keep_32bit_states(optimizer, full_precision)
            return optimizer

        def make_scheduler(optimizer):
            return transformers.get_scheduler(
                args.lr_scheduler_type,
                optimizer=optimizer,
                num_warmup_steps=args.get_warmup_steps(max_steps),
                num_training_steps=max_steps,
                scheduler_specific_kwargs=args.lr_scheduler_kwargs,
            )

        if config_of(self).diloco is not None:  # [DiLoCo] the Trainer's optimizer runs locally, synced every H steps
            from trahiv.diloco import DiLoCoOptimizer

            self.optimizer = DiLoCoOptimizer(self.swarm, groups, make_optimizer, self.samples_per_local_step())
            return self.optimizer
        self.optimizer = self.swarm.make_optimizer(
            groups, make_optimizer, make_scheduler, self.samples_per_local_step()
        )
        # fp16: the Trainer's own GradScaler unscales each local step's gradients (and skips a step that overflowed)
        # before the swarm's optimizer accumulates them, as with any optimizer. hivemind.GradScaler is for
        # reuse_grad_buffers, which a Trainer peer refuses (see __init__); with it, the swarm would average scaled
        # gradients and the Trainer would clip them scaled (tests/test_fp16_scaler.py)
        return self.optimizer

    def _parameter_groups(self, model: torch.nn.Module) -> list[dict[str, Any]]:
        """The Trainer's weight-decay groups, over trainable parameters only (PEFT: the adapters)."""
        decay = set(self.get_decay_parameter_names(model))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]
        groups = [g for g in groups if g["params"]]
        if not groups:
            raise ValueError("the model has no trainable parameters (requires_grad=True): nothing to train together")
        return groups

    def _check_dtypes(self, groups: list[dict[str, Any]]) -> None:
        dtypes = {p.dtype for g in groups for p in g["params"]}
        opt = config_of(self).opt
        if torch.bfloat16 in dtypes and opt.offload_optimizer:
            raise ValueError(
                "bf16 trainable parameters cannot be offloaded by hivemind 1.1.12: set "
                'hivemind_config["opt"]["offload_optimizer"] = False, or keep trainable weights in float32 '
                "(TrainingArguments(bf16=True) with float32 weights works: autocast computes in bf16)"
            )
        # hivemind's fp16 codecs refuse bf16 tensors (a sender's error, and the round fails at its deadline), and
        # size_adaptive sends tensors under 2^16 values in fp16
        fields = ("grad_compression", "state_averaging_compression", "load_state_compression")
        fp16 = [f"{field}={getattr(opt, field)!r}" for field in fields if getattr(opt, field) in FP16_CODECS]
        if torch.bfloat16 in dtypes and fp16:
            raise ValueError(
                f"bf16 trainable parameters cannot travel in fp16 ({', '.join(fp16)}; size_adaptive sends small "
                "tensors in fp16): use 'uniform8bit', 'blockwise8bit' or 'none'"
            )

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if self.swarm is None or config_of(self).diloco is not None:  # [DiLoCo] the Trainer's own, local schedule
            return super().create_scheduler(num_training_steps, optimizer)
        if self.lr_scheduler is None:
            self.lr_scheduler = SwarmScheduler(self.swarm.optimizer)  # type: ignore[assignment]
        return self.lr_scheduler

    # --- data -------------------------------------------------------------------------------------------------

    def _get_train_sampler(self, train_dataset=None):
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        strategy = getattr(self.args, "train_sampling_strategy", "random")
        if self.swarm is None or dataset is None or not hasattr(dataset, "__len__") or strategy != "random":
            return super()._get_train_sampler(train_dataset)
        return PeerShuffleSampler(len(dataset), seed=self.swarm.peer_seed(self.args.seed))

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batch_samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self.swarm is not None and self.swarm.optimizer is not None:
            samples = sum(_batch_len(batch) for batch in batch_samples) * max(self.args.world_size, 1)
            self.swarm.optimizer.pending_batch_size = samples or None
        return batch_samples, num_items

    # --- logging ----------------------------------------------------------------------------------------------

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        loss = super().training_step(*args, **kwargs)
        if self.swarm is not None:  # per micro-batch: their sum over a local step is the loss the Trainer logs
            total = self._loss_since_record
            self._loss_since_record = loss.detach() if total is None else total + loss.detach()
        return loss

    def publish_metrics(self) -> None:
        """Publish this peer's metrics record for the collaborative step just reached (see trahiv.metrics)."""
        if self.swarm is None:
            return
        total, steps = self._loss_since_record, self.local_steps_since_record
        loss = float(total) / steps if total is not None and steps > 0 else None
        self._loss_since_record, self.local_steps_since_record = None, 0
        self.swarm.publish_metrics(loss)

    def _maybe_log_save_evaluate(self, tr_loss, *args: Any, **kwargs: Any):
        if self.swarm is not None and self.control.should_log and self.local_steps_since_log > 0:
            # the Trainer divides the summed loss by the steps since the last log: count local steps, not swarm steps
            self._globalstep_last_logged = self.state.global_step - self.local_steps_since_log
            self.local_steps_since_log = 0
        result = super()._maybe_log_save_evaluate(tr_loss, *args, **kwargs)
        if self.swarm is not None and self.swarm.optimizer is not None and self.step_overheads_pending:
            # the collaborative step's own costs (metrics, log, evaluation, checkpoint) are not a batch's
            self.step_overheads_pending = False
            self.swarm.optimizer.tracker.skip_time_until_now()
        return result

    def _finalize_training(self, *args: Any, **kwargs: Any):
        if self.swarm is not None:  # train_loss averages local steps (the loss is summed per local step)
            self._initial_global_step = self.state.global_step - self.local_steps_total
            if self.swarm.optimizer is not None:  # [background mode] the model train() returns has the last update
                self.swarm.optimizer.finish_background_update()
        return super()._finalize_training(*args, **kwargs)

    def _save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        if self.swarm is not None and self.swarm.optimizer is not None:  # [background mode] the step's own weights
            self.swarm.optimizer.finish_background_update()
        return super()._save_checkpoint(*args, **kwargs)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if self.swarm is not None:
            logs = {**logs, **self.swarm.metrics()}
        super().log(logs, *args, **kwargs)


FP16_CODECS = frozenset({"fp16", "scaled_fp16", "size_adaptive"})  # compressions that send some tensors in fp16


def _is_8bit(optimizer_cls: Any, optimizer_kwargs: dict[str, Any]) -> bool:
    is_bnb = "bitsandbytes" in str(optimizer_cls)
    return is_bnb and (optimizer_kwargs.get("optim_bits") == 8 or optimizer_cls.__name__.endswith("8bit"))


def _embedding_positions(model: torch.nn.Module, groups: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """(group, index) of embedding weights in the optimizer's parameter groups."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    return [(g, i) for g, group in enumerate(groups) for i, p in enumerate(group["params"]) if id(p) in embeddings]


def _keep_32bit_states(optimizer: Any, positions: list[tuple[int, int]]) -> None:
    """32-bit states for the parameters at `positions` (group, index) of a bitsandbytes 8-bit optimizer that has not
    stepped yet (states are made at the first step).

    bitsandbytes keeps such overrides in one process-wide manager, keyed by tensor id and by (group, index), and never
    forgets them: a second optimizer in the same process (another Trainer, a notebook cell run again) would inherit
    them, by position or by a reused id, and keep some other tensor's states in 32 bits. This optimizer gets a manager
    of its own, holding only its overrides."""
    import bitsandbytes as bnb

    manager = object.__new__(bnb.optim.GlobalOptimManager)  # its __init__ refuses: get_instance() makes the global one
    manager.initialize()
    for position in positions:
        manager.index2config[position] = {"optim_bits": 32}
    optimizer.mng = manager


def config_of(trainer: Trainer) -> HivemindConfig:
    """The swarm configuration of a trainer that trains with a swarm."""
    config = getattr(trainer.args, "hivemind", None)
    if config is None:
        raise RuntimeError("this Trainer has no hivemind_config")
    return config


def _batch_len(batch: Any) -> int:
    if isinstance(batch, dict) or hasattr(batch, "values"):
        for value in batch.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                return int(value.shape[0])
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], torch.Tensor):
        return int(batch[0].shape[0])
    return 0
