"""Where gqa keeps what it can make again but would rather not: ``cache_root()``."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$GQA_CACHE_DIR``, else ``$XDG_CACHE_HOME/gqa``, else ``~/.cache/gqa`` (each user of it takes a folder)."""
    root = os.environ.get("GQA_CACHE_DIR")
    if root is None:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gqa"
    return Path(root).expanduser()
