"""A workspace-only slot's reset in O(1): its workspace is renamed away and a fresh one
made; the old tree is deleted in the background (one worker thread, "trash"), however
deep or wide it is, so a reset never waits on what the slot wrote (100,000 nested
directories take a minute of disk I/O on a busy machine). Stdlib-only (Python 3.8).
"""

import itertools
import os

from . import trees

_SEQ = itertools.count()


def swap_out(workspace):
    """Rename ``workspace.host`` to a root-only sibling (``.hmt-trash-*``, mode 0700, so
    nobody, the slot's uid included, can enter it) and make a fresh, empty workspace.

    Call only when nothing of the slot runs (its shell and processes are gone: a
    running one would keep the old directory). Blocking (a few syscalls).

    Returns:
        The trash path, to pass to :func:`remove`; None when there was no workspace.
    Raises:
        OSError: the rename failed (the caller falls back to wiping in place).
    """
    host = workspace.host
    if not os.path.isdir(host):
        return None
    trash = os.path.join(os.path.dirname(host), ".hmt-trash-%s-%d-%d" % (
        os.path.basename(host), os.getpid(), next(_SEQ)))
    os.rename(host, trash)
    if os.geteuid() == 0:
        os.chown(trash, 0, 0)
    os.chmod(trash, 0o700)
    workspace.wipe()  # makes the new, empty directory with the slot's owner and mode
    return trash


def remove(trash):
    """Delete a tree :func:`swap_out` moved away (iterative; see :mod:`.trees`)."""
    trees.remove_tree(trash)


async def reset_workspace(agent, workspace, stopped):
    """Empty a workspace-only slot's workspace for its next tenant: swapped out in O(1)
    and deleted in the background when nothing of the slot runs (``stopped``), else (a
    fresh, unused shell holds the directory) emptied in place; both off the event loop.

    Raises:
        OSError: the workspace could not be emptied (the host quarantines the slot).
    """
    loop = agent.loop
    if stopped:
        try:
            trash = await loop.run_in_executor(agent.executor("files"), swap_out, workspace)
        except OSError:
            trash = None
        else:
            if trash is not None:
                agent.executor("trash").submit(remove, trash)
            return
    await loop.run_in_executor(agent.executor("files"), workspace.wipe)
