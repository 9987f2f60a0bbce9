"""One contract per model-facing tool: name, description, argument schema.

The LangChain, OpenAI and Hermes adapters all derive their schemas from
:data:`TOOL_SPECS`, so the model reads the same words in every framework. The
descriptions are written for the model.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

OUTPUT_LIMIT_NOTE = (
    "Output (stdout and stderr interleaved) is capped at about 50,000 characters; when it "
    "is longer, the start and the end are kept with a marker saying how much was cut, so "
    "redirect big outputs to a file and read parts of it.")

BASH_DESCRIPTION = (
    "Run a shell command in your own sandboxed Linux workspace and return its output and "
    "exit code. The shell is persistent: `cd`, `export`, variables and functions carry over "
    "to your next call, and files stay until the task ends. Your workspace directory is "
    "the starting directory and $HOME; other tasks' files are not visible. A command that "
    "runs longer than its timeout is stopped with exit code 124, the output it printed so "
    "far is kept, and the shell stays usable in the same directory. Interactive programs "
    "get no input (stdin is empty unless you pass `stdin`); pass `background: true` for "
    "servers or long jobs, which return at once and log to a file in the workspace. "
    + OUTPUT_LIMIT_NOTE)

READ_FILE_DESCRIPTION = (
    "Read a text file from your workspace. `path` is relative to the workspace (or an "
    "absolute path inside it). Returns the file's lines; use `offset` (first line, 0-based) "
    "and `limit` (number of lines) to read a part of a big file. A read returns at most "
    "about 50,000 characters of whole lines: when the file goes on, the result ends with "
    "a note `[the file goes on: ... call read_file with offset=N]`; call read_file again "
    "with that `offset` (and `byte_offset`, when the note gives one: it continues a line "
    "longer than one read) to get the next part, until no note is left. Use encoding "
    "`base64` for binary files (then `offset`/`limit` count bytes).")

LIST_FILES_DESCRIPTION = (
    "List the files and directories under a path of your workspace (directories end with "
    "`/`). `path` is relative to the workspace (or an absolute path inside it); "
    "`recursive: true` walks subdirectories too.")

WRITE_FILE_DESCRIPTION = (
    "Write a file in your workspace, creating parent directories as needed. Replaces the "
    "file unless `append` is true. `path` is relative to the workspace (or an absolute path "
    "inside it). Use this instead of shell heredocs or echo for file contents: there are no "
    "quoting or size problems.")


class BashArgs(BaseModel):
    """Arguments of the ``bash`` tool."""

    model_config = ConfigDict(extra="forbid")

    command: str = Field(description="The command line to run with bash, e.g. `ls -la` or `cd src && make`.")
    timeout: float | None = Field(
        default=None, gt=0, le=86400,
        description="Seconds to let the command run before it is stopped (exit code 124). "
                    "Leave empty for the default.")
    background: bool = Field(
        default=False,
        description="Start the command in the background and return at once (for servers or "
                    "long jobs); its output goes to a log file in the workspace.")
    stdin: str | None = Field(default=None, description="Text to feed to the command's standard input.")


class ReadFileArgs(BaseModel):
    """Arguments of the ``read_file`` tool."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="File path, relative to the workspace.")
    offset: int = Field(default=0, ge=0, description="First line to return (0-based); bytes for base64.")
    limit: int | None = Field(default=None, ge=1, description="Most lines to return (bytes for base64); empty for all.")
    byte_offset: int | None = Field(
        default=None, ge=0,
        description="Bytes of line `offset` to skip: only to go on inside a line longer than one read, "
                    "as a read's note says; empty otherwise.")
    encoding: Literal["text", "base64"] = Field(default="text", description="`text`, or `base64` for binary files.")


class WriteFileArgs(BaseModel):
    """Arguments of the ``write_file`` tool."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="File path, relative to the workspace.")
    content: str = Field(description="The full file content (base64 when encoding is `base64`).")
    encoding: Literal["text", "base64"] = Field(default="text", description="`text`, or `base64` for binary content.")
    append: bool = Field(default=False, description="Append to the file instead of replacing it.")


class ListFilesArgs(BaseModel):
    """Arguments of the ``list_files`` tool."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(default=".", description="Directory to list, relative to the workspace.")
    recursive: bool = Field(default=False, description="Also list what is inside subdirectories.")
    max_entries: int | None = Field(default=None, ge=1, le=100_000,
                                    description="Most entries to return; empty for the default (1000).")


