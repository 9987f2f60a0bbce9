"""The ``checksum`` op: a file's SHA-256 and size, read through the slot's own view.

Stdlib-only, Python 3.8. The host's streamed transfer (``hermes_modal_tool/filetransfer.py``)
asks for it after the last chunk of an upload or a download, to check the whole file.
The file is opened as the file tools open it (``files.Workspace.open_read``: relative to
the slot's root, never through a link the slot made, with the slot's credentials) and
read in 1 MiB pieces in one of the agent's ``files`` worker threads, never on the loop.
"""

import hashlib

from . import files

PIECE = 1024 * 1024


def _sum(slot, path):
    slot.prepare_dirs()
    slot.ensure_root()
    if slot.root is not None:
        files.preload()  # imports read the agent's own files: not as the slot
    digest = hashlib.sha256()
    size = 0
    with slot.fs_creds():
        fh, _st, shown = slot.workspace.open_read(path)
        with fh:
            while True:
                piece = fh.read(PIECE)
                if not piece:
                    break
                digest.update(piece)
                size += len(piece)
    return {"sha256": digest.hexdigest(), "size": size, "path": shown}


def dispatch(agent, msg):
    """Answer ``{"slot": int, "path": str}`` with ``{"sha256", "size", "path"}``."""
    mid = msg.get("id")
    slot = agent.slots.get(msg.get("slot"))
    path = msg.get("path")
    if slot is None or not isinstance(path, str) or not path or "\x00" in path:
        agent.send({"id": mid, "ok": False, "error": "checksum needs a slot of this sandbox and a "
                    "path, got slot %r path %r" % (msg.get("slot"), path)})
        return

    def done(fut):
        try:
            agent.send({"id": mid, "ok": True, "result": fut.result()})
        except Exception as exc:  # noqa: BLE001 - reported to the host
            agent.send({"id": mid, "ok": False, "error": str(exc)})

    agent.loop.run_in_executor(agent.executor("files"), _sum, slot, path).add_done_callback(done)
