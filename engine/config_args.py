"""Frozen config dataclasses as command-line flags, environment variables and a config file.

One source of truth: every field of a config dataclass becomes ``--field-name``, its help is
the field's docstring (read from the source with ``ast``), and its value comes from, in
order of precedence: the flag, ``LORAGATE_FIELD_NAME`` in the environment, the config file
(TOML or YAML, keys as field names with ``_`` or ``-``), the dataclass default. The
dataclass itself validates the result, so a bad value from any source gets the same error.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import os
import textwrap
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
ENV_PREFIX = "LORAGATE_"


def local_path(text: str) -> str:
    """A path flag made absolute once, as it is parsed: engines started from it, the
    gateway's tokenizer and the adapters registered under it all name the same directory,
    whatever their working directory (and `--model .` names the model, not ".")."""
    return str(Path(text).expanduser().resolve())


def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings (a string literal right after a field) of a dataclass."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, following in itertools.pairwise(body):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def load_config_file(path: str | None) -> dict[str, Any]:
    """Keys of a TOML (.toml) or YAML (.yaml/.yml) file, with ``-`` normalized to ``_``."""
    if not path:
        return {}
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"config file {path!r} does not exist")
    if file.suffix == ".toml":
        data = tomllib.loads(file.read_text())
    elif file.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(file.read_text()) or {}
    else:
        raise ValueError(f"config file {path!r} must end in .toml, .yaml or .yml")
    if not isinstance(data, dict):
        raise ValueError(f"config file {path!r} must hold a table of settings")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def _base_type(annotation: Any) -> Any:
    """int / float / bool / str / Literal[...] / tuple[...] of an optional annotation."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return _base_type(args[0])
    return annotation


def _parse_tuple(text: str, annotation: Any) -> tuple[Any, ...]:
    """Comma-separated items; items of a tuple-of-tuples are colon-separated fields."""
    item_type = typing.get_args(annotation)[0]
    items = [part.strip() for part in text.split(",") if part.strip()]
    if typing.get_origin(item_type) is tuple:
        field_types = typing.get_args(item_type)
        parsed = []
        for item in items:
            fields = item.split(":")
            if len(fields) != len(field_types):
                raise ValueError(f"{item!r} must have {len(field_types)} ':'-separated fields")
            parsed.append(tuple(t(f) for t, f in zip(field_types, fields, strict=True)))
        return tuple(parsed)
    return tuple(item_type(item) for item in items)


def convert(value: Any, annotation: Any) -> Any:
    """A flag, env or file value converted to the field's type (ValueError when it fails)."""
    kind = _base_type(annotation)
    if value is None or (isinstance(value, str) and value.lower() in ("none", "")
                         and kind is not str):
        if type(None) not in typing.get_args(annotation):  # not Optional: None would slip
            raise ValueError(f"needs a value, got {value!r}")  # past the dataclass checks
        return None
    if typing.get_origin(kind) is typing.Literal:
        choices = typing.get_args(kind)
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(map(str, choices))}, got {value!r}")
        return value
    if kind is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("1", "true", "yes", "on"):
            return True
        if str(value).lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"must be true or false, got {value!r}")
    if typing.get_origin(kind) is tuple:
        if isinstance(value, str):
            return _parse_tuple(value, kind)
        return tuple(tuple(v) if isinstance(v, list) else v for v in value)
    if kind is int and isinstance(value, float | bool):
        raise ValueError(f"must be an integer, got {value!r}")
    if kind in (int, float):
        try:
            return kind(value)
        except ValueError:  # Python's own text ("invalid literal for int() with base 10")
            raise ValueError(f"must be {'an integer' if kind is int else 'a number'}, got "
                             f"{value!r}") from None
    return kind(value)


def field_default(f: dataclasses.Field[Any]) -> Any:
    """The default of a dataclass field (None when it has none)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def add_config_args(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = (),
                    title: str | None = None, defaults: Mapping[str, Any] | None = None
                    ) -> None:
    """One flag per field of dataclass cls (default None: precedence is resolved later);
    ``defaults``: the defaults the caller applies in place of the dataclass's, as --help
    shows them."""
    group = parser.add_argument_group(title or cls.__name__)
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        default = (defaults or {}).get(f.name, field_default(f))
        kind = _base_type(hints[f.name])
        choices = typing.get_args(kind) if typing.get_origin(kind) is typing.Literal else None
        env = ENV_PREFIX + f.name.upper()
        doc = docs.get(f.name, "")
        # An unset field whose docstring says what unset means: "(default None)" would only
        # repeat it less clearly.
        shown = "" if default is None and "default" in doc.lower() else f"default {default!r}; "
        help_text = f"{doc} ({shown}env {env})"
        parser_kwargs: dict[str, Any] = {"default": None, "help": help_text, "dest": f.name}
        if choices:
            parser_kwargs["choices"] = choices
        metavar = "BOOL" if kind is bool else None
        group.add_argument(f"--{f.name.replace('_', '-')}", metavar=metavar, **parser_kwargs)


def build_config(cls: type[T], args: argparse.Namespace, file_values: Mapping[str, Any],
                 env: Mapping[str, str] | None = None, **fixed: Any) -> T:
    """Instantiate cls from flags > env > file > defaults; ``fixed`` wins over everything."""
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in fixed:
            continue
        for source, raw in (("--" + f.name.replace("_", "-"), getattr(args, f.name, None)),
                            (ENV_PREFIX + f.name.upper(), env.get(ENV_PREFIX + f.name.upper())),
                            ("config file key " + f.name, file_values.get(f.name))):
            if raw is None:
                continue
            try:
                values[f.name] = convert(raw, hints[f.name])
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{source}: {exc}") from None
            sources[f.name] = source
            break
    try:
        return cls(**values, **fixed)
    except ValueError as exc:
        # The config's checks name its fields; the operator typed a flag (or a variable,
        # or a file key): say which, as the conversions above do.
        named = str(exc).split(" ", 1)[0].rstrip(":")
        if named in sources:
            raise ValueError(f"{sources[named]}: {exc}") from None
        raise
