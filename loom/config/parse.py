"""Reading a configuration: TOML files and shipped presets, nested dicts, ``--section.key value``
overrides (each value coerced to its field's type), and writing it back; :func:`reference` lists
every field."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

from loom.config.sections import SECTIONS, ConfigError, LoomConfig, _field_types, choices

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def _coerce(value: Any, typ: Any, where: str, text: bool = True) -> Any:
    """Convert a TOML or CLI value to ``typ``; raise ConfigError naming ``where``. ``text``: the value
    may be a command line's string for a number or a switch; a TOML file's values carry their type
    (``dim = "64"`` is a string, refused where a number belongs)."""
    if not text and isinstance(value, str) and _base_type(typ) in (bool, int, float):
        kind = {bool: "true or false", int: "an integer", float: "a number"}[_base_type(typ)]
        raise ConfigError(f"{where}: expected {kind}, got the string {value!r} (write it without quotes)")
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if value is None:
            return None
        typ = args[0]
    if typing.get_origin(typ) is Literal:  # checked against its values by validate()
        typ = type(typing.get_args(typ)[0])
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if typ is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if typ is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    if typing.get_origin(typ) is list and typing.get_args(typ) == (float,):  # [1.0, 1.5] or "1.0,1.5"
        items = value.split(",") if isinstance(value, str) and text else value
        if isinstance(items, list) and all(not isinstance(v, bool) for v in items):
            try:
                return [float(v) for v in items if not isinstance(v, str) or v.strip()]
            except (TypeError, ValueError):
                pass
        raise ConfigError(
            f"{where}: expected a list of numbers ([1.0, 1.5], or 1.0,1.5 on a command line), got {value!r}"
        )
    if typing.get_origin(typ) is list:  # a list of tables: [[section.key]] in TOML
        (item,) = typing.get_args(typ)
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            raise ConfigError(
                f"{where}: expected a list of tables ([[{where}]] in a TOML file), got {value!r}"
            )
        types_ = _field_types(item)
        out = []
        for i, table in enumerate(value):
            for k in table:
                if k not in types_:
                    raise ConfigError(f"{where}[{i}].{k}: unknown key; allowed: {', '.join(types_)}")
            out.append(
                item(**{k: _coerce(v, types_[k], f"{where}[{i}].{k}", text) for k, v in table.items()})
            )
        return out
    raise ConfigError(f"{where}: unsupported field type {typ!r}")  # pragma: no cover


def _base_type(typ: Any) -> Any:
    """``typ`` without Optional, and a Literal's value type."""
    if typing.get_origin(typ) in (typing.Union, types.UnionType):
        typ = next(a for a in typing.get_args(typ) if a is not type(None))
    return type(typing.get_args(typ)[0]) if typing.get_origin(typ) is Literal else typ


def _apply(cfg: LoomConfig, section: str, key: str, value: Any, text: bool = True) -> None:
    if section not in SECTIONS:
        raise ConfigError(f"unknown section [{section}]; allowed: {', '.join(SECTIONS)}")
    sub = getattr(cfg, section)
    types_ = _field_types(type(sub))
    if key not in types_:
        allowed = ", ".join(types_)
        raise ConfigError(f"{section}.{key}: unknown key; allowed in [{section}]: {allowed}")
    value = _coerce(value, types_[key], f"{section}.{key}", text)
    if f"{section}.{key}" in PATH_FIELDS:  # a TOML file has no shell to expand ~ (it would be ./~)
        value = (
            [dataclasses.replace(s, path=_home(s.path)) for s in value] if key == "sources" else _home(value)
        )
    setattr(sub, key, value)
    vars(cfg).setdefault(EXPLICIT, set()).add(f"{section}.{key}")


# the fields that name files or directories: a leading ~ is the user's home, as a shell reads it
PATH_FIELDS = frozenset(
    {
        "model.from_hf",
        "data.source",
        "data.sources",
        "data.prepared_dir",
        "data.tokenizer",
        "parallel.offload_dir",
        "parallel.profile",
        "train.resume",
        "train.init_from",
        "run.dir",
    }
)


def _home(path: str) -> str:
    return str(Path(path).expanduser()) if path.startswith("~") else path


EXPLICIT = "_explicit"  # the attribute holding the dotted names a file or override set (not a field)


OVERRIDDEN = "_overridden"  # the names set by --section.key overrides (the last layer)


def overridden(cfg: LoomConfig) -> frozenset[str]:
    """The ``section.key`` names set by ``--section.key value`` overrides (a subset of :func:`explicit`)."""
    return frozenset(vars(cfg).get(OVERRIDDEN, ()))


def explicit(cfg: LoomConfig) -> frozenset[str]:
    """The ``section.key`` names a TOML file, a dict or an override set on ``cfg`` (whatever their
    value), as opposed to defaults; never part of :func:`to_dict` or :func:`dump_toml`."""
    return frozenset(vars(cfg).get(EXPLICIT, ()))


def from_dict(data: dict[str, Any], base: LoomConfig | None = None) -> LoomConfig:
    """Build a config from nested dicts (as TOML gives), starting from ``base`` or defaults."""
    cfg = base if base is not None else LoomConfig()
    for section, table in data.items():
        if section not in SECTIONS:
            raise ConfigError(f"unknown section [{section}]; allowed: {', '.join(SECTIONS)}")
        if not isinstance(table, dict):
            raise ConfigError(f"[{section}] must be a table, got {table!r}")
        for key, value in table.items():
            _apply(cfg, section, key, value, text=False)
    return cfg


