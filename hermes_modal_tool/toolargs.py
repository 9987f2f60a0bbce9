"""The tools the agent knows and their arguments: names, the argument table, and the
check each ``call`` passes before anything runs (on the host, and in the agent for what
another host might send). Re-exported by :mod:`hermes_modal_tool.protocol`.

Stdlib-only, Python 3.8 (the agent's bundle holds it).
"""

#: Tools the agent knows, in the order error messages list them.
TOOLS = (
    "bash",
    "read_file",
    "write_file",
    "list_files",
    "read_artifact",
    "list_artifacts",
    "archive_artifacts",
)

#: Each tool's arguments: name -> (kind, required). Kinds: str, number, int, bool,
#: encoding (``text``/``base64``), output_encoding (``text``/``bytes``: what a bash
#: result's stdout and stderr hold), env (``{NAME: value}``). The agent rejects other keys.
TOOL_ARGS = {
    "bash": {"command": ("str", True), "timeout": ("number", False), "background": ("bool", False),
             "stdin": ("str", False), "env": ("env", False), "encoding": ("output_encoding", False),
             "pty": ("bool", False), "rows": ("cells", False), "cols": ("cells", False)},
    "read_file": {"path": ("str", True), "offset": ("int", False), "limit": ("int", False),
                  "byte_offset": ("int", False), "encoding": ("encoding", False)},
    "write_file": {"path": ("str", True), "content": ("str", True), "encoding": ("encoding", False),
                   "append": ("bool", False)},
    "list_files": {"path": ("str", False), "recursive": ("bool", False), "max_entries": ("int", False)},
    "read_artifact": {"path": ("str", True), "encoding": ("encoding", False), "max_bytes": ("int", False),
                      "offset": ("int", False), "include_sha256": ("bool", False)},
    "list_artifacts": {"path": ("str", False), "recursive": ("bool", False), "max_entries": ("int", False)},
    "archive_artifacts": {"path": ("str", False), "archive_format": ("str", False),
                          "max_bytes": ("int", False), "max_entries": ("int", False)},
}

#: Longest timeout a call may ask for (seconds).
MAX_TIMEOUT_S = 86400.0
_KIND_WORDS = {
    "str": "a string", "number": "a positive number of seconds (at most %d)" % MAX_TIMEOUT_S,
    "int": "a whole number >= 0", "bool": "true or false",
    "cells": "a whole number of character cells from 1 to 65535",
    "encoding": "'text' or 'base64'", "output_encoding": "'text' or 'bytes'", "env": "an object mapping variable names to strings",
}


#: Each tool's required arguments.
_REQUIRED = {tool: tuple(k for k, (_, required) in spec.items() if required)
             for tool, spec in TOOL_ARGS.items()}


def check_args(tool, args):
    """Check a tool call's arguments against :data:`TOOL_ARGS`.

    Returns None when they are fine, else a message naming the bad argument and its
    value. Both the host (CLI, before anything starts) and the agent use it.
    """
    spec = TOOL_ARGS.get(tool)
    if spec is not None and type(args) is dict and _all_fine(spec, _REQUIRED[tool], args):
        return None  # the common case, in a pass over the given arguments only
    return _first_problem(tool, spec, args)


def _all_fine(spec, required, args):
    for key, value in args.items():
        entry = spec.get(key)
        if entry is None:
            return False
        if value is None:
            if entry[1]:
                return False
            continue
        if _check_kind(entry[0], value) is not None:
            return False
        if isinstance(value, str) and "\x00" in value and key != "content":
            return False
    for key in required:
        if key not in args:
            return False
    return True


def _first_problem(tool, spec, args):
    """What :func:`check_args` says of arguments that are not all fine: the first
    problem in :data:`TOOL_ARGS` order (None if there is none after all)."""
    if spec is None:
        return "unknown tool %r; known tools: %s" % (tool, ", ".join(TOOLS))
    if not isinstance(args, dict):
        return "%s arguments must be an object, got %s" % (tool, type(args).__name__)
    extra = sorted(str(k) for k in args if k not in spec)
    if extra:
        return "%s has no argument %s; it takes: %s" % (
            tool, ", ".join(repr(k) for k in extra), ", ".join(spec))
    for key, (kind, required) in spec.items():
        if key not in args or (args[key] is None and not required):
            if required:
                return "missing required argument %r of %s" % (key, tool)
            continue
        value = args[key]
        problem = _check_kind(kind, value)
        if problem is None and isinstance(value, str) and "\x00" in value and key != "content":
            problem = "contains a NUL byte"
        if problem is not None:
            shown = repr(value)
            if len(shown) > 80:
                shown = shown[:77] + "..."
            return "%s argument %r must be %s, got %s%s" % (
                tool, key, _KIND_WORDS[kind], shown, "" if problem is True else " (%s)" % problem)
    return None


def _check_kind(kind, value):
    """None if ``value`` is of ``kind``; True or a reason otherwise."""
    if kind == "str":
        return None if isinstance(value, str) else True
    if kind == "bool":
        return None if isinstance(value, bool) else True
    if kind == "cells":  # a terminal's rows or columns (a 16-bit field of the kernel's winsize)
        return None if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 65536 else True
    if kind == "int":
        return None if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else True
    if kind == "number":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return True
        return None if 0 < value <= MAX_TIMEOUT_S else True  # NaN fails both comparisons
    if kind == "encoding":
        return None if value in ("text", "base64") and isinstance(value, str) else True
    if kind == "output_encoding":
        return None if value in ("text", "bytes") and isinstance(value, str) else True
    if kind == "env":
        if not isinstance(value, dict):
            return True
        for name, val in value.items():
            if not (isinstance(name, str) and name and (name[0].isalpha() or name[0] == "_")
                    and all(c.isalnum() or c == "_" for c in name) and name.isascii()):
                return "%r is not a variable name" % (name,)
            if not isinstance(val, str) or "\x00" in val:
                return "the value of %s is not a string without NUL bytes" % name
        return None
    raise ValueError(kind)

