"""Framework adapters (LangChain, OpenAI function calling, Hermes), installed as
``hermes_modal_tool.adapters``. Thin: they translate a framework's tool call into
engine calls and hold no pool logic."""
