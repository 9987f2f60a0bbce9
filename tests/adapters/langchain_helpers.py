"""Helpers for the LangChain adapter tests: a scripted chat model and a backend
that lives on the sync portal's loop (usable from sync code and from every
test's own event loop).

The scripted model: the last human message is a JSON list of ``[tool_name, args]``
steps. Turn N after that message answers with step N as a tool call; after the
last step it answers with the content of the last tool result. No network, no
randomness.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import support
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult

#: The sizes the adapter tests use (2 cores: keep it small).
SIZES: dict[str, Any] = {"slots_per_sandbox": 4, "min_sandboxes": 1, "max_sandboxes": 2,
                         "memory": 1024, "acquire_timeout_s": 10.0, "execution_timeout_s": 20.0}


def portal_backend(**fields: Any):
    """A started backend on the portal loop; stopped (and checked for leftovers) on exit."""
    return support.portal_backend("lc", SIZES, **fields)


def steps(*calls: tuple[str, dict[str, Any]]) -> HumanMessage:
    """The user's message: run these ``(tool, args)`` calls in order."""
    return HumanMessage(content=json.dumps([list(c) for c in calls]))


class ScriptedChatModel(BaseChatModel):
    """Emits the tool calls listed in the last human message, one per turn."""

    @property
    def _llm_type(self) -> str:
        return "scripted"

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> ScriptedChatModel:
        return self

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: Any = None, **kwargs: Any) -> ChatResult:
        last_human = max(i for i, m in enumerate(messages) if isinstance(m, HumanMessage))
        script = json.loads(messages[last_human].content)
        turn = sum(isinstance(m, AIMessage) for m in messages[last_human:])
        if turn < len(script):
            name, args = script[turn]
            message = AIMessage(content="", tool_calls=[
                {"name": name, "args": args, "id": f"call_{last_human}_{turn}", "type": "tool_call"}])
        else:
            results = [m for m in messages[last_human:] if isinstance(m, ToolMessage)]
            message = AIMessage(content=str(results[-1].content) if results else "nothing to do")
        return ChatResult(generations=[ChatGeneration(message=message)])
