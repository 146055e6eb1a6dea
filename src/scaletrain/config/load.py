"""Reading a configuration: YAML files merged in order, then dotted overrides, then the schema's
checks (schema.py). Every problem becomes a UserError whose one line names the key, the bad
value and what is accepted.
"""

from __future__ import annotations

import difflib
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from scaletrain.config.schema import Config
from scaletrain.errors import UserError


def load_config(
    files: list[str] | tuple[str, ...] = (),
    overrides: list[str] | tuple[str, ...] = (),
    values: Mapping[str, Any] | None = None,
) -> Config:
    """Merge YAML files in order, apply `dotted.key=value` overrides (their values read as
    YAML), then `values` ({dotted key: value}, taken as they are: a program's), validate."""
    return from_tree(config_tree(files, overrides, values))


def config_tree(
    files: list[str] | tuple[str, ...] = (),
    overrides: list[str] | tuple[str, ...] = (),
    values: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """What load_config validates: the files, overrides and values merged, unchecked (a
    program may set more keys before from_tree, as `train(config, spec=...)` does: api.py)."""
    merged: dict[str, Any] = {}
    for f in files:
        _deep_merge(merged, _read_yaml_file(f))
    for item in overrides:
        key, value = _parse_override(item)
        _set_dotted(merged, key, value)
    for key, value in (values or {}).items():
        if not key or any(not part for part in key.split(".")):
            raise UserError(f"config key {key!r} needs the form section.key, e.g. train.lr")
        _set_dotted(merged, key, value)
    return merged


def from_tree(tree: dict[str, Any]) -> Config:
    """The config `tree` (config_tree's, or a Config's model_dump(exclude_unset=True): the keys
    given stay the given ones, which training/defaults.py reads), checked; one line if not."""
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        raise UserError(_describe(e, tree)) from None


def split_args(args: list[str]) -> tuple[list[str], list[str]]:
    """Positional CLI words: YAML files first-come, `key=value` overrides."""
    files, overrides = [], []
    for a in args:
        if "=" in a:
            overrides.append(a)
        elif a.endswith((".yaml", ".yml")):
            files.append(a)
        else:
            raise UserError(f"argument {a!r} is neither a CONFIG.yaml file nor a dotted.key=value override")
    return files, overrides


def _read_yaml_file(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"config file {path!r} not found (expected a readable .yaml file)")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise UserError(
            f"config file {path!r} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); accepted: a UTF-8 YAML file"
        ) from None
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        raise UserError(f"config file {path!r} is not valid YAML{line}: {getattr(e, 'problem', e)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(
            f"config file {path!r} must hold a mapping of sections (model:, data:, train: ...), got {type(data).__name__}"
        )
    return data


def _parse_override(item: str) -> tuple[str, Any]:
    key, _, raw = item.partition("=")
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise UserError(f"override {item!r} needs the form section.key=value, e.g. train.lr=3e-4")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw  # not YAML: keep the text, the schema decides whether it is acceptable
    return key, value


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            prefix = ".".join(parts[: i + 1])
            raise UserError(f"override {key}={value!r}: {prefix} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _deep_merge(into: dict[str, Any], new: dict[str, Any]) -> None:
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _deep_merge(into[k], v)
        else:
            into[k] = v


def _describe(err: ValidationError, raw: dict[str, Any]) -> str:
    """One line per problem: key, value given, what is accepted."""
    lines = []
    for e in err.errors():
        loc = [str(p) for p in e["loc"]]
        key = ".".join(loc)
        if e["type"] == "extra_forbidden":
            lines.append(_unknown_key_message(loc))
            continue
        if e["type"] == "missing":  # e.g. a data.mix source without its weight
            lines.append(f"config key {key} is missing; accepted: a value for it (it has no default)")
            continue
        if e["type"] == "value_error":  # a cross-key check: its message already names the keys
            lines.append(f"config: {e['msg'].removeprefix('Value error, ')}")
            continue
        value = e.get("input")
        accepted = e["msg"].replace("Input should be ", "expected ")
        if accepted.startswith(("expected greater", "expected less")):
            accepted = accepted.replace("expected ", "expected a value ", 1)
        lines.append(f"config key {key} = {value!r} is invalid: {accepted}")
    return "; ".join(lines)


def _unknown_key_message(loc: list[str]) -> str:
    section: type[BaseModel] = Config
    for part in loc[:-1]:
        if part.isdigit():  # an item of a list of sections (data.mix.0)
            continue
        field = section.model_fields.get(part)
        annotation = field.annotation if field else None
        if typing.get_origin(annotation) is list:
            annotation = typing.get_args(annotation)[0]
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            break
        section = annotation
    accepted = list(section.model_fields)
    close = difflib.get_close_matches(loc[-1], accepted, n=1)
    hint = f" (did you mean {'.'.join(loc[:-1] + close)}?)" if close else ""
    where = ".".join(loc[:-1]) or "the top level"
    return f"unknown config key {'.'.join(loc)}{hint}; accepted keys in {where}: {', '.join(accepted)}"
