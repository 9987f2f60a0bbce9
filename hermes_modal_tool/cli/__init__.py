"""The command line: run a batch of trajectories, one command, or check a profiles file.

Example:
    hermes-modal-tool batch rollouts.jsonl -o results.jsonl
    hermes-modal-tool exec -- python3 -c 'print(6 * 7)'
    hermes-modal-tool profiles check modal_profiles.yaml
    hermes-modal-tool images list

Exit codes: ``batch`` 0 when every expectation is met, 1 when one is not (or the
engine failed), 2 for bad input (nothing started); ``exec`` the command's own exit
code, 124 on timeout, 125 when the engine could not run it; ``profiles check`` 0
valid, 1 invalid. Ctrl-C, SIGTERM and SIGHUP stop ``batch`` and ``exec`` cleanly (every
sandbox stopped, its state removed), exiting 130, 143 and 129 (128 + the signal).
"""

from __future__ import annotations

import click

from .._version import __version__
from ..mcp_server import mcp_command
from ..protocol import TOOL_ARGS
from ._batch_file import parse_batch
from ._common import InputError, show_config_warnings
from .batch import batch as batch_command
from .exec import exec_ as exec_command
from .images import images as images_group
from .modal import modal_group
from .profiles import profiles as profiles_group

__all__ = ["InputError", "TOOL_ARGS", "main", "parse_batch"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hermes-modal-tool")
def main() -> None:
    """Isolated shell workspaces (slots) for agent trajectories, pooled in sandboxes."""
    show_config_warnings()
    show_image_progress()


def show_image_progress() -> None:
    """Pulling and unpacking an image takes a while: a progress bar per image on a
    terminal, its lines (one per layer) on stderr otherwise (see ``_image_progress``)."""
    import logging

    from ._image_progress import ImageProgress

    images_log = logging.getLogger("hermes_modal_tool.images")
    if not any(isinstance(h, ImageProgress) for h in images_log.handlers):
        images_log.addHandler(ImageProgress())
        images_log.setLevel(logging.INFO)


# One module per command (group); a new command is one more module and one more line here.
for command in (batch_command, exec_command, profiles_group, modal_group, mcp_command,
                images_group):
    main.add_command(command)
