"""``batch``'s live view of each running trajectory: the last line its command wrote.

Fed by the engine's ``on_output`` events (``ToolBackend.execute_batch``). On a terminal
the lines of the :data:`SHOWN` most recently active trajectories are drawn under the
progress bar (rich refreshes them); otherwise (CI logs) a line ``[id] text`` is
printed at most every :data:`PLAIN_EVERY_S` seconds in all (a batch of 64 trajectories
printed 128 lines when the limit was per trajectory, test failures the rollouts expected
among them).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

from rich.console import Console, RenderableType
from rich.markup import escape
from rich.progress import Progress
from rich.text import Text

from ..slots import OutputEvent

#: Trajectories whose last line is shown under the progress bar.
SHOWN = 8
#: Seconds between two printed lines, whichever trajectories wrote them (not on a terminal).
PLAIN_EVERY_S = 5.0
#: Characters of a line kept.
LINE_CHARS = 200


class LiveLines:
    """The last output line of each running trajectory.

    Args:
        console: where plain lines go (not on a terminal).
        plain: print lines rather than draw them under a bar.
    """

    def __init__(self, console: Console, plain: bool) -> None:
        self.console = console
        self.plain = plain
        self.lines: OrderedDict[str, str] = OrderedDict()
        self.printed_at = -PLAIN_EVERY_S

    def watch(self, tid: str) -> Callable[[OutputEvent], None]:
        """An ``on_output`` callback that notes trajectory ``tid``'s output."""
        partial = [""]

        def on_output(event: OutputEvent) -> None:
            data = event.data if isinstance(event.data, str) else event.data.decode("utf-8", "replace")
            text = partial[0] + data
            complete, _, partial[0] = text.rpartition("\n")
            partial[0] = partial[0][-LINE_CHARS:]
            last = complete.rsplit("\n", 1)[-1].strip() if complete else ""
            if last:
                self.note(tid, last)

        return on_output

    def note(self, tid: str, line: str) -> None:
        line = line[:LINE_CHARS]
        self.lines[tid] = line
        self.lines.move_to_end(tid)
        if self.plain:
            now = time.monotonic()
            if now - self.printed_at >= PLAIN_EVERY_S:
                self.printed_at = now
                self.console.print(escape(f"[{tid}] {line}"), highlight=False, soft_wrap=True)

    def done(self, tid: str) -> None:
        """Trajectory ``tid`` ended: its line goes."""
        self.lines.pop(tid, None)

    def renderables(self) -> Iterable[RenderableType]:
        for tid, line in list(self.lines.items())[-SHOWN:]:
            yield Text(f"  {tid}: {line}", overflow="ellipsis", no_wrap=True, style="dim")


class LiveProgress(Progress):
    """A rich progress bar with the :class:`LiveLines` drawn under it."""

    def __init__(self, *columns: Any, live: LiveLines, **kwargs: Any) -> None:
        self.live_lines = live  # before Progress draws itself for the first time
        super().__init__(*columns, **kwargs)

    def get_renderables(self) -> Iterable[RenderableType]:
        yield self.make_tasks_table(self.tasks)
        yield from self.live_lines.renderables()
