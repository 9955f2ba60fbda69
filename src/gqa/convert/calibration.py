"""The default calibration text for calibrated merges: English prose that every Python installation carries.

It is the docstrings of twenty standard-library modules (about 10k tokens of technical English). Why: it exists on
every machine without a download, it is stable for a given Python version, and it is a different text from the one
``gqa eval`` scores by default, so a conversion is not tuned on its own test set. Any text works better the closer it
is to the use; pass ``calibration_text`` (``--calibration-text FILE``) to choose.
"""

from __future__ import annotations

import importlib

MODULES = (
    "argparse", "collections", "email", "json", "logging", "asyncio", "unittest", "subprocess", "threading",
    "pathlib", "typing", "inspect", "dataclasses", "functools", "itertools", "datetime", "decimal", "fractions",
    "statistics", "random",
)  # fmt: skip


def default_calibration_text() -> str:
    """The docstrings of ``MODULES``, joined by blank lines."""
    docs = [importlib.import_module(name).__doc__ or "" for name in MODULES]
    return "\n\n".join(d.strip() for d in docs if d.strip())
