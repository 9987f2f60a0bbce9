"""OpenTelemetry spans for the engine's operations, when ``opentelemetry-api`` is installed.

Install the ``otel`` extra (``pip install 'hermes-modal-tool[otel]'``) and configure a
tracer provider as usual (``opentelemetry.trace.set_tracer_provider``); the engine then
emits, under the instrumentation scope ``hermes_modal_tool``:

=============================  ====================================================
span                           attributes (``hmt.`` prefix)
=============================  ====================================================
``hermes_modal_tool.acquire``  profile, trajectory_id, slot_id, sandbox_id
``hermes_modal_tool.execute``  one per tool call: tool, slot_id, trajectory_id,
                               exit_code, success, timed_out, queue_s (waiting: for
                               the slot's earlier calls, its shell, admission, the
                               stream) and run_s (the command's own run time)
``hermes_modal_tool.release``  slot_id, trajectory_id, and the :class:`Usage` figures
``hermes_modal_tool.snapshot`` slot_id, snapshot_id, size_bytes
``hermes_modal_tool.fork``     snapshot_id, count
``hermes_modal_tool.sandbox.start`` / ``.stop``  profile, sandbox_id, driver
=============================  ====================================================

Each span is a child of the caller's current span (contexts follow asyncio tasks), or
of a W3C ``traceparent`` the caller gives with :func:`use_traceparent`. A failed
operation's span records the exception and has status ERROR.

Without the package nothing of OpenTelemetry is imported: :func:`span` returns one
shared do-nothing context manager and :data:`ENABLED` is False (a check of a global).
With the package but no tracer provider set (OpenTelemetry's default proxy), nothing is
recorded either, and each operation pays a clock read (the global provider is looked at
once a second; making a no-op span per tool call anyway cost 28 µs, a tenth of a warm
call, on a loaded machine).
"""

from __future__ import annotations

import contextlib
import importlib.util
import time
from collections.abc import Iterator, Mapping
from typing import Any

#: Whether ``opentelemetry-api`` is installed (checked without importing it).
ENABLED = importlib.util.find_spec("opentelemetry") is not None

SCOPE = "hermes_modal_tool"
_tracer: Any = None
_override: Any = None  # a tracer given by set_tracer()
_seen = (-1e18, False)  # (when, whether a provider was set): active() looks once a second
#: Seconds between two looks at OpenTelemetry's global tracer provider.
RECHECK_S = 1.0


class _NullSpan:
    """What :func:`span` yields without OpenTelemetry: every method does nothing."""

    __slots__ = ()

    def __enter__(self) -> _NullSpan:
        return self

    def __exit__(self, *exc: object) -> bool:
        return False

    def set_attribute(self, key: str, value: Any) -> None:
        pass

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        pass

    def end(self, end_time: int | None = None) -> None:
        pass

    def is_recording(self) -> bool:
        return False


NULL_SPAN = _NullSpan()


def set_tracer(tracer: Any) -> None:
    """Use ``tracer`` (an OpenTelemetry ``Tracer``, e.g. ``provider.get_tracer(SCOPE)``)
    instead of the global provider's; None: back to the global provider."""
    global _tracer, _override
    _tracer = _override = tracer


def active() -> bool:
    """Whether spans are recorded: the package is installed and a tracer was given to
    :func:`set_tracer` or a tracer provider was set (not OpenTelemetry's default proxy;
    looked at once every :data:`RECHECK_S`, so a provider set later counts from then)."""
    global _seen
    if not ENABLED:
        return False
    if _override is not None:
        return True
    now = time.monotonic()
    if now - _seen[0] < RECHECK_S:
        return _seen[1]
    from opentelemetry import trace

    provider = trace.get_tracer_provider()
    _seen = (now, not isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)))
    return _seen[1]


def _get_tracer() -> Any:
    global _tracer
    if _tracer is None:
        from opentelemetry import trace

        from ._version import __version__
        _tracer = trace.get_tracer(SCOPE, __version__)
    return _tracer


def _clean(attributes: Mapping[str, Any] | None) -> dict[str, Any]:
    """``hmt.``-prefixed attributes, without None values (OpenTelemetry drops them noisily)."""
    if not attributes:
        return {}
    return {f"hmt.{k}": v for k, v in attributes.items() if v is not None}


def span(name: str, attributes: Mapping[str, Any] | None = None) -> Any:
    """A context manager: a span ``hermes_modal_tool.{name}`` made current while it is
    entered (the null span when not :func:`active`). Exceptions are recorded on it."""
    if not active():
        return NULL_SPAN
    return _get_tracer().start_as_current_span(f"{SCOPE}.{name}", attributes=_clean(attributes))


