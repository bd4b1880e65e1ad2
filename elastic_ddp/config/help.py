"""The ``--help`` text of a training script: every setting with its flag, type, default and description."""

from __future__ import annotations

import enum
import json
import sys
import textwrap
import types
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from elastic_ddp.config.loading import class_and_values
from elastic_ddp.config.sections import IDENTITY, Config

# What --help shows as their defaults: where they come from (see Config._fill_run_paths).
_DERIVED_HELP = {
    ("run", "name"): "torchrun's --rdzv-id, else the script's name",
    ("checkpoint", "url"): "<run.root>/<run.name>/checkpoints",
    ("logging", "tensorboard_dir"): "<run.root>/<run.name>/tensorboard",
    ("checkpoint", "memory_dir"): "/dev/shm/elastic_ddp/<a hash of the working directory>",
}


def describe(config: type[Config] | Config = Config, prog: str | None = None, width: int = 100) -> str:
    """The ``--help`` text of a script whose settings are ``config``: every section, and for each
    field its flag, type, default and description; identity fields marked.

    ``config`` is the :class:`Config` subclass (its own sections beside the library's, extended
    library sections with their added fields) or an instance whose values are the defaults, as
    :func:`load_config` takes it. Derived defaults show what they derive from
    (``<run.root>/<run.name>/checkpoints``), not a path resolved now; storage options show their
    keys only. ``prog``: the script's name in the usage line (default: ``sys.argv[0]``'s).
    """
    cls, given = class_and_values(config)
    if prog is None:
        prog = Path(sys.argv[0]).name if sys.argv and sys.argv[0] not in ("", "-c", "-m") else "script.py"
    out = [
        f"usage: {prog} [--config FILE] [--section.field=VALUE ...]",
        "",
        *textwrap.wrap(
            "Each setting is its default, else its value in the YAML file given with --config FILE "
            "(section: {field: value}), else --section.field=VALUE; values are YAML (--train.seed=7, "
            "--checkpoint.async_save=false, --checkpoint.keep_every=null). [identity]: must not change "
            "while a run resumes from its checkpoints (--checkpoint.allow_identity_change=true allows it).",
            width,
            break_on_hyphens=False,
        ),
    ]
    for section_name, info in cls.model_fields.items():
        section_cls = info.annotation
        defaults = _section_defaults(info, given.get(section_name))
        out += ["", f"{section_name}:" + (f" {info.description}" if info.description else "")]
        for field_name, field in section_cls.model_fields.items():
            kind = _type_text(field.annotation)
            bounds = [f"{op} {getattr(meta, attr)}" for meta in field.metadata
                      for attr, op in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))
                      if getattr(meta, attr, None) is not None]  # fmt: skip
            if bounds:
                kind += " " + ", ".join(bounds)
            identity = section_cls.identity or any(meta is IDENTITY for meta in field.metadata)
            default = _default_text(section_name, field_name, field, defaults)
            mark = "  [identity]" if identity else ""
            out.append(f"  --{section_name}.{field_name}  {kind}  (default: {default}){mark}")
            if field.description:
                out += textwrap.wrap(field.description, width, initial_indent=" " * 6, subsequent_indent=" " * 6,
                                     break_on_hyphens=False)  # fmt: skip
    return "\n".join(out) + "\n"


_MISSING = object()


def _section_defaults(info: Any, given: dict[str, Any] | None) -> dict[str, Any]:
    """A section's default values: those of the instance given as defaults, else of the section
    the Config's field makes (its default factory may set values of its own)."""
    if given is not None:
        return given
    try:
        section = info.get_default(call_default_factory=True)
    except ValidationError:  # a section with required fields: each field says so
        return {}
    return section.model_dump() if isinstance(section, BaseModel) else {}


def _default_text(section: str, name: str, field: Any, defaults: dict[str, Any]) -> str:
    value = defaults.get(name, _MISSING)
    if (section, name) in _DERIVED_HELP and (value is _MISSING or not value):
        return _DERIVED_HELP[section, name]
    if value is _MISSING:
        if field.is_required():
            return "none, required"
        value = field.get_default(call_default_factory=True)
    if name == "storage_options" and isinstance(value, dict):
        value = {key: "<redacted>" for key in value}  # as in to_yaml: they may hold keys
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, (str, dict, list, tuple)):
        try:
            return json.dumps(value)
        except TypeError:
            return repr(value)
    return str(value)


def _type_text(annotation: Any) -> str:
    """A field's type as a user writes its value: ``int``, ``'auto'|'gloo'|'nccl'``, ``int|null``, ``dict``."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _type_text(args[0])
    if origin is Literal:
        return "|".join(repr(arg) for arg in args)
    if origin in (Union, types.UnionType):
        text = "|".join(_type_text(arg) for arg in args if arg is not type(None))
        return f"{text}|null" if type(None) in args else text
    if annotation is Any:
        return "any"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return "|".join(repr(member.value) for member in annotation)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        if name in ("dict", "Mapping", "MutableMapping"):
            return "dict" if len(args) < 2 or args[1] is Any else f"dict[{_type_text(args[0])}, {_type_text(args[1])}]"
        items = [arg for arg in args if arg is not Ellipsis]
        return name if not items or items[0] is Any else f"{name}[{', '.join(_type_text(arg) for arg in items)}]"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))
