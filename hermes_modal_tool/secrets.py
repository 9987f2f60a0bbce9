"""Where the local driver finds a profile's secrets.

A profile's ``secrets: [name, ...]`` names Modal secrets on the Modal driver. On the
local driver each name is a dotenv file, ``{name}.env``, looked up in:

1. the directories in ``HERMES_MODAL_TOOL_SECRETS_DIR`` (``os.pathsep``-separated), else
2. ``$XDG_CONFIG_HOME/hermes-modal-tool/secrets`` (``~/.config/hermes-modal-tool/secrets``).

Each file's ``KEY=VALUE`` lines become environment variables of that profile's
slots only. Values are never logged or put in an error message; only names and
file paths are.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from dotenv import dotenv_values

from .errors import SecretNotFoundError

ENV_DIRS = "HERMES_MODAL_TOOL_SECRETS_DIR"


def secret_dirs(env: Mapping[str, str] | None = None) -> list[Path]:
    """The directories searched for ``{name}.env``, in order, as absolute paths (a relative
    ``HERMES_MODAL_TOOL_SECRETS_DIR`` is resolved against the current directory once, here,
    so the same directory is read and hidden from slots)."""
    env = os.environ if env is None else env
    if env.get(ENV_DIRS):
        return [Path(p).expanduser().resolve() for p in env[ENV_DIRS].split(os.pathsep) if p]
    base = env.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return [(Path(base) / "hermes-modal-tool" / "secrets").resolve()]


def resolve_secrets(names: list[str], profile: str, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Return the merged variables of the named secrets (later names win).

    Raises:
        SecretNotFoundError: a name has no file in any searched directory, or its
            file has a line without a value. The message names the secret, the
            profile and the paths searched, never a value.
    """
    dirs = secret_dirs(env)
    values: dict[str, str] = {}
    for name in names:
        for d in dirs:
            path = d / f"{name}.env"
            if path.is_file():
                break
        else:
            searched = ", ".join(str(d / f"{name}.env") for d in dirs)
            raise SecretNotFoundError(
                f"profile {profile!r}: secret {name!r} not found; searched {searched} "
                f"(set {ENV_DIRS} to change where secrets are read from)")
        parsed = dotenv_values(path)
        for key, value in parsed.items():
            if value is None:
                raise SecretNotFoundError(
                    f"profile {profile!r}: secret {name!r} ({path}): variable {key!r} has no value")
            values[key] = value
    return values
