"""Typed flag groups: frozen dataclasses whose fields declare their command-line flags.

A field of a flag-group dataclass carries, in its ``metadata`` (built with :func:`flag`), the
flag's name, help text, constraints (``choices``, ``minimum`` / ``exclusive_minimum``,
``exclusive_maximum``) and ``--help`` placeholder.  Its type comes from the annotation (``int``,
``float``, ``str``, ``bool`` or ``Optional`` of one of them) and its default from the field.  From
that one declaration:

- :func:`check_group` validates an instance (called from the dataclass's ``__post_init__``):
  types (an int is accepted for a float and converted), choices and bounds, each error naming
  the flag and the field;
- :func:`add_flag_group` generates the argparse options (type, default, choices, bounds, help);
- :func:`group_kwargs` copies parsed values into the dataclass by field name, and
  :func:`shared_fields` copies a group's fields into another config by field name.

Booleans: a field defaulting to False is a switch (``--x``); one defaulting to True whose flag is
``--no-x`` turns it off (argparse destination ``x``); one defaulting to True under any other name
gets both ``--x`` and ``--no-x``.  ``cli_default`` (default: the field's default) is the value
argparse stores when the flag is not given; None there means "not given: the field's default
applies" (a driver can then tell a given flag from its default).

Only fields declared with :func:`flag` are flags; other fields are left to their dataclass.  This
module imports nothing else of megatron_harts (and no torch), so every layer may use it.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import numbers
import typing
from typing import Any, Dict, Iterator, Optional, Tuple

__all__ = ["flag", "flag_fields", "FlagSpec", "check_group", "group_kwargs", "shared_fields", "set_namespace",
           "add_flag_group", "int_at_least", "finite_float", "float_above"]

_META = "megatron_harts.flag"
_SAME = object()        # cli_default not given: the field's default


@dataclasses.dataclass(frozen=True)
class FlagSpec:
    """One field's flag: ``name`` ("--rl-epochs"), ``type`` (int, float, str or bool), ``optional``
    (None allowed), ``default``, ``help``, ``choices``, bounds, ``metavar`` and ``cli_default``."""
    field: str
    name: str
    type: type
    optional: bool
    default: Any
    help: str
    choices: Optional[Tuple[Any, ...]] = None
    minimum: Optional[float] = None
    exclusive_minimum: Optional[float] = None
    exclusive_maximum: Optional[float] = None
    metavar: Optional[str] = None
    cli_default: Any = _SAME

    @property
    def negated(self) -> bool:
        """A switch that turns a default-True field off (``--no-tree-replay`` -> ``tree_replay``)."""
        return self.type is bool and self.default is True and self.name.startswith("--no-")

    @property
    def dest(self) -> str:
        """The argparse destination of the flag ("--rl-epochs" -> "rl_epochs"; a negated switch
        "--no-tree-replay" -> "tree_replay")."""
        return (self.name[5:] if self.negated else self.name[2:]).replace("-", "_")

    @property
    def parser_default(self) -> Any:
        """What argparse stores when the flag is not given."""
        return self.default if self.cli_default is _SAME else self.cli_default

    @property
    def option_strings(self) -> Tuple[str, ...]:
        """Every option string the parser accepts for this field."""
        if self.type is bool and self.default is True and not self.negated:
            return self.name, "--no-" + self.name[2:]
        return (self.name,)


def flag(default: Any, name: str, help: str, *, choices: Optional[Tuple[Any, ...]] = None,
         minimum: Optional[float] = None, exclusive_minimum: Optional[float] = None,
         exclusive_maximum: Optional[float] = None, metavar: Optional[str] = None, cli_default: Any = _SAME) -> Any:
    """A dataclass field that is the flag ``name`` (module docstring)."""
    return dataclasses.field(default=default, metadata={_META: dict(
        name=name, help=help, choices=None if choices is None else tuple(choices), minimum=minimum,
        exclusive_minimum=exclusive_minimum, exclusive_maximum=exclusive_maximum, metavar=metavar,
        cli_default=cli_default)})


def _field_type(hint) -> Tuple[type, bool]:
    origin = typing.get_origin(hint)
    if origin is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"flag field type {hint!r}: one type or Optional[one type]")
        return args[0], True
    return hint, False


def flag_fields(cls) -> Iterator[FlagSpec]:
    """The flags of dataclass ``cls`` (instance or class), in field order."""
    cls = cls if isinstance(cls, type) else type(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata.get(_META)
        if meta is None:
            continue
        typ, optional = _field_type(hints[f.name])
        if typ not in (int, float, str, bool):
            raise TypeError(f"{cls.__name__}.{f.name}: flag fields are int, float, str or bool, got {typ!r}")
        yield FlagSpec(field=f.name, type=typ, optional=optional, default=f.default, **meta)


def _coerce(spec: FlagSpec, value, owner: str):
    where = f"({owner}.{spec.field})"
    if value is None:
        if spec.optional:
            return None
        raise ValueError(f"{spec.name} needs a value, got None {where}")
    if spec.type is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{spec.name} must be true or false, got {value!r} {where}")
        return value
    if spec.type is str:
        if not isinstance(value, str):
            raise ValueError(f"{spec.name} must be a string, got {value!r} {where}")
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or \
            (spec.type is int and not (isinstance(value, numbers.Integral) or float(value).is_integer())):
        raise ValueError(f"{spec.name} must be {'an integer' if spec.type is int else 'a number'}, got {value!r} "
                         f"{where}")
    value = spec.type(value)
    if not math.isfinite(value):
        raise ValueError(f"{spec.name} must be finite, got {value} {where}")
    return value


def check_group(instance) -> None:
    """Validate (and normalise: int -> float for float fields) every flag field of a frozen dataclass
    ``instance``; errors name the flag and the field."""
    owner = type(instance).__name__
    for spec in flag_fields(instance):
        value = _coerce(spec, getattr(instance, spec.field), owner)
        where = f"({owner}.{spec.field})"
        if value is not None:
            if spec.choices is not None and value not in spec.choices:
                raise ValueError(f"{spec.name} must be one of {', '.join(map(str, spec.choices))}, got {value!r} "
                                 f"{where}")
            lo, hi = spec.minimum, spec.exclusive_maximum
            if lo is not None and hi is not None and not lo <= value < hi:
                raise ValueError(f"{spec.name} must be in [{lo}, {hi}), got {value} {where}")
            if lo is not None and value < lo:
                raise ValueError(f"{spec.name} must be >= {lo}, got {value} {where}")
            if hi is not None and value >= hi:
                raise ValueError(f"{spec.name} must be < {hi}, got {value} {where}")
            if spec.exclusive_minimum is not None and value <= spec.exclusive_minimum:
                raise ValueError(f"{spec.name} must be > {spec.exclusive_minimum}, got {value} {where}")
        object.__setattr__(instance, spec.field, value)


def group_kwargs(cls, namespace) -> Dict[str, Any]:
    """The values of ``cls``'s flags in a parsed ``namespace``, by field name.  Absent attributes,
    and None for a field that does not take None, are left out: the dataclass defaults apply."""
    out = {}
    for spec in flag_fields(cls):
        value = getattr(namespace, spec.dest, None)
        if value is not None or (spec.optional and hasattr(namespace, spec.dest)):
            out[spec.field] = value
    return out


def set_namespace(namespace, instance) -> None:
    """Write a group ``instance``'s values back to their argparse destinations in ``namespace`` (so a
    parsed namespace shows the resolved values)."""
    for spec in flag_fields(instance):
        setattr(namespace, spec.dest, getattr(instance, spec.field))


def shared_fields(source, target_cls, *, exclude: Tuple[str, ...] = ()) -> Dict[str, Any]:
    """The fields of dataclass instance ``source`` that dataclass ``target_cls`` also has, by name
    (keyword arguments of ``target_cls``; ``exclude`` leaves some out)."""
    names = {f.name for f in dataclasses.fields(target_cls) if f.init}
    return {f.name: getattr(source, f.name) for f in dataclasses.fields(source)
            if f.name in names and f.name not in exclude}


# ---------------------------------------------------------------------------------------------
# argparse value parsers and the generated options
# ---------------------------------------------------------------------------------------------
def int_at_least(lo: int):
    """argparse type: an integer >= ``lo``."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got {text!r}")
        return v
    parse.__name__ = f"int>={lo}"
    return parse


