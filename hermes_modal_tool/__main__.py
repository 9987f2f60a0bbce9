"""``python -m hermes_modal_tool``: the ``hermes-modal-tool`` command, for an environment
whose scripts directory is not on ``PATH`` (a ``pip install --target`` tree, say)."""

from hermes_modal_tool.cli import main

main()
