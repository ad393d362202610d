"""What every posenc command line shares: the one-line, exit-2 `Parser`, and settings declared once as dataclass
fields from which the flags, the environment variables, the validation, `--help` and the docs table all come.

Stdlib only (no torch), so the worker, the client, the exporter and training may all import it.

A setting is a dataclass field made with `option(...)`: its type (the annotation), default, range or choices, help
text; the flag is the field's name with dashes (or `flag=`), the environment variable is the prefix plus the flag in
upper case with underscores.  A field whose type is itself such a dataclass (`option(nested=True)`) contributes its
own fields.  The dataclass calls `check(self)` in `__post_init__`, so a value out of range is refused wherever the
settings come from (flags, environment, Python).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any


class Parser(argparse.ArgumentParser):
    """Bad options end in one line on stderr and exit status 2 (argparse's default prints the whole usage)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


class SettingError(ValueError):
    """A setting that cannot work; the message names the flag (and the variable when it came from one)."""


def option(default: Any = dataclasses.MISSING, *, help: str, low: float | None = None, high: float | None = None,
           choices: tuple[str, ...] | None = None, flag: str | None = None, env: bool | str = True,
           ignore_case: bool = False, check: Callable[[Any], str | None] | None = None, shown: str | None = None,
           default_factory: Callable[[], Any] | None = None, nested: bool = False,
           aliases: tuple[str, ...] = ()) -> Any:
    """A dataclass field that is also a command-line flag and (unless env=False) an environment variable.

    env: False for no variable, or its exact name where it is not the prefix plus the flag (a client's
    --tls-cert is POSENC_TLS_CLIENT_CERT: POSENC_TLS_CERT is the worker's own certificate).
    low/high bound numbers (inclusive; booleans are 0 or 1); choices bound strings; `check(value)` returns a reason
    (completing "--flag VALUE ...") when a value cannot work; `shown` is the default as the docs should print it
    (e.g. "the host name" for a default computed at start); aliases are further flags for the same setting
    (without dashes)."""
    meta = {"help": help, "low": low, "high": high, "choices": choices, "flag": flag, "env": env,
            "ignore_case": ignore_case, "check": check, "shown": shown, "nested": nested, "aliases": aliases}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata={"posenc": meta})
    return dataclasses.field(default=default, metadata={"posenc": meta})


@dataclasses.dataclass(frozen=True)
class Spec:
    """One setting as the parser, the checks and the docs see it."""

    name: str  # the field's name in its dataclass
    flag: str  # without the leading dashes
    env: str | None  # the environment variable, or None
    kind: type  # int, float, str, bool or Path
    optional: bool  # None allowed (no default)
    default: Any
    meta: dict

    @property
    def dest(self) -> str:
        return self.flag.replace("-", "_")


def _kind(annotation) -> tuple[type, bool]:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0], True
    return annotation, False


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


_hints = functools.cache(typing.get_type_hints)  # a settings class's annotations, resolved once


def specs(cls, prefix: str = "") -> list[Spec]:
    """Every setting of `cls` (nested dataclasses flattened), in declaration order."""
    hints = _hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        meta = f.metadata.get("posenc")
        if meta is None:
            continue
        if meta["nested"]:
            out.extend(specs(hints[f.name], prefix))
            continue
        kind, optional = _kind(hints[f.name])
        flag = meta["flag"] or f.name.replace("_", "-")
        if isinstance(meta["env"], str):
            env = meta["env"]
        else:
            env = prefix + flag.upper().replace("-", "_") if meta["env"] and prefix else None
        out.append(Spec(f.name, flag, env, kind, optional, _default(f), meta))
    return out


def _number(spec: Spec, raw: str):
    """A raw string (flag or environment) as the setting's type; ValueError when it is not one."""
    if spec.kind is bool:
        return int(raw)  # 0 or 1, checked against its range before it becomes a bool
    return spec.kind(raw)


def _from_env(spec: Spec, environ: Mapping[str, str]):
    raw = environ.get(spec.env) if spec.env else None
    if raw is None:
        return int(spec.default) if spec.kind is bool else spec.default
    if raw == "" and spec.optional:
        return None
    try:
        return _number(spec, raw)
    except ValueError:
        name = "0 or 1" if spec.kind is bool else f"{spec.kind.__name__}"
        raise SettingError(f"{spec.env}={raw!r} is not a valid {name}") from None


def reason(spec: Spec, value) -> str | None:
    """Why `value` cannot be this setting, as one line naming the flag; None when it can."""
    m = spec.meta
    if value is None:
        return None if spec.optional else f"--{spec.flag} needs a value"
    low, high = (0, 1) if spec.kind is bool else (m["low"], m["high"])
    if isinstance(value, int | float) and (low is not None or high is not None):
        if (isinstance(value, float) and math.isnan(value)) or (low is not None and value < low) or (
                high is not None and value > high):
            bounds = (f"between {low} and {high}" if low is not None and high is not None else
                      f">= {low}" if low is not None else f"<= {high}")
            return f"--{spec.flag} must be {bounds}, got {value}"
    if m["choices"] is not None:
        known = [c.lower() for c in m["choices"]] if m["ignore_case"] else list(m["choices"])
        if (str(value).lower() if m["ignore_case"] else str(value)) not in known:
            return f"--{spec.flag} {value!r} is not one of {', '.join(m['choices'])}"
    if m["check"] is not None and (why := m["check"](value)):
        return f"--{spec.flag} {value} {why}"
    return None


