"""PTY sessions of the Agents SDK adapter (:mod:`.openai_agents`): the SDK's
``pty_exec_start``/``pty_write_stdin``/``pty_terminate_all`` on processes of the
session's slot (:meth:`ToolBackend.start_process`), their output gathered by the SDK's
own collector (``collect_pty_output``: yield time, early return at the end, a cut UTF-8
character carried over, token truncation) as its Unix-local and Modal clients do."""

from __future__ import annotations

import asyncio
import shlex
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agents.sandbox.errors import ExecTransportError
from agents.sandbox.session.pty_output import collect_pty_output
from agents.sandbox.session.pty_types import (
    PTY_PROCESSES_MAX,
    PtyExecUpdate,
    allocate_pty_process_id,
    clamp_pty_yield_time_ms,
    process_id_to_prune_from_meta,
    resolve_pty_write_yield_time_ms,
)
from agents.sandbox.types import User

from hermes_modal_tool.errors import HermesModalToolError, SandboxError, UsageError
from hermes_modal_tool.processes import SlotProcess

if TYPE_CHECKING:
    from collections.abc import Mapping

    from hermes_modal_tool.sessions import SlotSessions


class PtyMethods:
    """Mixed into :class:`~.openai_agents.SlotSandboxSession` (before the SDK's base)."""

    if TYPE_CHECKING:
        _sessions: SlotSessions
        _pty: dict[int, PtyEntry]
        _pty_lock: asyncio.Lock
        state: Any

        def _prepare_exec_command(self, *command: str | Path, shell: bool | list[str],
                                  user: str | User | None) -> list[str]: ...

        def _resolve_pty_session_entry(self, *, pty_processes: Mapping[int, PtyEntry],
                                       session_id: int) -> PtyEntry: ...

    async def pty_exec_start(self, *command: str | Path, timeout: float | None = None,
                             shell: bool | list[str] = True, user: str | User | None = None,
                             tty: bool = False, yield_time_s: float | None = None,
                             max_output_tokens: int | None = None) -> PtyExecUpdate:
        """Start ``command`` as a process of the slot beside its shell
        (:meth:`ToolBackend.start_process`; ``shell=True``: with ``bash -lc``): on a
        terminal of 24 x 80 when ``tty``, else on pipes with stdin from ``/dev/null``
        (stdout and stderr interleaved). Collects its output for ``yield_time_s``
        seconds (default 10, clamped to 0.25-30), returning early when it ends.
        ``timeout``: seconds after which it is killed (None: it runs until it ends,
        :meth:`pty_terminate_all` or the slot's release).

        Returns:
            the SDK's ``PtyExecUpdate``: the output (UTF-8, cut to ``max_output_tokens``
            tokens as the SDK's other clients do); while it runs, ``process_id`` (the
            ``session_id`` of :meth:`pty_write_stdin`) and no exit code; once it ended,
            its ``exit_code`` (``-N``: killed by signal N) and no ``process_id``.

        Raises:
            UsageError: ``user`` is given.
            ExecTransportError: it could not be started (no slot, no ``python3`` in the
                slot, ...); ``context["retry_safe"]`` is True (nothing ran), so the SDK's
                ``exec_command`` falls back to a one-shot exec for ``tty=False``.
        """
        no_user(user)
        # bash, not the SDK's default `sh -lc`: Debian's sh (dash) waits for its command
        # and dies at a Ctrl-C the program itself handles, ending the session.
        argv = self._prepare_exec_command(*command, shell=["bash", "-lc"] if shell is True else shell, user=None)
        line = "exec " + shlex.join(argv) + ("" if tty else " </dev/null")
        try:
            slot = await self._sessions.slot(self.state.slot_key, self.state.profile)
            proc = await self._sessions.backend.start_process(slot, line, pty=tty)
        except HermesModalToolError as exc:
            raise ExecTransportError(command=argv, message=f"could not start the process: {exc}",
                                     context={"retry_safe": True}, cause=exc) from exc
        entry = PtyEntry(proc, tty)
        if timeout is not None:
            entry.killer = asyncio.create_task(_kill_after(proc, timeout))
        async with self._pty_lock:
            process_id = allocate_pty_process_id(set(self._pty))
            pruned = self._prune_pty()
            self._pty[process_id] = entry
        if pruned is not None:
            await pruned.terminate()
        yield_ms = 10_000 if yield_time_s is None else int(yield_time_s * 1000)
        return await self._pty_update(process_id, entry, clamp_pty_yield_time_ms(yield_ms), max_output_tokens)

    async def pty_write_stdin(self, *, session_id: int, chars: str, yield_time_s: float | None = None,
                              max_output_tokens: int | None = None) -> PtyExecUpdate:
        """Type ``chars`` into process ``session_id`` (``"\\x03"``: Ctrl-C) and collect
        its output for ``yield_time_s`` seconds (default 0.25; at least 5 when ``chars``
        is empty, a poll), returning early when it ends; the update is as
        :meth:`pty_exec_start`'s.

        Raises:
            PtySessionNotFoundError: no running process has that id (it ended and its
                exit code was reported, or it was terminated).
            RuntimeError: ``"stdin is not available for this process"``: it was started
                with ``tty=False`` and ``chars`` is not empty (the SDK's message, which its
                ``write_stdin`` tool turns into advice to the model).
        """
        async with self._pty_lock:
            entry = self._resolve_pty_session_entry(pty_processes=self._pty, session_id=session_id)
        if chars:
            if not entry.tty:
                raise RuntimeError("stdin is not available for this process")
            try:
                await entry.proc.write(chars)
            except SandboxError:
                pass  # it has ended: the update below says with which exit code
        yield_ms = 250 if yield_time_s is None else int(yield_time_s * 1000)
        entry.last_used = time.monotonic()
        return await self._pty_update(session_id, entry, resolve_pty_write_yield_time_ms(
            yield_time_ms=yield_ms, input_empty=chars == ""), max_output_tokens)

    async def pty_terminate_all(self) -> None:
        """Kill (SIGKILL, process group) every process this session started and forget
        them; releasing the slot kills them as well."""
        async with self._pty_lock:
            entries = list(self._pty.values())
            self._pty.clear()
        for entry in entries:
            await entry.terminate()

    async def _pty_update(self, process_id: int, entry: PtyEntry, yield_ms: int,
                          max_output_tokens: int | None) -> PtyExecUpdate:
        try:
            output, tokens, closed = await collect_pty_output(
                output_chunks=entry.chunks, output_lock=entry.lock, output_notify=entry.notify,
                is_done=lambda: entry.exit_code is not None, yield_time_ms=yield_ms,
                max_output_tokens=max_output_tokens, poll_output=entry.poll,
                settle_output=entry.settle, wait_for_output=_no_wait)
        except HermesModalToolError as exc:  # e.g. the slot was released: its processes died with it
            async with self._pty_lock:
                self._pty.pop(process_id, None)
            raise ExecTransportError(command=(entry.proc.command,), cause=exc,
                                     message=f"process {process_id} was lost: {exc}") from exc
        if not closed:
            return PtyExecUpdate(process_id=process_id, output=output, exit_code=None,
                                 original_token_count=tokens)
        async with self._pty_lock:
            self._pty.pop(process_id, None)
        await entry.terminate()
        return PtyExecUpdate(process_id=None, output=output, exit_code=entry.exit_code,
                             original_token_count=tokens)

    def _prune_pty(self) -> PtyEntry | None:
        """At the SDK's limit of processes per session, the entry to drop (as its clients:
        the least recently used ended one, else the least recently used not among the
        newest few)."""
        if len(self._pty) < PTY_PROCESSES_MAX:
            return None
        victim = process_id_to_prune_from_meta(
            [(pid, e.last_used, e.exit_code is not None) for pid, e in self._pty.items()])
        return None if victim is None else self._pty.pop(victim, None)


