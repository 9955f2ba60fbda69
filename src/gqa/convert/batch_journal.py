"""A journal of finished generation batches, so that an interrupted run of a long batched job resumes where it
stopped instead of starting over.

Each finished batch is appended to a JSON-lines file as one line ``{"phase": ..., "batch": b, "outputs": [...]}``,
flushed and fsynced: an interruption loses at most the batch in progress. Opening the journal again reads the finished
batches back (a last line cut short by the interruption is dropped and the file truncated before it). The job
deletes the journal once its result is safely written elsewhere.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["BatchJournal"]


class BatchJournal:
    """Finished batches by phase, kept in ``path`` (JSON lines)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.done: dict[str, dict[int, Any]] = {}
        if not self.path.is_file():
            return
        good = 0  # bytes of the file made of whole, readable lines
        with self.path.open("rb") as fh:
            for line in fh:
                try:
                    entry = json.loads(line)
                    phase, batch, outputs = entry["phase"], int(entry["batch"]), entry["outputs"]
                except (ValueError, KeyError, TypeError):
                    break  # a line cut short (or damaged): keep what came before it
                if not line.endswith(b"\n"):
                    break
                self.done.setdefault(phase, {})[batch] = outputs
                good += len(line)
        if good < self.path.stat().st_size:
            with self.path.open("r+b") as fh:
                fh.truncate(good)

    def finished(self, phase: str) -> dict[int, Any]:
        """``{batch: outputs}`` of ``phase``'s batches written so far."""
        return self.done.get(phase, {})

    def add(self, phase: str, batch: int, outputs: Any) -> None:
        """Append one finished batch (durably: flushed and fsynced)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps({"phase": phase, "batch": batch, "outputs": outputs}, separators=(",", ":")) + "\n"
        with self.path.open("ab") as fh:
            fh.write(line.encode())
            fh.flush()
            os.fsync(fh.fileno())
        self.done.setdefault(phase, {})[batch] = outputs

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
