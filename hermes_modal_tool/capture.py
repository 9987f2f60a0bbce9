"""Run a command in a slot's persistent shell and get its whole output back as bytes.

The ``bash`` tool returns text capped at the profile's ``output_limit`` (the
model reads it). Programs driving a slot (the Agents SDK sandbox session, Deep
Agents' ``execute``) need the whole output, binary-safe, and sometimes stdout and
stderr apart. :func:`run_captured` sends one ``bash`` call that runs the command
in the shell itself (``cd`` and ``export`` persist) with its output in files of the
slot's private ``/tmp``; when the output is small the same call prints it back
base64-encoded (one round trip), otherwise the files are read whole with
``read_artifact`` and removed (one more round trip).
"""

from __future__ import annotations

import base64
import shlex
import uuid
from dataclasses import dataclass

from .sessions import SlotSessions

__all__ = ["CapturedRun", "WHOLE_FILE_BYTES", "run_captured"]

#: Largest output :func:`run_captured` returns by default (bytes per stream).
DEFAULT_MAX_BYTES = 64 * 2**20
#: ``max_bytes`` for a ``read_artifact`` that transfers a whole file (the agent reads at
#: most this much per call; without ``max_bytes`` it returns at most the output cap).
WHOLE_FILE_BYTES = 64 * 2**20

# {out} and {err} are /tmp paths (the workspace when /tmp is not writable). A
# timeout ends the sourced command before the tail runs: no marker, files kept.
_SCRIPT = """__hmc_o={tmp_o}; __hmc_e={tmp_e}
[ -d /tmp ] && [ -w /tmp ] || {{ __hmc_o={ws_o}; __hmc_e={ws_e}; }}
{{ {command}
}} >"$__hmc_o" 2>{err_target}
__hmc_rc=$?
__hmc_n=$(( $(\\command wc -c 2>/dev/null <"$__hmc_o" || echo 0) + $(\\command wc -c 2>/dev/null <"$__hmc_e" || echo 0) ))
if [ "$__hmc_n" -le {small} ]; then
  \\builtin printf '\\036hmc %s small\\n' {nonce}
  \\command base64 -w0 2>/dev/null <"$__hmc_o"; \\builtin printf '\\n'
  \\command base64 -w0 2>/dev/null <"$__hmc_e"; \\builtin printf '\\n'
  \\command rm -f -- "$__hmc_o" "$__hmc_e"
else \\builtin printf '\\036hmc %s file\\n' {nonce}; fi
unset __hmc_o __hmc_e __hmc_n
\\builtin return "$__hmc_rc"
"""
_FETCH = "for n in {names}; do [ -e /tmp/$n ] && \\command mv -f -- /tmp/$n {ws}/$n; done; :"


@dataclass(frozen=True)
class CapturedRun:
    """What :func:`run_captured` returns.

    Attributes:
        stdout: the command's standard output (stdout and stderr interleaved when
            ``merge_stderr``).
        stderr: its standard error (empty when merged).
        exit_code: the exit code (124 on timeout); None when the call failed
            before running (a lost sandbox: see ``error``).
        timed_out: the command ran past its timeout and was killed.
        truncated: an output was longer than ``max_bytes`` and was cut.
        error: the engine's error text (a timeout, a lost sandbox), else None.
    """

    stdout: bytes
    stderr: bytes
    exit_code: int | None
    timed_out: bool = False
    truncated: bool = False
    error: str | None = None


async def run_captured(sessions: SlotSessions, key: str, command: str, *,
                       timeout_s: float | None = None, profile: str | None = None,
                       merge_stderr: bool = False, stdin: str | None = None,
                       max_bytes: int = DEFAULT_MAX_BYTES) -> CapturedRun:
    """Run ``command`` in ``key``'s slot shell; return its whole output.

    Args:
        sessions: the slot map (``key``'s slot is acquired on first use).
        key: the conversation key.
        command: a bash command line (may span lines).
        timeout_s: seconds before the command is killed (exit code 124); None:
            the profile's ``execution_timeout_s``.
        profile: the profile to acquire from.
        merge_stderr: interleave stderr into stdout (as a terminal shows them).
        stdin: text fed to the command (else it reads an empty stdin).
        max_bytes: most bytes returned per stream; more sets ``truncated``.

    Returns:
        A :class:`CapturedRun`. The command is never re-run.

    Raises:
        PoolTimeoutError: no slot became free in time.
        ConfigError: ``profile`` is unknown.
    """
    slot = await sessions.slot(key, profile)
    cap = sessions.backend.profile(slot.profile).output_limit
    nonce = uuid.uuid4().hex
    names = (f".hermes-capture-{nonce}.out", f".hermes-capture-{nonce}.err")
    tmp = [shlex.quote(f"/tmp/{n}") for n in names]
    ws = [shlex.quote(f"{slot.workspace_dir}/{n}") for n in names]
    args: dict[str, object] = {"command": _SCRIPT.format(
        tmp_o=tmp[0], tmp_e=tmp[1], ws_o=ws[0], ws_e=ws[1], command=command,
        err_target="&1" if merge_stderr else '"$__hmc_e"', small=max(0, (cap - 300) * 3 // 4),
        nonce=nonce)}
    if stdin is not None:
        args["stdin"] = stdin
    if timeout_s is not None:
        args["timeout"] = timeout_s
    r = await sessions.execute(key, "bash", args, profile=profile)
    mark = f"\x1ehmc {nonce} "
    where = r.output.rfind(mark)
    rc = r.returncode
    timed_out = bool(r.metadata.get("timed_out"))
    error = r.error if r.error and r.error != f"exit code {rc}" else None
    if where >= 0 and r.output[where + len(mark):].startswith("small"):
        lines = r.output[where:].split("\n")
        out, err = base64.b64decode(lines[1]), base64.b64decode(lines[2])
        return CapturedRun(out[:max_bytes], err[:max_bytes], rc, timed_out,
                           len(out) > max_bytes or len(err) > max_bytes, error)
    if rc is None and where < 0:  # the call never ran (a lost sandbox, a bad request)
        return CapturedRun(r.output.encode(), b"", None, False, False, error or "command failed")
    # Too big for one reply, or ended early (a timeout): read the files whole, remove them.
    rels = list(names)
    results = await sessions.execute_many(key, [
        ("bash", {"command": _FETCH.format(names=" ".join(map(shlex.quote, names)),
                                           ws=shlex.quote(slot.workspace_dir))}),
        *[("read_artifact", {"path": rel, "encoding": "base64", "max_bytes": max_bytes}) for rel in rels],
        ("bash", {"command": f"\\command rm -f -- {ws[0]} {ws[1]}"}),
    ])
    reads = results[1:3]
    streams = [base64.b64decode(x.metadata.get("content", "")) if x.success else b"" for x in reads]
    truncated = any(bool(x.metadata.get("truncated")) for x in reads)
    if where < 0 and not any(x.success for x in reads):
        # Nothing ran: bash refused the command line (a syntax error); its message is the output.
        streams[0 if merge_stderr else 1] = r.output.encode()
    return CapturedRun(streams[0], streams[1], rc, timed_out, truncated, error)
