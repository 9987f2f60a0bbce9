"""Fault injection: refused creates, lost create replies, failed image builds, killed sandboxes."""

from __future__ import annotations

from grpclib import Status

from ._common import _MESSAGES, _STATUSES


class _FaultInjection:
    """Fault injection: refused creates, lost create replies, failed image builds, killed sandboxes.

    A part of :class:`LocalModalServer` (a mixin): it uses the server's state.
    """

    def fail_next_creates(self, n: int = 1, *, status: Status = Status.RESOURCE_EXHAUSTED,
                          message: str = "Sandbox creation rate limit exceeded; try again later") -> None:
        """Make the next ``n`` sandbox creations fail with ``status`` and ``message``.

        With the default status the SDK raises ``modal.exception.ResourceExhaustedError``
        at once; retryable statuses (UNAVAILABLE, INTERNAL, ...) are retried by the SDK
        (up to 3 retries), each retry consuming one failure.
        """
        self._create_failures.extend([(status, message)] * n)

    def lose_create_replies(self, n: int = 1) -> None:
        """Create the next ``n`` sandboxes asked for, but answer each create with
        UNAVAILABLE, as if the connection broke before the reply arrived.

        The SDK retries with the same idempotency key and gets the sandbox already
        made (up to 3 retries, each consuming one lost reply); after that it raises
        ``modal.exception.ServiceError``-like errors while the sandbox runs.
        """
        self._lost_create_replies += n

    def fail_image_builds(self, match: str = "",
                          message: str = "Image build failed (injected by the local server)") -> None:
        """Fail every later build of an image whose tag contains ``match`` ("": all).

        The SDK raises ``modal.exception.ImageBuildError`` (a ``RemoteError``) whose
        text contains ``message``. Cached (already built) images are not affected.
        """
        self._failing_images.append((match, message))

    async def terminate_sandbox(self, sandbox_id: str, *, status: str = "terminated",
                                message: str | None = None) -> None:
        """Kill a sandbox server-side, as Modal would, and record its result.

        Args:
            sandbox_id: the sandbox.
            status: ``"terminated"``, ``"timeout"``, ``"idle_timeout"``, ``"oom"``,
                ``"preempted"`` (an internal failure) or ``"failure"``.
            message: the result's exception text (default: a standard one).

        Raises:
            KeyError: unknown sandbox id. ValueError: unknown status.
        """
        if status not in _STATUSES or status == "success":
            raise ValueError(f"unknown status {status!r}; use one of {sorted(_STATUSES)}")
        sb = self._state_of[sandbox_id]
        await self._finish(sb, status, message if message is not None else _MESSAGES.get(status, ""))
