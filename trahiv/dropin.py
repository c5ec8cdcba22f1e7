"""Make any `transformers.Trainer` subclass collaborative: `collaborative(TrainerCls)`, `collaborative_args(ArgsCls)`.

    from trl import ORPOTrainer, ORPOConfig            # or your own Trainer / TrainingArguments subclasses
    import trahiv

    ORPOConfig = trahiv.collaborative_args(ORPOConfig)   # ORPOConfig + hivemind_config (secrets redacted)
    ORPOTrainer = trahiv.collaborative(ORPOTrainer, args_cls=ORPOConfig)

Each returns a real subclass: `class X(ArgsCls, trahiv.TrainingArguments)` and `class X(TrainerCls, trahiv.Trainer)`,
so the library's own behaviour stays (its `__post_init__`, `compute_loss`, `log`, ... run first and reach trahiv's
through `super()`), and `hivemind_config` joins the swarm. A subclass method that replaces one of trahiv's without
calling `super()` (`create_optimizer`, `create_scheduler`, `training_step`, `log`, `_get_train_sampler`) takes the
swarm out of that step: keep such overrides calling `super()`. Both functions return the same class for the same
input, and pickled arguments (training_args.bin) load back into it. trahiv.trl and trahiv.seq2seq are this applied.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

import transformers

from trahiv.trainer import Trainer, TrainingArguments

__all__ = ["collaborative", "collaborative_args"]

_TRAINERS: dict[tuple[type, type | None], type] = {}  # one class per input


@functools.cache
def collaborative_args(args_cls: type) -> type:
    """`args_cls` (a transformers.TrainingArguments subclass) plus `hivemind_config`, as a dataclass subclass."""
    if not (isinstance(args_cls, type) and issubclass(args_cls, transformers.TrainingArguments)):
        raise TypeError(f"collaborative_args needs a transformers.TrainingArguments subclass, got {args_cls!r}")
    if issubclass(args_cls, TrainingArguments):
        return args_cls
    namespace = {
        "__module__": args_cls.__module__,
        "__qualname__": args_cls.__qualname__,
        "__doc__": f"{args_cls.__name__} plus `hivemind_config` (trahiv): see trahiv.TrainingArguments.",
        "__str__": TrainingArguments.__str__,  # (the library's dataclass repr would list the token)
        "__repr__": TrainingArguments.__str__,
        "_trahiv_base": args_cls,
    }
    return dataclasses.dataclass(type(args_cls.__name__, (args_cls, TrainingArguments), namespace))


def collaborative(trainer_cls: type, args_cls: type | None = None) -> type:
    """`trainer_cls` (a transformers.Trainer subclass) that trains with a swarm when its arguments have
    `hivemind_config`. With `args_cls` (made by `collaborative_args`), trahiv.TrainingArguments given as `args` are
    converted to it (libraries like TRL would otherwise rebuild them without `hivemind_config`)."""
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, transformers.Trainer)):
        raise TypeError(f"collaborative needs a transformers.Trainer subclass, got {trainer_cls!r}")
    if issubclass(trainer_cls, Trainer):
        return trainer_cls
    key = (trainer_cls, args_cls)
    if key not in _TRAINERS:
        _TRAINERS[key] = _make_trainer(trainer_cls, args_cls)
    return _TRAINERS[key]


def _make_trainer(trainer_cls: Any, args_cls: type | None) -> type:
    namespace: dict[str, Any] = {
        "__module__": trainer_cls.__module__,
        "__qualname__": trainer_cls.__qualname__,
        "__doc__": f"{trainer_cls.__name__} that trains with a swarm when `args.hivemind_config` is set (trahiv).",
    }
    made: dict[str, type] = {}
    if args_cls is not None:
        signature = inspect.signature(trainer_cls.__init__)

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            bound = signature.bind_partial(self, *args, **kwargs)
            given = bound.arguments.get("args")
            if isinstance(given, TrainingArguments) and not isinstance(given, args_cls):
                bound.arguments["args"] = convert_args(given, args_cls)
            parent: Any = super(made["cls"], self)  # the next class in the MRO (trainer_cls, ... then trahiv.Trainer)
            parent.__init__(*bound.args[1:], **bound.kwargs)

        __init__.__signature__ = signature  # type: ignore[attr-defined]
        __init__.__doc__ = trainer_cls.__init__.__doc__
        namespace["__init__"] = __init__
    made["cls"] = type(trainer_cls.__name__, (trainer_cls, Trainer), namespace)
    return made["cls"]


def convert_args(args: TrainingArguments, args_cls: type) -> Any:
    """`args` as an `args_cls` instance: every field they share, secrets included (in-process), the rest defaults."""
    wanted = {f.name for f in dataclasses.fields(args_cls) if f.init}
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init and f.name in wanted}
    return args_cls(**values)


def rebuild_args(base: type, state: dict[str, Any]) -> TrainingArguments:
    """Unpickle arguments of a class made by `collaborative_args(base)` (see TrainingArguments.__reduce_ex__)."""
    args: Any = object.__new__(collaborative_args(base))
    args.__setstate__(state)
    return args
