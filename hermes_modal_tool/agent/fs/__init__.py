"""The slot's file system: its layered root, mounts, trees, the disk limit, volumes.

Owns: mount syscalls and per-thread file credentials (``mounts``); walking and removing
trees a slot may change (``trees``); writing archive members beneath a directory
descriptor (``beneath``); a slot's copy-on-write root (``rootfs``, ``rootplan``,
``rootprobe``, ``layerspares``); the kernel-enforced ``slot_disk`` limit (``slotdisk``);
the per-slot tmpfs (``slottmpfs``); a workspace-only slot's O(1) reset (``wipes``); the
profile's volumes (``volumes``).

May import: the standard library and modules of this subpackage only (the bottom of
the agent: every other subpackage may import it). Stdlib-only, Python 3.8.
"""
