"""Built-in texts for conversion, present on every Python installation: calibration text and healing text.

Both are taken from the standard library's own docstrings, never from CPython's ``LICENSE.txt``, which is what
``gqa eval`` scores by default (``gqa.evaluate.default_eval_text``), so a conversion is neither calibrated nor healed on
its own test set. Why docstrings: they exist on every machine without a download, they are stable for a given Python
version, and they are technical English prose. Any text works better the closer it is to the use; pass
``calibration_text`` / ``heal_text`` (``--calibration-text FILE`` / ``--heal-text FILE``) to choose.
"""

from __future__ import annotations

import ast
import importlib
import re
import sysconfig
from pathlib import Path

MODULES = (
    "argparse", "collections", "email", "json", "logging", "asyncio", "unittest", "subprocess", "threading",
    "pathlib", "typing", "inspect", "dataclasses", "functools", "itertools", "datetime", "decimal", "fractions",
    "statistics", "random",
)  # fmt: skip

HEAL_TEXT_CHARS = 400_000  # ~100k SmolLM2 tokens: more than 30 minutes of healing on a 2-core CPU reads
CALIBRATION_HEAL_CHARS = 64_000  # of the heal text, after the module docstrings: ~20k more calibration tokens
MIN_DOCSTRING_CHARS = 200  # shorter docstrings are mostly one-line summaries; prose is what the model should see


def module_docstrings() -> str:
    """The module docstrings of ``MODULES`` (about 4.8k SmolLM2 tokens), joined by blank lines."""
    docs = [importlib.import_module(name).__doc__ or "" for name in MODULES]
    return "\n\n".join(d.strip() for d in docs if d.strip())


def default_calibration_text() -> str:
    """``module_docstrings()`` then the first ``CALIBRATION_HEAL_CHARS`` characters of ``default_heal_text()``
    (about 25k SmolLM2 tokens in all): the ``o_proj`` refit solves ``H_q * D`` unknowns per output, so it wants
    several times that many tokens (with 4.8k it fits the module docstrings and loses on other text)."""
    return module_docstrings() + "\n\n" + default_heal_text(CALIBRATION_HEAL_CHARS)


def _shingles(text: str, n: int = 8) -> set[tuple[str, ...]]:
    """Every run of ``n`` consecutive lower-cased words of ``text``."""
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def default_heal_text(max_chars: int = HEAL_TEXT_CHARS, exclude: str | None = None) -> str:
    """Docstrings of the standard library's top-level modules (``<stdlib>/*.py``, read with ``ast``, nothing
    imported), in file order, each at least ``MIN_DOCSTRING_CHARS`` long, joined by blank lines up to ``max_chars``.

    ``exclude`` (default: the default evaluation text, if this Python has it) is kept out: a docstring sharing any
    run of 8 consecutive words with it is skipped, so healing never sees the evaluation text.
    """
    if exclude is None:
        from ..evaluate import default_eval_text

        try:
            exclude = default_eval_text()[0]
        except FileNotFoundError:
            exclude = ""
    banned = _shingles(exclude)
    docs, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node)
            if doc is None or len(doc) < MIN_DOCSTRING_CHARS or not banned.isdisjoint(_shingles(doc)):
                continue
            docs.append(doc)
            total += len(doc) + 2
            if total >= max_chars:
                return "\n\n".join(docs)[:max_chars]
    return "\n\n".join(docs)