@dataclass(eq=False)
class PtyEntry:
    """A process of an SDK session: its handle and the output read but not yet returned
    (``chunks``, which the SDK's collector drains; it carries a cut UTF-8 character)."""

    proc: SlotProcess
    tty: bool
    exit_code: int | None = None
    last_used: float = field(default_factory=time.monotonic)
    chunks: deque[bytes] = field(default_factory=deque)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    notify: asyncio.Event = field(default_factory=asyncio.Event)
    killer: asyncio.Task[None] | None = None

    async def poll(self, deadline: float) -> None:
        """Read what came, waiting until ``deadline`` (``time.monotonic()``) for some; an
        empty read is the deadline or the end, which ``wait(0)`` tells apart."""
        if self.exit_code is not None:
            return
        data = await self.proc.read(wait_s=max(0.0, deadline - time.monotonic()))
        if data:
            self.chunks.append(data)
            return
        code = await self.proc.wait(timeout_s=0)
        if code is not None:
            self.chunks.append(await self.proc.read())  # what came just before the end
            self.exit_code = code

    async def settle(self) -> None:
        """At the deadline: take what has already come, without waiting."""
        if self.exit_code is None:
            self.chunks.append(await self.proc.read())

    async def terminate(self) -> None:
        if self.killer is not None:
            self.killer.cancel()
        if self.exit_code is None:
            try:
                await self.proc.signal("KILL")
            except HermesModalToolError:
                pass  # it ended meanwhile, or the slot (and it) is gone


async def _no_wait(remaining_s: float) -> None:
    """The collector's pause between polls: none, as a poll itself waits for output."""


async def _kill_after(proc: SlotProcess, timeout_s: float) -> None:
    await asyncio.sleep(timeout_s)
    try:
        await proc.signal("KILL")
    except HermesModalToolError:
        pass  # it has ended


def no_user(user: str | User | None) -> None:
    if user is not None:
        raise UsageError(f"running as another user ({user!r}) is not supported by slot sessions")
