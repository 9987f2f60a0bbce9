"""``python -m hermes_modal_tool.testing.modal_server``: serve until Ctrl-C."""

from .server import main

main()