PRESET_DIR = Path(__file__).resolve().parent.parent / "configs"


def presets() -> list[str]:
    """Names of the configs shipped with Loom (``loom/configs/*.toml``): ``loom train debug``."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def preset_path(name: str) -> Path:
    """The shipped config called ``name``; an unknown name lists the known ones."""
    p = PRESET_DIR / f"{name}.toml"
    if not p.is_file():
        raise ConfigError(f"unknown preset {name!r}; known: {', '.join(presets())}")
    return p


class ArgParser(argparse.ArgumentParser):
    """``argparse`` for Loom's subcommands: a bad option is one line on stderr and exit code 2
    (argparse's own prints the whole usage first), naming the option and where the help is."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (options: {self.prog} --help)\n")


def read_text_file(
    path: str | Path, name: str, error: type[Exception] = ConfigError, missing: str = ""
) -> str:
    """The UTF-8 text of the file a user named (a config, cluster, trace, profile or metrics file):
    a missing path, a directory or bytes that are not UTF-8 are refused as one line ``error``
    starting with ``name`` (``missing``: a hint added when it does not exist)."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise error(f"{name} is a directory, not a file")
    if not p.is_file():
        raise error(f"{name} does not exist{missing}")
    try:  # a leading byte order mark (Windows editors write one) is not part of the text
        return p.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise error(f"{name} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def load_toml(path: str | Path, base: LoomConfig | None = None) -> LoomConfig:
    """Read a TOML config: a file path, or the name of a shipped preset (``debug``, ``llama3-8b``)."""
    p = Path(path)
    if not p.is_file() and p.suffix != ".toml" and (PRESET_DIR / f"{p.name}.toml").is_file():
        p = PRESET_DIR / f"{p.name}.toml"
    text = read_text_file(p, f"config file {str(p)!r}", missing=f" (or a preset: {', '.join(presets())})")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from None
    return from_dict(data, base)


def apply_overrides(cfg: LoomConfig, args: list[str]) -> LoomConfig:
    """Apply ``--section.key value`` (or ``--section.key=value``) pairs. A field given twice takes the
    later value, as command lines do (a script's common flags, then one changed), with a one-line
    warning naming both when they differ."""
    given: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(f"unexpected argument {arg!r}; overrides look like --section.key value")
        name = arg[2:]
        if "=" in name:
            name, value = name.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"--{name}: missing value")
            value = args[i + 1]
            i += 2
        section, _, key = name.partition(".")
        field = f"{section}.{key.replace('-', '_')}"
        if given.get(field, value) != value:
            logging.getLogger("loom").warning(
                "loom: warning: --%s given twice (%r, then %r): the later is used", field, given[field], value
            )
        given[field] = value
        _apply(cfg, section, key.replace("-", "_"), value)
        vars(cfg).setdefault(OVERRIDDEN, set()).add(field)
    return cfg


def load(path: str | None, overrides: list[str]) -> LoomConfig:
    """Defaults, then the TOML file (if any), then CLI overrides."""
    cfg = load_toml(path) if path else LoomConfig()
    return apply_overrides(cfg, overrides)


def to_dict(cfg: LoomConfig) -> dict[str, dict[str, Any]]:
    return {name: dataclasses.asdict(getattr(cfg, name)) for name in SECTIONS}


def dump_toml(cfg: LoomConfig) -> str:
    import tomli_w

    return tomli_w.dumps(to_dict(cfg))


def field_docs(cls: type) -> dict[str, tuple[str, str, str]]:
    """Field name -> (type, default, one-line doc) of a config dataclass, read from its source: the doc
    is the field's own comment (on its line, or inside a wrapped default), else the comment lines just
    above it."""
    import ast
    import inspect
    import io
    import textwrap
    import tokenize

    src = textwrap.dedent(inspect.getsource(cls))
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = src.splitlines()
    body = ast.parse(src).body[0]
    assert isinstance(body, ast.ClassDef)
    out: dict[str, tuple[str, str, str]] = {}
    for node in body.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value):
            continue
        end = node.end_lineno or node.lineno
        doc = [comments[i] for i in range(node.lineno, end + 1) if i in comments]
        if not doc:  # comment lines directly above the field
            i = node.lineno - 1
            while i >= 1 and lines[i - 1].strip().startswith("#"):
                doc.insert(0, comments.get(i, ""))
                i -= 1
        typ = ast.get_source_segment(src, node.annotation) or ""
        default = " ".join((ast.get_source_segment(src, node.value) or "").split())
        out[node.target.id] = (typ, default, " ".join(doc))
    return out


def reference() -> str:
    """Every field with its type, default, one-line doc (read from the source, :func:`field_docs`) and,
    for a ``Literal`` field, its allowed values."""
    import inspect

    lines = []
    for section, cls in SECTIONS.items():
        lines.append(f"[{section}]  {(inspect.getdoc(cls) or '').partition(chr(10))[0]}")
        types_ = _field_types(cls)
        made = cls()
        for name, (typ, default, doc) in field_docs(cls).items():
            if default.startswith("field("):  # a default_factory: the value it makes
                default = json.dumps(getattr(made, name))  # a list: [] (the sections' only factories)
            allowed = choices(types_[name])
            if allowed:
                typ, doc = (
                    type(allowed[0]).__name__,
                    f"{doc}; one of: {' | '.join(map(str, allowed))}".lstrip("; "),
                )
            lines.append(f"  {section}.{name:<22} {typ:<6} {default:<12} {doc}".rstrip())
        lines.append("")
    return "\n".join(lines)
