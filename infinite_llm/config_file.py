"""Configuration of ``infinite-llm`` commands from flags, ``INFINITE_LLM_*`` variables and a YAML file.

Precedence: a flag beats an environment variable, which beats the YAML file, which beats the default.
Environment variables follow click's naming: ``INFINITE_LLM_<COMMAND PATH>_<OPTION>`` in upper case, e.g.
``INFINITE_LLM_SERVE_ATTENTION_KV_MEMORY=2GiB``. The YAML file (``--config FILE`` or ``INFINITE_LLM_CONFIG``)
mirrors the command tree with option names as keys (dashes or underscores)::

    serve:
      attention:
        kv_memory: 2GiB
        manager: 10.0.0.5:50050
    up:
      attention_servers: 4

Unknown commands or options are errors (``typer.BadParameter`` on ``--config``) that name the key path, so a
typo never passes silently.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
import yaml

ENV_PREFIX = "INFINITE_LLM"


def ConfigError(message: str) -> typer.BadParameter:  # noqa: N802 - reads as the exception it builds
    return typer.BadParameter(message, param_hint="--config")


def load_config(path: str | Path, root: Any) -> dict[str, Any]:
    """Read and validate ``path`` against the command tree ``root``; returns click's ``default_map``."""
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of commands, not {type(data).__name__}")
    return _check(data, root, path, [])


def _check(data: dict, command: Any, path: str | Path, where: list[str]) -> dict[str, Any]:
    """Walk ``data`` along the click command tree (typer vendors click, so this duck-types groups)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        here = ".".join([*where, str(key)])
        if hasattr(command, "commands"):
            sub = command.commands.get(str(key)) or command.commands.get(str(key).replace("_", "-"))
            if sub is None:
                known = ", ".join(sorted(command.commands))
                raise ConfigError(f"{path}: unknown command '{here}' (known: {known})")
            if not isinstance(value, dict):
                raise ConfigError(f"{path}: '{here}' must be a mapping of options")
            out[sub.name] = _check(value, sub, path, [*where, sub.name])
            continue
        params = {p.name for p in command.params if getattr(p, "param_type_name", "") == "option"}
        if name not in params:
            raise ConfigError(f"{path}: unknown option '{here}' (known: {', '.join(sorted(params))})")
        out[name] = value
    return out