def finite_float(lo: Optional[float] = None, *, above: Optional[float] = None, below: Optional[float] = None):
    """argparse type: a finite number, ``>= lo``, ``> above`` and ``< below`` where given."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if lo is not None and v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo:g}, got {text!r}")
        if above is not None and v <= above:
            raise argparse.ArgumentTypeError(f"must be > {above:g}, got {text!r}")
        if below is not None and v >= below:
            raise argparse.ArgumentTypeError(f"must be < {below:g}, got {text!r}")
        return v
    parse.__name__ = "float"
    return parse


def float_above(lo: float):
    """argparse type: a finite number > ``lo``."""
    return finite_float(above=lo)


def _converter(spec: FlagSpec):
    if spec.type is str:
        return str
    if spec.type is int:
        return int_at_least(int(spec.minimum)) if spec.minimum is not None else int
    return finite_float(spec.minimum, above=spec.exclusive_minimum, below=spec.exclusive_maximum)


def add_flag_group(group, cls) -> None:
    """Add the flags a flag-group dataclass ``cls`` declares to an argparse parser or group: type,
    default, choices and bounds from the field, help from its declaration (a " (default X)" is
    appended unless the help names its default)."""
    for spec in flag_fields(cls):
        if spec.type is bool:
            if spec.negated:
                group.add_argument(spec.name, dest=spec.dest, action="store_false", help=spec.help)
            elif spec.default:
                group.add_argument(spec.name, dest=spec.dest, action=argparse.BooleanOptionalAction,
                                   default=True, help=spec.help)
            else:
                group.add_argument(spec.name, dest=spec.dest, action="store_true", help=spec.help)
            continue
        metavar = spec.metavar
        if metavar is None and not spec.choices:
            metavar = {int: "INT", float: "FLOAT", str: "VALUE"}[spec.type]
        default = spec.parser_default
        suffix = "" if default is None or "default" in spec.help else f" (default {default})"
        group.add_argument(spec.name, dest=spec.dest, type=_converter(spec), default=default, choices=spec.choices,
                           metavar=metavar, help=spec.help + suffix)
