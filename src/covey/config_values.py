"""Config values as they arrive: YAML files, read with every error's line and column, and text from the
command line, coerced to a field's type."""

from __future__ import annotations

import datetime
import json
import math
import typing
from pathlib import Path
from typing import Any

import yaml

from covey.errors import ConfigError


def read_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """The mapping of config keys to values in the YAML file at ``path``; any problem with the file is a
    ConfigError naming it (and the line and column where YAML has one)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start} cannot be decoded); save it as UTF-8") from None
    try:
        values = yaml.load(text, Loader=_YAMLLoader) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        problem = getattr(e, "problem", None) or e
        if isinstance(e, yaml.reader.ReaderError):  # a forbidden character: a position, no mark
            mark = yaml.Mark(str(path), e.position, text.count("\n", 0, e.position),
                             e.position - text.rfind("\n", 0, e.position) - 1, None, None)
            problem = f"the character {e.character!r} is not allowed in YAML"
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}: invalid YAML{where}: {problem}") from None
    except RecursionError:
        raise ConfigError(f"{path}: invalid YAML: nested too deeply to read") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: expected a mapping of config keys to values, got {type(values).__name__}")
    return values


class _YAMLLoader(yaml.SafeLoader):
    """yaml's safe loader, reporting a value its tag cannot hold (a date such as 2024-02-30,
    '!!int x') with its line and column, like every other YAML error."""

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except (ValueError, OverflowError) as e:
            raise yaml.constructor.ConstructorError(None, None, str(e), node.start_mark) from None

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        """A key given twice is an error, not silently the last one."""
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # '<<: *defaults' merges, it is no key
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, typing.Hashable):  # left for the constructor to report
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"{key!r} is given twice (first at line {seen[key].start_mark.line + 1})",
                    key_node.start_mark)
            seen[key] = key_node
        return super().construct_mapping(node, deep)


def coerce(name: str, value: Any, kind: tuple[type, bool]) -> Any:
    """``value`` as the field's type, parsing strings (the command line gives only strings). A bool
    is no number or text (a number or a YAML date is fine as text), numbers are finite, and list items
    are strings (numbers for reward_weights)."""
    base, optional = kind
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null")):
        if optional:
            return None
        raise ConfigError(f"{name} must not be empty")
    if base is dict and isinstance(value, str):  # the command line: JSON
        try:
            value = json.loads(value)
        except ValueError:
            raise ConfigError(f"{name}={value!r} is not a JSON object") from None
    if base is list:
        items = value if isinstance(value, (list, tuple)) else [value]
        item_kind = (float if name == "reward_weights" else str, False)
        return [coerce(f"{name}[{i}]", item, item_kind) for i, item in enumerate(items)]
    try:
        if base is bool:
            if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
                return value.lower() in ("true", "1", "yes")
            if not isinstance(value, bool):
                raise ValueError
            return value
        if isinstance(value, bool) or (base is str and not isinstance(value, (str, int, float, datetime.date))):
            raise TypeError
        if base is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
        coerced = base(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{name}={value!r} is not a valid {base.__name__}") from None
    if base is float and not math.isfinite(coerced):
        raise ConfigError(f"{name}={value!r} is not a finite number")
    return coerced
