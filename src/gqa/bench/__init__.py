"""Benchmarks behind ``gqa bench``: attention kernels (``attention``) and whole models (``model``)."""

from __future__ import annotations

import os
import sys
from datetime import datetime, timezone
from pathlib import Path

from .._atomic import atomic_path, write_json_atomic, write_text_atomic

__all__ = ["atomic_path", "print_and_save", "write_json_atomic", "write_results", "write_text_atomic"]


def write_results(out: Path, benchmark: str, fields: dict, table: str) -> None:
    """``results.json`` (the command line, the date, the CPU count and ``fields``) and ``results.md`` (the command and
    ``table``) in ``out``, each written atomically; the markdown is printed too. ``benchmark``: the name after
    ``gqa bench``."""
    flags = sys.argv[sys.argv.index(benchmark) + 1 :] if benchmark in sys.argv else []
    result = {
        "command": " ".join([f"gqa bench {benchmark}", *flags]).strip(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        **fields,
    }
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "results.json", result)
    text = f"`{result['command']}` ({result['date']}, {os.cpu_count()} CPUs)\n\n{table}\n"
    write_text_atomic(out / "results.md", text)
    print(text)


def print_and_save(text: str, payload: dict, json_path: Path | None, markdown_path: Path | None) -> None:
    """Print the markdown ``text``; write ``payload`` to ``json_path`` and ``text`` to ``markdown_path`` (each
    atomically, when given): what ``--json`` and ``--markdown`` of a ``gqa bench attention`` mode do."""
    print(text, end="")
    if json_path:
        write_json_atomic(json_path, payload)
    if markdown_path:
        write_text_atomic(markdown_path, text)
