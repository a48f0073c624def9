"""The daemon's configuration: frozen dataclasses resolved in one place.

Precedence: CLI flags > environment (``HICACHED_<SECTION>_<KEY>``) > TOML file
(``[section] key = value``) > embedded defaults. ``resolve()`` is the only
function that reads any of those sources; everything else receives a
``Config``. An invalid value stops startup with ``ConfigError`` naming the key,
the value and what is allowed — there is no silent fallback.

Each field's ``metadata["help"]`` documents it; ``hicached config show`` and the
README's configuration reference are generated from the same table
(``describe()``).

The L3 backends' options are tables (``[l3.redis]``, ``HICACHED_L3_REDIS_HOST``,
``--set l3.redis.host=...``) that resolve straight into each backend's own frozen
config dataclass (``hicached/l3/<backend>.py``). Every value, the daemon's and the
backends', goes through one typed coercer (:mod:`hicached.coerce`): TOML values
must have the field's type, environment and command-line text is parsed.
Permission modes are octal everywhere: ``0o660`` in TOML (a bare decimal literal
is refused as ambiguous), ``660``/``0660``/``0o660`` as text.

Modules: :mod:`~hicached.config.sections` (the dataclasses),
:mod:`~hicached.config.resolver` (sources, coercion, checks) and
:mod:`~hicached.config.render` (TOML, the key table, env-var warnings).
"""

from __future__ import annotations

from hicached.coerce import parse_size
from hicached.config.render import as_dict, describe, to_toml, toml_value, unknown_env
from hicached.config.resolver import ALIASES, OTHER_ENV, env_var, is_pipe, resolve
from hicached.config.sections import (
    Config,
    ConfigError,
    CopyConfig,
    HostConfig,
    L3Config,
    LimitsConfig,
    LogConfig,
    LogFormat,
    LogLevel,
    ServerConfig,
    SessionConfig,
    available_memory_bytes,
    default_cache_dir,
)

__all__ = [
    "ALIASES",
    "OTHER_ENV",
    "Config",
    "ConfigError",
    "CopyConfig",
    "HostConfig",
    "L3Config",
    "LimitsConfig",
    "LogConfig",
    "LogFormat",
    "LogLevel",
    "ServerConfig",
    "SessionConfig",
    "as_dict",
    "available_memory_bytes",
    "default_cache_dir",
    "describe",
    "env_var",
    "is_pipe",
    "parse_size",
    "resolve",
    "to_toml",
    "toml_value",
    "unknown_env",
]
