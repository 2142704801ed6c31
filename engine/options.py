"""Backend options from `--engine-option KEY=VALUE` flags and `VOXGATE_<BACKEND>_<KEY>` variables.

Every backend's config is a dataclass; `config_from_options` builds one from
loosely typed options (strings from a command line or the environment),
refusing unknown keys with the list of known ones and converting each string
to its field's type: bool ("1", "true", "yes", "on"), int, float, Path, and
None for an optional field given "none" or "".
"""

from __future__ import annotations

import os
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def config_from_options(cls: type[T], name: str, options: dict[str, Any],
                        env_prefix: str | None = None, environ: dict[str, str] | None = None) -> T:
    """`cls` built from `env_prefix + FIELD` variables, then `options` (which win)."""
    env = os.environ if environ is None else environ
    known = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"unknown {name} option {unknown[0]!r}; expected one of: "
                         f"{', '.join(sorted(known))}")
    values: dict[str, Any] = {}
    for key, f in known.items():
        raw: Any = env.get(env_prefix + key.upper()) if env_prefix else None
        if key in options and options[key] is not None:
            raw = options[key]
        if raw is None:
            continue
        default = f.default if f.default is not MISSING else (
            f.default_factory() if f.default_factory is not MISSING else None)
        values[key] = convert_option(key, raw, default, str(f.type))
    return cls(**values)


def convert_option(key: str, raw: Any, default: Any, annotation: str) -> Any:
    """A string option as its field's type (anything else is passed through as given)."""
    if not isinstance(raw, str):
        return raw
    if "None" in annotation and raw.strip().lower() in ("", "none"):
        return None
    if "Path" in annotation:
        return Path(raw)
    try:
        if isinstance(default, bool) or annotation.startswith("bool"):
            return raw.strip().lower() in ("1", "true", "yes", "on")
        if isinstance(default, int) or annotation.startswith("int"):
            return int(raw)
        if isinstance(default, float) or annotation.startswith("float"):
            return float(raw)
    except ValueError:
        is_int = isinstance(default, int) or annotation.startswith("int")
        kind = "an integer" if is_int else "a number"
        raise ValueError(f"{key} must be {kind}, got {raw!r}") from None
    return raw
