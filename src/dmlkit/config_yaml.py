"""YAML text and ``--set`` overrides: the reading half of :mod:`dmlkit.config`.

:func:`load_yaml` parses with YAML 1.2-core numbers (:class:`YamlLoader`; :class:`YamlDumper`
writes strings that would read as numbers quoted), :func:`read_yaml_mapping` reads a config
file (or a packaged preset by name: :func:`resolve_config_path`) into a mapping with one-line
errors, and :func:`parse_overrides` turns ``key.sub=value``
strings into values (parsed as YAML) that :func:`set_dotted` places in nested mappings;
:func:`validate_settings` validates a mapping into a pydantic model with the errors of
:func:`format_validation_error` (every config of dmlkit reports itself that way). What the keys
mean, and which old names they had, is :mod:`dmlkit.config`'s.
"""

from __future__ import annotations

import difflib
import os
import re
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from dmlkit.exceptions import ConfigError

__all__ = ["MAX_ALIAS_EXPANSION", "PRESET_DIR", "YamlDumper", "YamlLoader", "check_alias_expansion",
           "format_validation_error", "load_yaml",
           "packaged_presets", "parse_overrides", "read_yaml_mapping", "resolve_config_path",
           "set_dotted", "validate_settings"]


#: The most nodes aliases (``*name``, merge keys ``<<: *name``) may add to a YAML document when
#: each is counted as a full copy of what it names. PyYAML builds one shared object per anchor,
#: but pydantic's ``model_dump`` and JSON copy it at every alias: a 1 KB "billion laughs" config
#: (9 levels of 10 aliases, 10^9 leaves) in a free-form mapping (``loss.params``,
#: ``data.options``) kept ``dmlkit train`` busy for minutes; 10^6 leaves cost 5 s. No packaged
#: preset or documented example uses an alias; a few shared sections stay far below the bound.
MAX_ALIAS_EXPANSION = 10_000


def _children(node: yaml.Node) -> list[yaml.Node]:
    """The nodes a composed node holds: a sequence's items, a mapping's keys and values."""
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def check_alias_expansion(root: yaml.Node, limit: int = MAX_ALIAS_EXPANSION) -> None:
    """Refuse a composed document whose aliases would copy more than ``limit`` nodes, or that
    holds a node inside itself (``&a [*a]``: a recursive structure no config can mean).

    The expanded size is ``size(n) = 1 + sum(size(c) for c in children(n))`` over the node
    graph (an alias is the node it names, so a node named ``k`` times counts ``k`` times),
    computed once per distinct node (memoised, iterative): linear in the document, whatever
    the expansion. What aliases add is that size minus the number of distinct nodes."""
    sizes: dict[int, int] = {}
    on_path: set[int] = set()  # the ancestors of the node being visited (depth-first)
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        key = id(node)
        if finished:
            on_path.discard(key)
            sizes[key] = 1 + sum(sizes[id(child)] for child in _children(node))
            continue
        if key in sizes:
            continue
        if key in on_path:
            raise yaml.composer.ComposerError(
                None, None, "an alias names a node that contains it (a recursive structure): "
                "a config cannot hold one; write the value out", node.start_mark)
        on_path.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in _children(node) if id(child) not in sizes)
    added = sizes[id(root)] - len(sizes)
    if added > limit:
        raise yaml.composer.ComposerError(
            None, None, f"its aliases (*name) would copy {added} nodes, more than the {limit} a config "
            "may hold (a YAML 'billion laughs'); write the values out or use fewer aliases")


class YamlLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` with YAML 1.2-core numbers: ``010`` is 10 (not octal 8), ``1e-3`` a float
    (not a string), ``0o17`` / ``0x1f`` octal / hex. ``strict_ints`` (``--set`` values) refuses a
    leading-zero integer instead of guessing what it meant. A document whose aliases would
    expand past :data:`MAX_ALIAS_EXPANSION` nodes, or that contains itself, is refused
    (:func:`check_alias_expansion`) before anything is constructed."""

    strict_ints = False

    def compose_document(self) -> yaml.Node:
        """PyYAML's composed document, checked by :func:`check_alias_expansion`."""
        node = super().compose_document()
        check_alias_expansion(node)
        return node

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        """A mapping whose keys are unique: PyYAML kept a repeated key's last value and dropped
        the first without a word (a second ``training:`` block replaced the first whole). Merge
        keys (``<<: *defaults``) still give way to the keys written beside them."""
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            try:
                if key in first_line:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"the key {key!r} is given twice (lines {first_line[key]} and {line}): "
                        "keep one", key_node.start_mark)
                first_line[key] = line
            except TypeError:  # an unhashable key: PyYAML's own error follows
                continue
        return super().construct_mapping(node, deep=deep)


class YamlDumper(yaml.SafeDumper):
    """``yaml.SafeDumper`` that quotes every string :class:`YamlLoader` would read as a number."""


_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
for _cls in (YamlLoader, YamlDumper):
    _cls.yaml_implicit_resolvers = {c: [(t, rx) for t, rx in rs if t not in (_INT, _FLOAT)]
                                    for c, rs in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    _cls.add_implicit_resolver(_INT, re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"), list("-+0123456789"))
    _cls.add_implicit_resolver(_FLOAT, re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
                                                  r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"), list("-+0123456789."))


def _construct_int(loader: YamlLoader, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node)
    if text[:2] in ("0o", "0x"):
        return int(text[2:], 8 if text[1] == "o" else 16)
    digits = text.lstrip("-+")
    if loader.strict_ints and len(digits) > 1 and digits[0] == "0":
        plain = text[: len(text) - len(digits)] + (digits.lstrip("0") or "0")
        raise yaml.constructor.ConstructorError(None, None, f"{text} has a leading zero: write {plain} (or "
                                                f"0o{digits.lstrip('0') or 0} for octal, '{text}' for a string)")
    return int(text, 10)


YamlLoader.add_constructor(_INT, _construct_int)


def load_yaml(text: str, *, strict_ints: bool = False) -> Any:
    """Parse YAML text with :class:`YamlLoader` (YAML 1.2-core numbers)."""
    loader = YamlLoader(text)
    loader.strict_ints = strict_ints
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def parse_overrides(overrides: Iterable[str] | Mapping[str, Any] | None) -> dict[str, Any]:
    """``["a.b=1", "c=[1, 2]"]`` -> ``{"a.b": 1, "c": [1, 2]}`` (values parsed as YAML)."""
    if overrides is None:
        return {}
    if isinstance(overrides, Mapping):
        return dict(overrides)
    parsed: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.sub=value (e.g. loss.params.margin=0.2)")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r} has an empty key")
        try:
            value = _override_value(raw)
        except yaml.constructor.ConstructorError as exc:
            raise ConfigError(f"override {item!r}: {exc.problem}") from None
        except yaml.YAMLError as exc:  # one line (PyYAML's message spans several)
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({' '.join(str(exc).split())})") from None
        if key in parsed and parsed[key] != value:  # the first one was dropped without a word
            raise ConfigError(f"--set {key} is given twice ({parsed[key]!r} and {value!r}): keep one")
        parsed[key] = value
    return parsed


def _override_value(raw: str) -> Any:
    """A ``--set`` value as YAML, but ``x:`` (``sqlite:///:memory:``) stays a string, not ``{x: null}``."""
    value = load_yaml(raw, strict_ints=True) if raw.strip() else None
    mapped = isinstance(value, dict) and not raw.lstrip().startswith("{")
    return raw.strip() if mapped and all(v is None for v in value.values()) else value


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """Set ``a.b.c = value`` in nested mappings; a numeric part indexes a list (``methods.0.x``).
    A mapping's own keys may hold dots (a bench method's ``search: {loss.margin: {...}}``): the
    longest run of parts that names an existing key is taken as that key."""
    parts = key.split(".")
    node: Any = data
    i = 0
    while True:
        if isinstance(node, list):
            if i == len(parts) - 1:
                raise ConfigError(f"cannot set {key!r}: replace the whole list instead")
            try:
                node = node[int(parts[i])]
            except (ValueError, IndexError):
                raise ConfigError(f"cannot set {key!r}: {parts[i]!r} is not an index of the list") from None
            i += 1
            continue
        j = next((j for j in range(len(parts), i + 1, -1) if ".".join(parts[i:j]) in node), i + 1)
        name = ".".join(parts[i:j])
        if j == len(parts):
            node[name] = value
            return
        child = node.get(name)
        if child is None:
            child = {}
            node[name] = child
        if not isinstance(child, dict | list):
            raise ConfigError(f"cannot set {key!r}: {'.'.join(parts[:j])!r} is a value ({child!r}), not a section")
        node, i = child, j


#: The YAML presets shipped inside the package (``src/dmlkit/configs``; the repository's
#: ``configs/`` is a link to it): ``dmlkit train quickstart`` works from a pip install.
PRESET_DIR = Path(__file__).resolve().parent / "configs"


def packaged_presets() -> list[str]:
    """The names of the packaged YAML presets (``quickstart``, ``bench_quick``, ...), sorted."""
    try:
        return sorted(p.stem for p in PRESET_DIR.glob("*.yaml") if p.is_file())
    except OSError:
        return []


def resolve_config_path(path: str | os.PathLike) -> Path:
    """The file a config argument names: ``path`` itself when it exists or has a directory part
    (``configs/quickstart.yaml``, ``./my.yaml``), else the packaged preset of that name
    (``quickstart`` or ``quickstart.yaml``: :func:`packaged_presets`), else ``path`` unchanged.
    A local file of the same name wins over the preset: ``quickstart`` reads an existing
    ``./quickstart.yaml`` (an edited copy) before the packaged one."""
    raw = os.fspath(path)
    path = Path(path)
    if path.exists() or os.path.dirname(raw) or not raw:
        return path
    name = raw if raw.endswith(".yaml") else f"{raw}.yaml"
    if Path(name).is_file():
        return Path(name)
    preset = PRESET_DIR / name
    return preset if Path(name).stem in packaged_presets() else path


def read_yaml_mapping(path: str | os.PathLike, holds: str, examples: str) -> dict[str, Any]:
    """The mapping in a YAML file, or a :class:`ConfigError` saying what is wrong with it.

    ``path`` may also name a packaged preset (:func:`resolve_config_path`); a path that is
    neither a file nor a preset is one error listing the presets."""
    path = resolve_config_path(path)
    if not path.exists():
        presets = packaged_presets()
        hint = (f"pass a YAML file or a packaged preset: {', '.join(presets)}" if presets
                else f"see {examples}")
        raise ConfigError(f"config file not found: {path} ({hint})")
    if path.is_dir():
        raise ConfigError(f"{path} is a directory: pass a YAML config file (see {examples})")
    try:
        data = load_yaml(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not UTF-8 text (byte {exc.start}): save the config as UTF-8 "
                          f"YAML (see {examples})") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {' '.join(str(exc).split())}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of {holds}")
    return data


def _section_model(model: type[BaseModel], path: tuple) -> type[BaseModel] | None:
    """The pydantic model that validates the mapping at ``path`` inside ``model`` (through
    optional, list and dict fields); ``None`` where that is not one model (a free-form mapping,
    a union of several models)."""
    for part in path:
        if isinstance(part, int):  # an item of a list field: its type was unwrapped already
            continue
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        annotation = field.annotation
        while True:
            origin = typing.get_origin(annotation)
            if origin in (list, tuple, dict, typing.Union, types.UnionType):
                args = [a for a in typing.get_args(annotation) if a is not type(None)]
                if origin is dict and len(args) == 2:
                    args = args[1:]
                if len(args) != 1:
                    return None
                annotation = args[0]
                continue
            if origin is typing.Annotated:
                annotation = typing.get_args(annotation)[0]
                continue
            break
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


def _unknown_key_message(model: type[BaseModel] | None, loc: tuple) -> str:
    """``unknown key``, with the closest valid name and every valid one of that section."""
    section = _section_model(model, loc[:-1]) if model is not None and loc else None
    if section is None:
        return "unknown key (check the spelling; docs/configuration.md lists every key)"
    valid = sorted(section.model_fields)
    close = difflib.get_close_matches(str(loc[-1]), valid, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"unknown key ({hint}valid: {', '.join(valid)})"


def format_validation_error(exc: ValidationError, source: str | None, what: str = "experiment config",
                            show_values: bool = True, model: type[BaseModel] | None = None) -> str:
    """One line per invalid key of a pydantic error: ``  key: message (got value)`` (after the
    header on its line; a single problem is one line with the header); an unknown
    key names the valid ones of its section (and the closest) where ``model``, the validated
    class, gives them.

    ``show_values=False`` leaves the given values out (a bench config may hold a storage URL
    with credentials)."""
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err.get("loc", ())) or "<root>"
        msg = err.get("msg", "invalid")
        if err.get("type") == "extra_forbidden":
            msg = _unknown_key_message(model, tuple(err.get("loc", ())))
        elif err.get("type") == "missing":
            msg = "required key is missing"
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        given = err.get("input")
        hidden = not show_values or err.get("type") in ("missing", "extra_forbidden") or isinstance(given, dict)
        shown = "" if hidden else f" (got {given!r})"
        lines.append(f"  {key}: {msg}{shown}")
    where = f" in {source}" if source else ""
    if len(lines) == 1:  # one problem, one line (the CLI's "error: ..." stays one line)
        return f"invalid {what}{where}: {lines[0].strip()}"
    return f"invalid {what}{where}:\n" + "\n".join(lines)


_Model = TypeVar("_Model", bound=BaseModel)


def validate_settings(model: type[_Model], data: Any, what: str, source: str | None = None, *,
                      show_values: bool = True) -> _Model:
    """``model.model_validate(data)``, or a :class:`ConfigError` of
    :func:`format_validation_error` (one line per invalid key, valid names for an unknown one):
    the one way every config of dmlkit (experiment, bench, patches, tracking) reports itself."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source, what, show_values, model=model)) from None
