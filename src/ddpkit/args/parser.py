"""TrainingArguments (and a script's own dataclasses) from the command line, as Transformers' HfArgumentParser
reads them:

    args, = ArgumentParser(TrainingArguments).parse_args_into_dataclasses()  # python train.py --bf16 --max_steps 100
    args, script = ArgumentParser((TrainingArguments, ScriptArguments)).parse_args_into_dataclasses()
    python train.py --help                                                   # every field with its one-line help

Each field's help lives in its metadata (training_args.py) and becomes its ``--help`` line, so the two cannot drift. A
Transformers-only flag fails naming the field and what to do instead (args_foreign); an error is shown once, not
once per rank (env.report_startup_error).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from collections.abc import Iterable, Sequence
from typing import Any, Union

from ddpkit.args.training_args import TrainingArguments, string_to_bool
from ddpkit.args.transformers_only import explain, foreign_flag, without_foreign
from ddpkit.errors import ArgumentError


def _strip_optional(annotation: Any) -> tuple[Any, bool]:
    """(the type inside Optional[...], whether None was allowed)."""
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        allows_none = len(inner) < len(typing.get_args(annotation))
        return (inner[0] if len(inner) == 1 else Union[tuple(inner)]), allows_none  # noqa: UP007 - built at run time
    return annotation, False


def _number(kind: type):
    def convert(text: str):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if kind is int:
            if not value.is_integer():
                raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
            return int(value)
        return value
    convert.__name__ = kind.__name__
    return convert


class ArgumentParser(argparse.ArgumentParser):
    """An argparse parser made from dataclasses, like Transformers' HfArgumentParser.

    Every field becomes ``--name`` (``--name-with-dashes`` works too); booleans take ``--flag``, ``--flag false`` and,
    when they default to true, ``--no_flag``; ``--help`` lists every field with its help and default.
    """

    def __init__(self, dataclass_types: type | Sequence[type] = TrainingArguments, **kwargs: Any):
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(**kwargs)
        self.dataclass_types = [dataclass_types] if isinstance(dataclass_types, type) else list(dataclass_types)
        for dtype in self.dataclass_types:
            group = self.add_argument_group(dtype.__name__) if len(self.dataclass_types) > 1 else self
            hints = typing.get_type_hints(dtype)
            for field in dataclasses.fields(dtype):
                if field.init:
                    self._add_field(group, field, hints[field.name])

    def _add_field(self, group, field: dataclasses.Field, annotation: Any) -> None:
        names = [f"--{field.name}"]  # --name-with-dashes is accepted too: see _underscored
        kind, _ = _strip_optional(annotation)
        kwargs: dict[str, Any] = {"help": field.metadata.get("help", ""), "dest": field.name}
        if field.default is not dataclasses.MISSING:
            kwargs["default"] = field.default
        elif field.default_factory is not dataclasses.MISSING:
            kwargs["default"] = field.default_factory()
        else:
            kwargs["required"] = True
        if "choices" in field.metadata:
            kwargs["choices"] = list(field.metadata["choices"])
        if kind is bool or typing.get_origin(kind) in (Union, types.UnionType) and bool in typing.get_args(kind):
            # --bf16 alone means true; --bf16 false spells it out, as Transformers accepts (str | bool: any word).
            kwargs.update(type=string_to_bool if kind is bool else str, nargs="?", const=True, metavar="BOOL")
        elif typing.get_origin(kind) is list:
            kwargs.update(type=str, nargs="+")
        elif kind in (int, float):
            kwargs["type"] = _number(kind)
        else:
            kwargs["type"] = str
        group.add_argument(*names, **kwargs)
        if kind is bool and field.default is True:
            group.add_argument(f"--no_{field.name}", dest=field.name, action="store_false",
                               help=f"Set {field.name} to false.")

    def _underscored(self, argv: list[str]) -> list[str]:
        """--learning-rate 3e-4 -> --learning_rate 3e-4 (for every known option), keeping --help short."""
        known = {a.dest for a in self._actions}
        out = []
        for token in argv:
            name, eq, value = token.partition("=")
            if name.startswith("--") and name[2:].replace("-", "_") in known:
                token = "--" + name[2:].replace("-", "_") + eq + value
            elif name.startswith("--no-") and name[5:].replace("-", "_") in known:
                token = "--no_" + name[5:].replace("-", "_") + eq + value
            out.append(token)
        return out

    def error(self, message: str) -> typing.NoReturn:
        """One line on the main process, not argparse's full usage once per rank; exits 2 on every rank."""
        from ddpkit.distributed.env import (
            report_startup_error,  # the one module that knows the launcher (rank, error file)
        )

        report_startup_error(f"{self.prog}: error: {message}\n(run with --help to list every option)")
        self.exit(2)

    def parse_args_into_dataclasses(self, args: Sequence[str] | None = None,
                                    allow_extra: bool = False) -> tuple[Any, ...]:
        """One instance per dataclass type, in order; validation errors exit like any argparse error.

        allow_extra=True returns the unknown arguments as one more, last element instead of failing.
        """
        namespace, extra = self.parse_known_args(self._underscored(sys.argv[1:] if args is None else list(args)))
        foreign = foreign_flag(extra)
        if foreign is not None:
            self.error(f"--{foreign} {explain(foreign, on_command_line=True)}")
        if extra and not allow_extra:
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        values = vars(namespace)
        out: list[Any] = []
        for dtype in self.dataclass_types:
            fields = {f.name for f in dataclasses.fields(dtype) if f.init}
            try:
                out.append(dtype(**{k: v for k, v in values.items() if k in fields}))
            except ArgumentError as exc:
                self.error(f"--{exc}")
        if allow_extra:
            out.append(extra)
        return tuple(out)

    def parse_dict(self, values: dict[str, Any]) -> tuple[Any, ...]:
        """One instance per dataclass type from a dict (a JSON config, say); unknown keys fail."""
        known = {f.name for dtype in self.dataclass_types for f in dataclasses.fields(dtype)}
        # Transformers' own fields at Transformers' default are dropped, at another value refused with advice.
        unknown = sorted(without_foreign({k: v for k, v in values.items() if k not in known}))
        if unknown:
            raise ArgumentError(unknown[0], f"unknown argument(s) {unknown}")
        return tuple(dtype(**{f.name: values[f.name] for f in dataclasses.fields(dtype) if f.name in values})
                     for dtype in self.dataclass_types)


def parse_args(argv: Iterable[str] | None = None) -> TrainingArguments:
    """TrainingArguments from the command line (sys.argv by default)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    (args,) = ArgumentParser(TrainingArguments).parse_args_into_dataclasses(argv)
    return args


__all__ = ["ArgumentParser", "parse_args"]
