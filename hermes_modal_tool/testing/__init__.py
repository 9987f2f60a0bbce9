"""Test helpers that notebooks and downstream projects can import too (stdlib only).

:mod:`hermes_modal_tool.testing.openai_server` is a scripted stand-in for the
OpenAI API on 127.0.0.1, for exercising the OpenAI adapter without a network.
"""
