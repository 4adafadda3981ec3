"""One typed configuration object per service, filled from flags and environment variables.

Each service declares a `msgspec.Struct` whose fields (with defaults) are its settings. `load_config`
turns the fields into command-line flags (`max_batch` → `--max-batch`), reads `<PREFIX>_MAX_BATCH` from
the environment as the fallback, validates the result with msgspec (so a bad value is a clear error, not
a traceback deep inside the service) and returns the typed object. Precedence: flag > env > default.
"""

from __future__ import annotations

import argparse
import os
import types
import typing
from collections.abc import Sequence
from typing import Any, TypeVar

import msgspec

C = TypeVar("C", bound=msgspec.Struct)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _unwrap_optional(tp: Any) -> Any:
    """`int | None` → int; anything else unchanged."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _coerce(tp: Any, raw: str) -> Any:
    """Turn one flag/env string into the JSON-ish value msgspec validates against the field type."""
    tp = _unwrap_optional(tp)
    origin = typing.get_origin(tp)
    if tp is bool:
        return _parse_bool(raw)
    if origin in (list, tuple) or tp in (list, tuple):
        (item,) = typing.get_args(tp)[:1] or (str,)
        return [_coerce(item, part) for part in raw.split(",") if part.strip()]
    if tp in (int, float):
        return tp(raw)
    return raw


def _description(cls: type[msgspec.Struct], name: str) -> str:
    doc = (cls.__doc__ or "").splitlines()
    # Fields are documented in the class docstring as "name: text" lines.
    for line in doc:
        stripped = line.strip()
        if stripped.startswith(f"{name}:"):
            return stripped.split(":", 1)[1].strip()
    return ""


def load_config(
    cls: type[C],
    argv: Sequence[str] | None = None,
    *,
    env_prefix: str,
    prog: str | None = None,
    environ: typing.Mapping[str, str] | None = None,
) -> C:
    """Build `cls` from flags (argv), then `<env_prefix>_<FIELD>` environment variables, then defaults."""
    environ = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    parser = argparse.ArgumentParser(prog=prog, description=(cls.__doc__ or "").split("\n\n")[0])
    for field in msgspec.structs.fields(cls):
        kind = _unwrap_optional(hints[field.name])
        default = None if field.default is msgspec.NODEFAULT else field.default
        help_text = _description(cls, field.name)
        if kind is bool:
            parser.add_argument(
                _flag(field.name),
                dest=field.name,
                default=None,
                action=argparse.BooleanOptionalAction,
                help=_literal(f"{help_text} (default {default})"),
            )
        else:
            parser.add_argument(
                _flag(field.name),
                dest=field.name,
                default=None,
                metavar=field.name.upper(),
                help=_literal(f"{help_text} (default {default!r})"),
            )
    parsed = vars(parser.parse_args(argv))

    values: dict[str, Any] = {}
    for field in msgspec.structs.fields(cls):
        env_name = f"{env_prefix}_{field.name.upper()}"
        raw = parsed[field.name]
        try:
            if isinstance(raw, bool):
                values[field.name] = raw
            elif raw is not None:
                values[field.name] = _coerce(hints[field.name], raw)
            elif env_name in environ:
                values[field.name] = _coerce(hints[field.name], environ[env_name])
        except ValueError as exc:
            parser.error(f"{_flag(field.name)} / {env_name}: {exc}")
    try:
        return msgspec.convert(values, cls)
    except msgspec.ValidationError as exc:
        parser.error(f"invalid configuration: {exc}")
        raise  # unreachable: parser.error exits


def config_dict(cfg: msgspec.Struct) -> dict[str, Any]:
    """The configuration as plain data, for the start-up log line (secrets masked)."""
    data = msgspec.to_builtins(cfg)
    return {k: ("***" if v and _is_secret(k) else v) for k, v in data.items()}


def _is_secret(name: str) -> bool:
    """Names of settings whose values never reach a log: api_key, *_secret, *_password, auth_token, …"""
    return name.endswith(("api_key", "secret", "password", "auth_token", "access_token"))


def _literal(text: str) -> str:
    """A help string as argparse prints it verbatim (it %-formats help strings: "10 %" would crash --help)."""
    return text.replace("%", "%%")
