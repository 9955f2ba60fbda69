"""Atomic file writes: a temporary file beside the target, renamed onto it (``os.replace``) only when complete, so
an interrupted write never leaves a half-written file and never loses the old one."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it is renamed onto ``path`` (``os.replace``), on failure
    it is removed. The temporary name keeps ``path``'s suffix, so writers that go by the extension (matplotlib) work.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=f".tmp{path.suffix}")
    os.close(fd)
    os.chmod(tmp, _mode(path))  # mkstemp makes 0600; give the file the mode a plain open() would (or the old one)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _mode(path: Path) -> int:
    try:
        return path.stat().st_mode & 0o777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file in the same directory and ``os.replace``."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json_atomic(path: Path, payload: dict) -> None:
    """Write ``payload`` to ``path`` via a temporary file in the same directory and ``os.replace``."""
    write_text_atomic(path, json.dumps(payload, indent=2) + "\n")
