"""A journal of finished rows of a long generation job, so that an interrupted run resumes where it stopped instead of
starting over.

Each call to ``add`` appends one JSON line ``{"phase": ..., "rows": {"17": outputs, ...}}`` (the rows finished
together: a step's, a batch's), flushed and fsynced: an interruption loses at most the rows in progress. Opening the
journal again reads the finished rows back (a last line cut short by the interruption is dropped and the file
truncated before it). The job deletes the journal once its result is safely written elsewhere.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["BatchJournal"]


class BatchJournal:
    """Finished rows by phase, kept in ``path`` (JSON lines)."""

    def __init__(self, path: str | Path, *, read_only: bool = False) -> None:
        """Read ``path``'s rows back; unless ``read_only``, cut off a last line left unfinished (the journal's writer
        does that when it opens it again; a reader beside a running writer must not)."""
        self.path = Path(path)
        self.done: dict[str, dict[int, Any]] = {}
        if not self.path.is_file():
            return
        good = 0  # bytes of the file made of whole, readable lines
        with self.path.open("rb") as fh:
            for line in fh:
                try:
                    entry = json.loads(line)
                    phase, rows = entry["phase"], {int(i): out for i, out in entry["rows"].items()}
                except (ValueError, KeyError, TypeError, AttributeError):
                    break  # a line cut short (or damaged): keep what came before it
                if not line.endswith(b"\n"):
                    break
                self.done.setdefault(phase, {}).update(rows)
                good += len(line)
        if good < self.path.stat().st_size and not read_only:
            with self.path.open("r+b") as fh:
                fh.truncate(good)

    def finished(self, phase: str) -> dict[int, Any]:
        """``{row: outputs}`` of ``phase``'s rows written so far."""
        return self.done.get(phase, {})

    def add(self, phase: str, rows: dict[int, Any]) -> None:
        """Append finished rows ``{row: outputs}`` as one line (durably: flushed and fsynced)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        entry = {"phase": phase, "rows": {str(i): out for i, out in rows.items()}}
        with self.path.open("ab") as fh:
            fh.write((json.dumps(entry, separators=(",", ":")) + "\n").encode())
            fh.flush()
            os.fsync(fh.fileno())
        self.done.setdefault(phase, {}).update(rows)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
