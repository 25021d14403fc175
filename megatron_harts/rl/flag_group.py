"""Typed flag groups: a frozen dataclass whose fields declare their command-line flags.

A field of a flag-group dataclass carries, in its ``metadata`` (built with :func:`flag`), the
flag's name, help text and constraints (``choices``, ``minimum``, ``exclusive_minimum``).  Its type
comes from the annotation (``int``, ``float``, ``str``, ``bool`` or ``Optional`` of one of them) and
its default from the field.  From that one declaration:

- :func:`check_group` validates an instance (called from the dataclass's ``__post_init__``):
  types (an int is accepted for a float and converted), choices and bounds, each error naming
  the flag and the field;
- the training driver generates the argparse options (``training.arguments.add_flag_group``) and
  copies parsed values into the dataclass by field name (:func:`group_kwargs`).

Only fields declared with :func:`flag` are flags; other fields are left to their dataclass.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, Dict, Iterator, Optional, Tuple

__all__ = ["flag", "flag_fields", "FlagSpec", "check_group", "group_kwargs"]

_META = "megatron_harts.flag"


@dataclasses.dataclass(frozen=True)
class FlagSpec:
    """One field's flag: ``name`` ("--rl-epochs"), ``type`` (int, float, str or bool), ``optional``
    (None allowed), ``default``, ``help``, ``choices``, ``minimum`` / ``exclusive_minimum``."""
    field: str
    name: str
    type: type
    optional: bool
    default: Any
    help: str
    choices: Optional[Tuple[Any, ...]] = None
    minimum: Optional[float] = None
    exclusive_minimum: Optional[float] = None

    @property
    def dest(self) -> str:
        """The argparse destination of the flag ("--rl-epochs" -> "rl_epochs")."""
        return self.name[2:].replace("-", "_")


def flag(default: Any, name: str, help: str, *, choices: Optional[Tuple[Any, ...]] = None,
         minimum: Optional[float] = None, exclusive_minimum: Optional[float] = None) -> Any:
    """A dataclass field that is the flag ``name`` (module docstring)."""
    return dataclasses.field(default=default, metadata={_META: dict(name=name, help=help, choices=choices,
                                                                    minimum=minimum,
                                                                    exclusive_minimum=exclusive_minimum)})


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
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (spec.type is int and not (isinstance(value, int) or float(value).is_integer())):
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
            if spec.minimum is not None and value < spec.minimum:
                raise ValueError(f"{spec.name} must be >= {spec.minimum}, got {value} {where}")
            if spec.exclusive_minimum is not None and value <= spec.exclusive_minimum:
                raise ValueError(f"{spec.name} must be > {spec.exclusive_minimum}, got {value} {where}")
        object.__setattr__(instance, spec.field, value)


def group_kwargs(cls, namespace) -> Dict[str, Any]:
    """The values of ``cls``'s flags in a parsed ``namespace``, by field name (absent attributes are
    left out, so the dataclass defaults apply)."""
    out = {}
    for spec in flag_fields(cls):
        if hasattr(namespace, spec.dest):
            out[spec.field] = getattr(namespace, spec.dest)
    return out
