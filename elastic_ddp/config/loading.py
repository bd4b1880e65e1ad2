"""Building a run's settings from the defaults, a YAML file and ``--section.field=value`` flags; every
problem a :class:`ConfigError` that names the field (or file), the value and what is allowed.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from elastic_ddp.config.sections import Config, ConfigError, Section

def _settings(cls: type[Config]) -> list[tuple[str, type[Section], str]]:
    """``(section.field, section class, field)`` of every setting of ``cls``, in declaration order."""
    return [
        (f"{section}.{field}", info.annotation, field)
        for section, info in cls.model_fields.items()
        for field in info.annotation.model_fields
    ]


def _format_validation_error(exc: ValidationError, source: str, cls: type[Config]) -> str:
    lines = [f"Invalid configuration ({source}):"]
    for error in exc.errors():
        field = ".".join(str(part) for part in error["loc"])
        # Values are echoed only where they cannot be credentials: not for storage options, and
        # not for unknown settings (a mistyped "storage_options" holds the same keys). Names are.
        if error["type"] == "extra_forbidden":
            lines.extend(f"  {line}" for line in _unknown(error["loc"], error["input"], cls))
            continue
        message = error["msg"].removeprefix("Value error, ")
        if isinstance(error["input"], dict):
            # A cross-field check: its message already names the fields and their values.
            lines.append(f"  {message}")
        elif "storage_options" in error["loc"]:
            lines.append(f"  {field}: {message} (value not shown: storage options may hold credentials).")
        else:
            lines.append(f"  {field}: {message} (got {error['input']!r}).")
    return "\n".join(lines)


# How alike (difflib's ratio) an unknown setting's dotted name must be to a valid one to be suggested:
# typos and shortened names score 0.81-0.97 (train.max_step, logging.every); an unrelated field of
# the same section scores up to ~0.8 on the shared "section." alone (checkpoint.path ~ keep_last).
_SUGGEST_CUTOFF = 0.81


def _unknown(loc: tuple, value: Any, cls: type[Config]) -> list[str]:
    """What to say about an unknown key at ``loc``: the nearest valid setting (difflib on the full
    dotted names), else what there is. ``value`` is looked at only for the keys under an unknown
    section (``--trian.max_steps=5`` arrives as section ``trian`` holding ``{"max_steps": 5}``)."""
    sections = list(cls.model_fields)
    names = [name for name, _, _ in _settings(cls)]
    if len(loc) == 1:  # a section that does not exist
        section = str(loc[0])
        keys = [f"{section}.{key}" for key in value] if isinstance(value, dict) and value else []
        close = difflib.get_close_matches(section, sections, n=1)
        there = f"no section {section!r}" + (f" (did you mean {close[0]}?)" if close else "")
        listing = f"; the sections are {', '.join(sections)}."
        if not keys:
            return [f"{section}: unknown section: {there}{listing}"]
        lines = []
        for key in keys:
            match = difflib.get_close_matches(key, names, n=1, cutoff=_SUGGEST_CUTOFF)
            lines.append(f"{key}: unknown setting; did you mean {match[0]}?" if match
                         else f"{key}: unknown setting: {there}{listing}")  # fmt: skip
        return lines
    name = ".".join(str(part) for part in loc)
    match = difflib.get_close_matches(name, names, n=1, cutoff=_SUGGEST_CUTOFF)
    if match:
        return [f"{name}: unknown setting; did you mean {match[0]}?"]
    if len(loc) == 2:
        fields = [field.split(".", 1)[1] for field in names if field.startswith(f"{loc[0]}.")]
        return [f"{name}: unknown setting; the settings of {loc[0]} are {', '.join(fields)}."]
    return [f"{name}: unknown setting."]


def _parse_flag(flag: str) -> tuple[list[str], Any]:
    if not flag.startswith("--") or "=" not in flag:
        raise ConfigError(f"Argument {flag!r} is not of the form --section.field=value.")
    key, raw = flag[2:].split("=", 1)
    parts = key.split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"Argument {flag!r}: the key must be section.field, e.g. --train.max_steps=100.")
    try:
        value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError:
        value = raw
    if value is None and raw.lower() not in ("null", "none", "~"):
        value = raw
    return parts, value


def load_config(argv: list[str] | None = None, config: type[Config] | Config = Config) -> Config:
    """Build the run's configuration from command-line arguments.

    ``config`` is the :class:`Config` subclass to build, or an instance whose values are the
    defaults the arguments override. ``argv`` holds ``--config FILE`` / ``--config=FILE`` and
    ``--section.field=value`` items. Raises :class:`ConfigError` naming the field (or file), the
    value and what is allowed.
    """
    cls, data = class_and_values(config)
    argv = list(argv or [])
    overrides: list[str] = []
    config_file = ""
    index = 0
    while index < len(argv):
        arg = argv[index]
        if arg == "--config":
            if index + 1 >= len(argv):
                raise ConfigError("--config needs a file name.")
            config_file = argv[index + 1]
            index += 2
            continue
        if arg.startswith("--config="):
            config_file = arg.split("=", 1)[1]
        else:
            overrides.append(arg)
        index += 1

    if config_file:
        data = _merge(data, _read_yaml(config_file))
    for flag in overrides:
        (section, field), value = _parse_flag(flag)
        section_data = data.setdefault(section, {})
        if not isinstance(section_data, dict):
            raise ConfigError(f"Section {section!r} in the config must be a mapping.")
        section_data[field] = value
    source = f"{config_file} and flags" if config_file else "flags"
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, source, cls)) from None


def class_and_values(config: type[Config] | Config) -> tuple[type[Config], dict[str, Any]]:
    """The Config class of ``config`` (a subclass or an instance) and the values an instance sets."""
    if isinstance(config, Config):
        return type(config), _values_of(config)
    if isinstance(config, type) and issubclass(config, Config):
        return config, {}
    raise TypeError(f"config must be a Config subclass or instance, not {config!r}.")


def _values_of(config: Config) -> dict[str, Any]:
    """The values set in ``config`` (at construction or by assignment), section by section: what it
    changes from the defaults. The rest -- the derived defaults it filled in among them -- stays
    unset, so validation can tell a setting given from a default (see CheckpointConfig.memory_asked)."""
    return {name: getattr(config, name).model_dump(exclude_unset=True) for name in type(config).model_fields}


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    merged = {key: dict(value) if isinstance(value, dict) else value for key, value in base.items()}
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key].update(value)
        else:
            merged[key] = value
    return merged


def _read_yaml(path: str) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"Config file {path!r} cannot be read: {exc.strerror}.") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"Config file {path!r} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"Config file {path!r} must hold a mapping of sections, not {type(data).__name__}.")
    return data