def start_span(name: str, attributes: Mapping[str, Any] | None = None) -> Any:
    """A span started now as a child of the current one, not made current; the caller
    ends it (``span.end()``). The null span when not :func:`active`."""
    if not active():
        return NULL_SPAN
    return _get_tracer().start_span(f"{SCOPE}.{name}", attributes=_clean(attributes))


def set_attributes(target: Any, attributes: Mapping[str, Any]) -> None:
    """Add ``hmt.`` attributes to a span (None values left out)."""
    if ENABLED and target is not NULL_SPAN:
        target.set_attributes(_clean(attributes))


def usage_attributes(used: Any) -> dict[str, Any]:
    """A :class:`~hermes_modal_tool.usage.Usage` as ``usage.*`` attributes (numbers and
    strings; calls by tool as ``usage.calls.{tool}``); empty for None."""
    if used is None or not active():
        return {}
    out = {f"usage.{k}": v for k, v in used.as_dict().items() if isinstance(v, (int, float, str))}
    out.update({f"usage.calls.{tool}": n for tool, n in used.calls.items()})
    return out


def end_error(target: Any, exc: BaseException) -> None:
    """Record ``exc`` on a span from :func:`start_span`, set status ERROR and end it."""
    if not ENABLED or target is NULL_SPAN:
        return
    from opentelemetry.trace import Status, StatusCode

    target.record_exception(exc)
    target.set_status(Status(StatusCode.ERROR, str(exc)))
    target.end()


def call_span(slot: Any, tool: str) -> tuple[Any, float]:
    """An ``execute`` span for one tool call sent now: ``(span, start)`` for
    :func:`end_call_span`."""
    return start_span("execute", {"tool": tool, "slot_id": slot.slot_id,
                                  "sandbox_id": slot.sandbox_id,
                                  "trajectory_id": slot.trajectory_id}), time.monotonic()


def end_call_span(target: Any, started: float, result: Any) -> None:
    """End a :func:`call_span` with its :class:`ExecutionResult`: exit code, success,
    the command's own run time (``run_s``, the agent's ``duration_s``) and the rest of
    the round trip (``queue_s``: waiting for the slot's earlier calls, its shell,
    admission, and the stream both ways)."""
    if target is NULL_SPAN:
        return
    total = time.monotonic() - started
    meta = result.metadata
    run = meta.get("duration_s")
    run = float(run) if isinstance(run, (int, float)) and not isinstance(run, bool) else 0.0
    target.set_attributes(_clean({
        "exit_code": meta.get("returncode"), "success": result.success,
        "timed_out": bool(meta.get("timed_out")), "run_s": round(run, 6),
        "queue_s": round(max(0.0, total - run), 6), "execution_id": result.execution_id}))
    if not result.success:
        from opentelemetry.trace import Status, StatusCode

        target.set_status(Status(StatusCode.ERROR, (result.error or f"exit {meta.get('returncode')}")[:200]))
    target.end()


@contextlib.contextmanager
def use_traceparent(traceparent: str | Mapping[str, str] | None) -> Iterator[None]:
    """Make the engine's spans inside the block children of a caller's trace.

    Args:
        traceparent: a W3C ``traceparent`` header value
            (``"00-<32 hex trace id>-<16 hex span id>-<2 hex flags>"``), or a mapping of
            carrier headers (``{"traceparent": ..., "tracestate": ...}``); None: the
            current context as it is.

    Raises:
        ValueError: ``traceparent`` is not a valid header (OpenTelemetry would
            silently start a new trace instead).

    Example:
        >>> with use_traceparent(request.headers["traceparent"]):  # doctest: +SKIP
        ...     slot = await backend.acquire("traj-1")
    """
    if traceparent is None or not ENABLED:
        yield
        return
    from opentelemetry import context, trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier = {"traceparent": traceparent} if isinstance(traceparent, str) else dict(traceparent)
    ctx = TraceContextTextMapPropagator().extract(carrier)
    if not trace.get_current_span(ctx).get_span_context().is_valid:
        raise ValueError(f"traceparent {carrier.get('traceparent')!r:.120} is not a valid W3C "
                         "traceparent ('00-<32 hex>-<16 hex>-<2 hex>')")
    token = context.attach(ctx)
    try:
        yield
    finally:
        context.detach(token)


def current_traceparent() -> str | None:
    """The current span's W3C ``traceparent`` (None without OpenTelemetry or a span)."""
    if not ENABLED:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return carrier.get("traceparent")
