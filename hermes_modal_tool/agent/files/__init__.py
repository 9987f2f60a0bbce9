"""The file tools: read, write, edit, list, search and checksum a slot's files.

Owns: paths resolved inside a slot's workspace, safe against symlink and swap tricks
(``files``); the tools' entry points (``filetools``); the ``checksum`` op (``filesums``).

May import: :mod:`..fs` and the standard library. Stdlib-only, Python 3.8.
"""