def check(settings) -> None:
    """Every field of a settings dataclass (nested ones included) against its range, choices and check."""
    for f in dataclasses.fields(settings):
        meta = f.metadata.get("posenc")
        if meta is None:
            continue
        value = getattr(settings, f.name)
        if meta["nested"]:
            continue  # a nested settings dataclass checked itself when it was built
        spec = next(s for s in specs(type(settings)) if s.name == f.name)
        if why := reason(spec, value):
            raise SettingError(why)


def _help(spec: Spec) -> str:
    m, bits = spec.meta, []
    if spec.kind is bool:
        bits.append("0 or 1")
    elif m["choices"]:
        bits.append(" | ".join(m["choices"]))
    elif m["low"] is not None or m["high"] is not None:
        bits.append(_range(spec))
    bits.append(f"default {shown_default(spec)}")
    if spec.env:
        bits.append(f"env {spec.env}")
    return f"{m['help']} [{'; '.join(bits)}]".replace("%", "%%")


def _range(spec: Spec) -> str:
    low, high = spec.meta["low"], spec.meta["high"]
    if low is not None and high is not None:
        return f"{low}..{high}"
    return f">= {low}" if low is not None else f"<= {high}"


def shown_default(spec: Spec) -> str:
    if spec.meta["shown"] is not None:
        return spec.meta["shown"]
    if spec.default is None:
        return "unset"
    if spec.kind is bool:
        return str(int(spec.default))
    return str(spec.default)


METAVARS = {int: "N", float: "X", Path: "PATH", str: "TEXT"}


def add_options(parser: argparse.ArgumentParser, cls, prefix: str,
                environ: Mapping[str, str] | None = None) -> None:
    """One flag per setting of `cls`, its default taken from the environment when the variable is set.
    Raises SettingError for a variable that does not convert (the caller turns it into parser.error)."""
    environ = os.environ if environ is None else environ
    for spec in specs(cls, prefix):
        kwargs: dict[str, Any] = {"default": _from_env(spec, environ), "help": _help(spec), "dest": spec.dest,
                                  "metavar": METAVARS.get(spec.kind, "TEXT")}
        if spec.meta["choices"]:
            kwargs["metavar"] = "{" + ",".join(spec.meta["choices"]) + "}"
        if spec.kind is bool:
            kwargs.update(type=int, choices=(0, 1), metavar="{0,1}")
        elif spec.kind in (int, float):
            kwargs["type"] = spec.kind
        parser.add_argument(f"--{spec.flag}", *(f"--{a}" for a in spec.meta["aliases"]), **kwargs)


def build(cls, namespace: argparse.Namespace):
    """The settings dataclass from parsed flags; its own checks run as it is built (SettingError)."""
    hints = _hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        meta = f.metadata.get("posenc")
        if meta is None:
            continue
        if meta["nested"]:
            kwargs[f.name] = build(hints[f.name], namespace)
            continue
        spec = next(s for s in specs(cls) if s.name == f.name)
        value = getattr(namespace, spec.dest)
        if spec.kind is bool and value is not None:
            if why := reason(spec, value):
                raise SettingError(why)
            value = bool(value)
        elif spec.kind is Path and value is not None:
            value = Path(value)
        kwargs[f.name] = value
    return cls(**kwargs)


def parse(parser: argparse.ArgumentParser, cls, prefix: str, argv: list[str] | None = None,
          environ: Mapping[str, str] | None = None):
    """Flags and environment -> a checked settings dataclass; anything wrong is parser.error (one line, exit 2)."""
    try:
        add_options(parser, cls, prefix, environ)
        return build(cls, parser.parse_args(argv))
    except SettingError as err:
        parser.error(str(err))


def markdown(cls, prefix: str) -> str:
    """The settings of `cls` as a markdown table: flag, environment variable, type, default, allowed, meaning."""
    rows = ["| flag | environment | type | default | allowed | meaning |", "|---|---|---|---|---|---|"]
    for s in specs(cls, prefix):
        kind = "0 or 1" if s.kind is bool else s.kind.__name__.lower()
        allowed = (" \\| ".join(s.meta["choices"]) if s.meta["choices"] else
                   _range(s) if s.meta["low"] is not None or s.meta["high"] is not None else "")
        help_ = s.meta["help"].replace("|", "\\|")
        flags = " ".join(f"`--{f}`" for f in (s.flag, *s.meta["aliases"]))
        rows.append(f"| {flags} | `{s.env or ''}` | {kind} | {shown_default(s)} | {allowed} | {help_} |")
    return "\n".join(rows) + "\n"


@dataclasses.dataclass(frozen=True)
class ClientTLS:
    """TLS towards a worker: the flags the client CLI (posenc) and the healthcheck share, with the same names and
    variables.  Whether the files can be read and are PEM is checked when the channel is made."""

    tls_ca: Path | None = option(None, env="POSENC_TLS_CA", help="PEM CA that signed the worker's certificate: "
                                                                "use TLS")
    tls_cert: Path | None = option(None, env="POSENC_TLS_CLIENT_CERT", help="PEM client certificate for mutual TLS")
    tls_key: Path | None = option(None, env="POSENC_TLS_CLIENT_KEY", help="PEM key of the client certificate")
    tls_server_name: str | None = option(None, env="POSENC_TLS_SERVER_NAME", help="the name the worker's "
                                         "certificate must carry, when it is not the target's host name")

    def __post_init__(self):
        check(self)
        if (self.tls_cert is None) != (self.tls_key is None):
            raise SettingError("a client certificate needs both --tls-cert and --tls-key "
                               "(POSENC_TLS_CLIENT_CERT / POSENC_TLS_CLIENT_KEY)")
