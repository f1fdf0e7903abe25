"""Reading a run's settings: defaults, then a saved run's config, then an optional YAML file (flat or with
sections), then command-line flags; checked once (``checks.validate``)."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import yaml

from ditforge.config.checks import validate
from ditforge.config.sections import _SECTION_CLASSES, RunConfig, field_section
from ditforge.errors import UserError


def build_config(
    file: str | Path | None = None, overrides: dict[str, Any] | None = None, base: dict | None = None
) -> RunConfig:
    """Defaults, then ``base`` (a saved ``RunConfig.to_dict()``, e.g. of the run being resumed), then ``file``
    (YAML, flat or with sections), then ``overrides`` (flat).

    Raises:
        UserError: unreadable file, unknown keys, or invalid values (see ``validate``).
    """
    where = field_section()
    values: dict[str, Any] = {k: v for section in (base or {}).values() for k, v in section.items() if k in where}
    if file is not None:
        try:
            loaded = yaml.safe_load(Path(file).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise UserError(f"--config: cannot read {file}: {' '.join(str(e).split())}") from None
        if not isinstance(loaded, dict):
            raise UserError(f"--config: {file} must hold a mapping of settings")
        for key, value in loaded.items():
            if key in _SECTION_CLASSES and isinstance(value, dict):
                values.update(value)
            else:
                values[key] = value
        unknown = sorted(set(loaded_keys(loaded)) - set(where))
        if unknown:
            raise UserError(f"--config: unknown settings in {file}: {', '.join(unknown)}")
    values.update(overrides or {})
    sections: dict[str, dict] = {s: {} for s in _SECTION_CLASSES}
    types_ = {name: hint for cls in _SECTION_CLASSES.values() for name, hint in typing.get_type_hints(cls).items()}
    consts = {f.name: f.metadata["const"] for cls in _SECTION_CLASSES.values() for f in dataclasses.fields(cls)
              if "const" in f.metadata}
    for key, value in values.items():
        if key not in where:
            raise UserError(f"unknown setting {key!r}")
        if key in consts and isinstance(value, bool):  # `grad_checkpoint: true` (and older saved configs)
            value = consts[key] if value else "none"
        sections[where[key]][key] = _coerce(key, value, types_[key])
    cfg = RunConfig(**{s: _SECTION_CLASSES[s](**v) for s, v in sections.items()})
    validate(cfg)
    return cfg


def _coerce(name: str, value: Any, hint: Any) -> Any:
    """Check a value from a file or flag against the field's type; numbers written as strings (YAML 1.1
    reads ``1e-4`` as a string) are converted. Raises UserError naming the setting."""
    allowed = [a for a in typing.get_args(hint) if a is not type(None)] if typing.get_args(hint) else [hint]
    if value is None and type(None) in typing.get_args(hint):
        return None
    kind = allowed[0]
    try:
        if kind is bool and isinstance(value, bool):
            return value
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind is float and isinstance(value, (int, float, str)) and not isinstance(value, bool):
            return float(value)
        if kind is str and isinstance(value, str):
            return value
    except ValueError:
        pass
    raise UserError(f"--{name}: expected {kind.__name__}, got {value!r}")


def loaded_keys(loaded: dict) -> list[str]:
    """Setting names in a config file, flat or inside sections."""
    return [k for key, value in loaded.items()
            for k in (value if key in _SECTION_CLASSES and isinstance(value, dict) else [key])]
