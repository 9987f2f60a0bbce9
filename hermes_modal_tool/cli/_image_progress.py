"""Image pull and unpack progress on the command line's stderr.

The image cache reports a line per step on the ``hermes_modal_tool.images`` logger; a
layer's record also carries ``image`` and ``image_step`` (layers applied, of all). On a
terminal this handler draws a rich progress bar per image from those; elsewhere (CI
logs, pipes), and for the steps without a count, it prints the lines.
"""

from __future__ import annotations

import logging
from typing import Any

from rich.console import Console
from rich.errors import LiveError
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)


class ImageProgress(logging.Handler):
    """A ``logging.Handler`` for ``hermes_modal_tool.images``: a bar per image on a
    terminal, the log lines otherwise (or when another live display, such as the batch
    progress bar, is already on the screen)."""

    def __init__(self, console: Console | None = None) -> None:
        super().__init__(logging.INFO)
        self.console = console or Console(stderr=True)
        self.progress: Progress | None = None
        self.tasks: dict[str, TaskID] = {}

    def emit(self, record: logging.LogRecord) -> None:
        try:
            image: Any = getattr(record, "image", None)
            step: Any = getattr(record, "image_step", None)
            if not (self.console.is_terminal and image and step and self._bar(str(image), step)):
                self.console.print("hermes-modal-tool: " + record.getMessage(), markup=False,
                                   highlight=False)
        except Exception:  # noqa: BLE001 - logging must never raise into the caller
            self.handleError(record)

    def _bar(self, image: str, step: tuple[int, int]) -> bool:
        """Advance ``image``'s bar to ``step``; False when no bar can be drawn."""
        done, total = int(step[0]), max(1, int(step[1]))
        if self.progress is None:
            progress = Progress(TextColumn("unpacking {task.description}"), BarColumn(),
                                MofNCompleteColumn(), TextColumn("layers"), TimeElapsedColumn(),
                                console=self.console)
            try:
                progress.start()
            except LiveError:  # another live display (the batch's bar) is showing
                return False
            self.progress = progress
        task = self.tasks.get(image)
        if task is None:
            task = self.tasks[image] = self.progress.add_task(image, total=total)
        self.progress.update(task, completed=done, total=total)
        if all(t.finished for t in self.progress.tasks):
            self.progress.stop()
            self.progress, self.tasks = None, {}
        return True
