"""The live progress bar (on stderr, so stdout keeps only the report)."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from detgate.audit.client import ClientStats
from detgate.audit.runner import Collected


class AuditProgress:
    """A context manager; call it with the run's state after every answer."""

    def __init__(self, total: int, stats: ClientStats, console: Console) -> None:
        self._stats = stats
        self._progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[extra]}"), TimeElapsedColumn(), console=console,
        )
        self._task = self._progress.add_task("requests", total=total, extra="")

    def __enter__(self) -> AuditProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.stop()

    def __call__(self, collected: Collected) -> None:
        extra = (f"failed {collected.failed}  mixed-in {collected.mix_done}  "
                 f"retries {self._stats.retries}")
        self._progress.update(self._task, completed=len(collected.samples) + collected.failed,
                              extra=extra)

    def phase(self, description: str, total: int) -> None:
        self._progress.update(self._task, description=description, total=total, completed=0)

    def advance(self) -> None:
        self._progress.advance(self._task)
