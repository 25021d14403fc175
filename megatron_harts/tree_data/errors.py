"""The one error type of bad rollout data, and the CLI convention around it."""
from __future__ import annotations

from typing import Optional


class TreeFormatError(ValueError):
    """Bad input data: names where (file, line), which trajectory and which field.

    ``str(err)`` is a single line, the one the command-line tools print before
    exiting with status 2.
    """

    def __init__(
        self,
        message: str,
        *,
        file: Optional[str] = None,
        line: Optional[int] = None,
        trajectory=None,
        field: Optional[str] = None,
    ):
        self.message = message
        self.file = file
        self.line = line
        self.trajectory = trajectory
        self.field = field
        super().__init__(self._render())

    def _render(self) -> str:
        where = []
        if self.file is not None:
            where.append(f"{self.file}:{self.line}" if self.line is not None else str(self.file))
        elif self.line is not None:
            where.append(f"line {self.line}")
        if self.trajectory is not None:
            where.append(f"trajectory {self.trajectory!r}")
        if self.field is not None:
            where.append(f"field '{self.field}'")
        prefix = ": ".join(where)
        return f"{prefix}: {self.message}" if prefix else self.message
