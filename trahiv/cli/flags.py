"""Command-line flags generated from the pydantic config models: one source for names, defaults and help text.

`add_flags(parser, Model)` adds `--field-name` for each field of `Model` (help: the field's `description` and its
default), and `FlagSet.build(args, base)` makes the model back from the parsed flags: `base` (e.g. the config file's
section) overridden only by the flags the user actually gave (the flags' argparse default is SUPPRESS, so an absent
flag leaves no attribute). A bad value fails through `trahiv.errors.explain_validation(..., as_flags=True)`: one
message naming the flag, exit code 2 (trahiv.cli.main). A field added to a model shows up on the command line without
touching the commands.

Field types: str, int, float (typed by argparse); bool -> `--x` / `--no-x`; list[str] -> several values; Literal ->
choices; Optional of these; any other union (e.g. `bool | Literal["auto"]`) is passed as text for pydantic to parse.
Dicts and nested sections get no flag unless named in `only` (then TypeError: give them a hand-written flag).
"""

from __future__ import annotations

import argparse
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, SecretStr, ValidationError
from pydantic_core import PydanticUndefined

__all__ = ["FlagSet", "add_flags", "flag_name"]


def flag_name(field_name: str, prefix: str = "") -> str:
    """`host_maddrs` -> `--host-maddrs` (with prefix "auth": `server` -> `--auth-server`)."""
    return "--" + "-".join(part for part in (prefix, field_name) if part).replace("_", "-")


@dataclass(frozen=True)
class FlagSet:
    """The flags `add_flags` generated for one model: field name -> flag (e.g. "--state-poll") and argparse dest."""

    model: type[BaseModel]
    flags: dict[str, str] = field(default_factory=dict)
    dests: dict[str, str] = field(default_factory=dict)

    def given(self, args: argparse.Namespace) -> dict[str, Any]:
        """The fields whose flags the user gave, with their parsed values."""
        return {name: getattr(args, dest) for name, dest in self.dests.items() if hasattr(args, dest)}

    def values(self, args: argparse.Namespace) -> dict[str, Any]:
        """Every field with a flag: the given value, else the field's default (no validation: see `build`)."""
        return {name: self.value(args, name) for name in self.dests}

    def value(self, args: argparse.Namespace, name: str) -> Any:
        """The flag's value if given, else the field's default (None if the field has none)."""
        if hasattr(args, self.dests[name]):
            return getattr(args, self.dests[name])
        info = self.model.model_fields[name]
        return None if info.is_required() else info.get_default(call_default_factory=True)

    def build(self, args: argparse.Namespace, base: dict[str, Any] | None = None, **fixed: Any) -> Any:
        """The model from `base`, overridden by the given flags, then by `fixed` (values the command decides).
        A ValidationError becomes one UserError naming the flags (exit code 2)."""
        from trahiv.errors import UserError, explain_validation

        try:
            return self.model.model_validate({**(base or {}), **self.given(args), **fixed})
        except ValidationError as e:
            raise UserError(explain_validation(_NamedAsFlags(e, self.flags), as_flags=True)) from None


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    model: type[BaseModel],
    *,
    only: tuple[str, ...] | None = None,
    exclude: tuple[str, ...] = (),
    prefix: str = "",
    rename: dict[str, str] | None = None,
    notes: dict[str, str] | None = None,
) -> FlagSet:
    """Add a flag for each field of `model` (or the fields in `only`), in the model's order.

    prefix: "auth" makes `--auth-server` of `server` (and dest `auth_server`). rename: field -> flag for the flags kept
    from before (e.g. {"poll_interval": "--state-poll"}). notes: field -> text appended to the help (what the command
    does beyond the model, e.g. "created if missing")."""
    rename, notes = rename or {}, notes or {}
    names = only if only is not None else tuple(n for n in model.model_fields if n not in exclude)
    flags = FlagSet(model)
    for name in names:
        info = model.model_fields[name]
        kwargs = _argparse_kwargs(model, name, info.annotation, explicit=only is not None)
        if kwargs is None:
            continue
        flag = rename.get(name) or flag_name(name, prefix)
        dest = flag.removeprefix("--").replace("-", "_")
        help_text = _help(info, notes.get(name), kwargs.get("action") is argparse.BooleanOptionalAction)
        parser.add_argument(flag, dest=dest, default=argparse.SUPPRESS, help=help_text, **kwargs)
        flags.flags[name], flags.dests[name] = flag, dest
    return flags


def _argparse_kwargs(model: type[BaseModel], name: str, annotation: Any, *, explicit: bool) -> dict[str, Any] | None:
    kind = _strip_optional(annotation)
    origin = typing.get_origin(kind)
    if kind is bool:
        return {"action": argparse.BooleanOptionalAction}
    if kind in (str, int, float):
        return {"type": kind}
    if origin is Literal:
        choices = typing.get_args(kind)
        return {"type": type(choices[0]), "choices": choices}
    if origin is list and typing.get_args(kind) in ((str,), (int,), (float,)):
        (item,) = typing.get_args(kind)
        return {"type": item, "nargs": "*"}
    if origin in (typing.Union, types.UnionType) and not _has_container(kind):
        return {"type": str, "metavar": "{" + ",".join(_union_choices(kind)) + "}"}  # pydantic parses the text
    if kind is SecretStr or not explicit:
        return None  # secrets stay off the command line (ps shows it); dicts and sections: the config file
    raise TypeError(f"{model.__name__}.{name} ({annotation}) has no generated flag: write one by hand")


def _strip_optional(annotation: Any) -> Any:
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args:
        rest = tuple(a for a in args if a is not type(None))
        return rest[0] if len(rest) == 1 else typing.Union[rest]  # noqa: UP007 (a runtime union of the rest)
    return annotation


def _has_container(kind: Any) -> bool:
    return any(typing.get_origin(a) in (list, dict) or isinstance(a, type) and issubclass(a, BaseModel)
               for a in typing.get_args(kind))  # fmt: skip


def _union_choices(kind: Any) -> list[str]:
    out: list[str] = []
    for arg in typing.get_args(kind):
        if arg is bool:
            out += ["true", "false"]
        elif typing.get_origin(arg) is Literal:
            out += [str(v) for v in typing.get_args(arg)]
        else:
            out.append(getattr(arg, "__name__", str(arg)).upper())
    return out


def _help(info: Any, note: str | None, is_bool: bool) -> str:
    text = info.description or ""
    if note:
        text = f"{text} ({note})" if text else note
    default = info.get_default(call_default_factory=True)
    if default is not PydanticUndefined and default is not None and not (isinstance(default, list) and not default):
        if is_bool:
            shown = "on" if default else "off"
        else:
            shown = " ".join(map(str, default)) if isinstance(default, list) else str(default)
        text = f"{text} (default: {shown})"
    return text.replace("%", "%%")  # argparse formats help with %


class _NamedAsFlags:
    """A ValidationError whose locations name the flags (`poll_interval` -> `state_poll`, `server` -> `auth_server`),
    for explain_validation(as_flags=True), which writes them as `--state-poll`."""

    def __init__(self, error: ValidationError, flags: dict[str, str]) -> None:
        self.error, self.flags = error, flags

    def errors(self) -> list[dict[str, Any]]:
        items = []
        for item in self.error.errors():
            loc = list(item["loc"])
            if loc and loc[0] in self.flags:
                loc[0] = self.flags[str(loc[0])].removeprefix("--").replace("-", "_")
            items.append({**item, "loc": tuple(loc)})
        return items
