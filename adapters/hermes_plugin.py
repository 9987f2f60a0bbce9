"""Hermes plugin: the sandboxed terminal tool in Hermes's tool registry.

Installed as the ``hermes-modal-tool`` entry point of the ``hermes_agent.plugins``
group. Hermes loads entry-point plugins only when enabled::

    hermes plugins enable hermes-modal-tool      # adds it to plugins.enabled in config.yaml

Then Hermes's plugin manager imports this module and calls :func:`register`,
which registers the tool ``sandbox_terminal`` in the toolset
``hermes_modal_tool``. Each Hermes ``task_id`` gets its own slot (see
:mod:`hermes_modal_tool.adapters.hermes`); the environment variables described
there configure it.

To make it *the* ``terminal`` tool instead (Hermes's own runs on the host), set
``HERMES_MODAL_TOOL_REPLACE_TERMINAL=1``; Hermes then requires the operator's
grant ``plugins.entries.hermes-modal-tool.allow_tool_override: true`` in
``config.yaml`` (``hermes plugins enable`` asks for it), and refuses to load the
plugin without it.
"""

from __future__ import annotations

import os
from typing import Any

from ..tools import TOOL_SPECS
from .hermes import TERMINAL_TOOL_DESCRIPTION, check_terminal_requirements, run_terminal_call

__all__ = ["REPLACE_TERMINAL_ENV", "TOOL_NAME", "TOOLSET", "handle_tool_call", "register", "tool_schema"]

TOOL_NAME = "sandbox_terminal"
TOOLSET = "hermes_modal_tool"
REPLACE_TERMINAL_ENV = "HERMES_MODAL_TOOL_REPLACE_TERMINAL"


def tool_schema(name: str = TOOL_NAME) -> dict[str, Any]:
    """The tool's schema in Hermes's shape (``name``, ``description``, ``parameters``),
    from the shared ``bash`` contract."""
    return {"name": name, "description": TERMINAL_TOOL_DESCRIPTION,
            "parameters": TOOL_SPECS["bash"].json_schema()}


def handle_tool_call(args: dict[str, Any], **kwargs: Any) -> str:
    """Hermes's handler: the model's arguments, and ``task_id`` from the agent loop
    (``session_id`` and ``user_task`` are ignored). Returns the JSON string."""
    return run_terminal_call(args, task_id=kwargs.get("task_id"))


def register(ctx: Any) -> None:
    """Hermes plugin entry: register the tool through the plugin context."""
    replace = os.environ.get(REPLACE_TERMINAL_ENV, "").strip().lower() in ("1", "true", "yes", "on")
    name = "terminal" if replace else TOOL_NAME
    ctx.register_tool(
        name=name,
        toolset=TOOLSET,
        schema=tool_schema(name),
        handler=handle_tool_call,
        check_fn=check_terminal_requirements,
        description=TERMINAL_TOOL_DESCRIPTION,
        emoji="📦",
        override=replace,
    )