@dataclass(frozen=True)
class ToolSpec:
    """A model-facing tool: its name, its description and its argument model."""

    name: str
    description: str
    args_model: type[BaseModel]

    def json_schema(self) -> dict[str, Any]:
        """The arguments' JSON schema (pydantic's, without titles)."""
        return _strip_titles(self.args_model.model_json_schema())

    def strict_json_schema(self) -> dict[str, Any]:
        """The arguments' schema under OpenAI's strict-mode rules: every property
        required, optional values as a union with null, no extra properties."""
        return _strictify(self.json_schema())

    def engine_args(self, args: BaseModel | dict[str, Any]) -> dict[str, Any]:
        """Validated arguments as the engine takes them (None values dropped)."""
        if not isinstance(args, BaseModel):
            # Strict-mode callers send null for "not given".
            args = {k: v for k, v in args.items() if v is not None} if isinstance(args, dict) else args
        model = args if isinstance(args, BaseModel) else self.args_model.model_validate(args)
        return {k: v for k, v in model.model_dump().items() if v is not None}


TOOL_SPECS: dict[str, ToolSpec] = {
    "bash": ToolSpec("bash", BASH_DESCRIPTION, BashArgs),
    "read_file": ToolSpec("read_file", READ_FILE_DESCRIPTION, ReadFileArgs),
    "write_file": ToolSpec("write_file", WRITE_FILE_DESCRIPTION, WriteFileArgs),
}


#: ``list_files``: offered by the MCP server next to TOOL_SPECS (the other adapters keep
#: the three tools above, so their tool lists do not change).
LIST_FILES_SPEC = ToolSpec("list_files", LIST_FILES_DESCRIPTION, ListFilesArgs)


def read_file_note(metadata: dict[str, Any]) -> str | None:
    """The line a model reads after a partial ``read_file`` page, saying how to read on.

    Args:
        metadata: the call's ``ExecutionResult.metadata`` (``truncated``, ``next_offset``,
            ``next_byte_offset``, ``total_lines``, ``size``, ``end_byte``, ``encoding``).

    Returns:
        ``None`` when the page reached the end of the file, else for example
        ``[the file goes on: lines 0-1166 of 4000 shown (file 200000 bytes); call
        read_file with offset=1167 to read on]``.
    """
    if not metadata.get("truncated"):
        return None
    nxt, size = metadata.get("next_offset"), metadata.get("size")
    if metadata.get("encoding") == "base64":
        first = metadata.get("offset", 0)
        return (f"[the file goes on: bytes {first}-{metadata.get('end_byte', first)} of {size} "
                f"shown; call read_file with encoding=base64 and offset={nxt} to read on]")
    if nxt is None:  # past what text reads see: the rest in bytes
        return (f"[the file goes on past what text reads show (file {size} bytes); call read_file "
                f"with encoding=base64 and offset={metadata.get('end_byte')} to read on]")
    first = metadata.get("first_line", 0)
    last = first + max(1, metadata.get("lines", 1)) - 1
    skip = metadata.get("next_byte_offset")
    how = f"offset={nxt}, byte_offset={skip} (line {nxt} is longer than one read)" if skip \
        else f"offset={nxt}"
    return (f"[the file goes on: lines {first}-{last} of {metadata.get('total_lines')} shown "
            f"(file {size} bytes); call read_file with {how} to read on]")


def read_file_text(output: str, metadata: dict[str, Any]) -> str:
    """A successful ``read_file`` result as the model reads it: the page, then on a line of
    its own the note of :func:`read_file_note` when the file goes on (the adapters' one
    rendering, so every framework's model is told the same)."""
    note = read_file_note(metadata)
    if note is None:
        return output
    return f"{output}{'' if not output or output.endswith(chr(10)) else chr(10)}{note}"


def _strip_titles(schema: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(schema)
    out.pop("title", None)
    out.pop("description", None)
    for prop in out.get("properties", {}).values():
        prop.pop("title", None)
    return out


def _strictify(schema: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(schema)
    props = out.get("properties", {})
    required = set(out.get("required", []))
    for name, prop in props.items():
        prop.pop("default", None)
        if name not in required and not _allows_null(prop):
            if "anyOf" in prop:
                prop["anyOf"].append({"type": "null"})
            elif "type" in prop:
                prop["type"] = [prop["type"], "null"] if isinstance(prop["type"], str) else [*prop["type"], "null"]
                if "enum" in prop:
                    prop["enum"] = [*prop["enum"], None]
            else:
                prop["anyOf"] = [dict(prop), {"type": "null"}]
        for key in ("exclusiveMinimum", "exclusiveMaximum", "minimum", "maximum"):
            _drop_numeric_bounds(prop, key)
    out["required"] = list(props)
    out["additionalProperties"] = False
    return out


def _allows_null(prop: dict[str, Any]) -> bool:
    if prop.get("type") == "null" or (isinstance(prop.get("type"), list) and "null" in prop["type"]):
        return True
    return any(_allows_null(p) for p in prop.get("anyOf", []))


def _drop_numeric_bounds(prop: dict[str, Any], key: str) -> None:
    # Bounds stay enforced by the argument model; strict mode does not accept them everywhere.
    prop.pop(key, None)
    for sub in prop.get("anyOf", []):
        sub.pop(key, None)
