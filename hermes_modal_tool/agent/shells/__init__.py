"""A slot's shell and its processes: starting, driving, capturing, killing.

Owns: the spawner process (``spawner``) and the thread start (``threadstart``) of
layered-root shells; starting a shell (``shellstart``); the persistent bash session and
its end-marker protocol (``shell``, ``output``); finding and stopping a shell's
processes (``shellprocs``, ``procs``, ``owned``); output streamed while a call runs
(``streaming``); processes beside the shell, with a PTY or pipes (``ptyprocs``, and
``ptyhelper``, which runs inside the slot).

May import: :mod:`..limits`, :mod:`..fs`, :mod:`hermes_modal_tool.protocol` and the
standard library. Stdlib-only, Python 3.8.
"""
