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


def _sum(slot, path, prefix=None):
    slot.prepare_dirs()
    slot.ensure_root()
    if slot.root is not None:
        files.preload()  # imports read the agent's own files: not as the slot
    digest = hashlib.sha256()
    size = 0
    head = None
    with slot.fs_creds():
        fh, _st, shown = slot.workspace.open_read(path)
        with fh:
            while True:
                if size == prefix:
                    head = digest.hexdigest()
                piece = fh.read(PIECE if prefix is None or size >= prefix else min(PIECE, prefix - size))
                if not piece:
                    break
                digest.update(piece)
                size += len(piece)
    out = {"sha256": digest.hexdigest(), "size": size, "path": shown}
    if head is not None:
        out["prefix_sha256"] = head
    return out


def dispatch(agent, msg):
    """Answer ``{"slot": int, "path": str, "prefix"?: int}`` with ``{"sha256", "size",
    "path"}`` and, when the file has at least ``prefix`` bytes, ``prefix_sha256``: the
    SHA-256 of its first ``prefix`` bytes (a resumed download's check), in the same read."""
    mid = msg.get("id")
    slot = agent.slots.get(msg.get("slot"))
    path = msg.get("path")
    prefix = msg.get("prefix")
    if slot is None or not isinstance(path, str) or not path or "\x00" in path or not (
            prefix is None or (isinstance(prefix, int) and not isinstance(prefix, bool) and prefix >= 0)):
        agent.send({"id": mid, "ok": False, "error": "checksum needs a slot of this sandbox, a "
                    "path and a prefix >= 0 or none, got slot %r path %r prefix %r"
                    % (msg.get("slot"), path, prefix)})
        return

    def done(fut):
        try:
            agent.send({"id": mid, "ok": True, "result": fut.result()})
        except Exception as exc:  # noqa: BLE001 - reported to the host
            agent.send({"id": mid, "ok": False, "error": str(exc)})

    agent.loop.run_in_executor(agent.executor("files"), _sum, slot, path, prefix).add_done_callback(done)
