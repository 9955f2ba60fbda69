"""Built-in texts for conversion, present on every Python installation: calibration text, healing text, and a
held-out text of their kind for evaluation (``held_out_text``), which neither contains.

Both are taken from the standard library's own docstrings, never from CPython's ``LICENSE.txt``, which is what
``gqa eval`` scores by default (``gqa.evaluation.perplexity.default_eval_text``), so a conversion is neither
calibrated nor healed on
its own test set. Why docstrings: they exist on every machine without a download, they are stable for a given Python
version, and they are technical English prose. Any text works better the closer it is to the use; pass
``calibration_text`` / ``heal_text`` (``--calibration-text FILE`` / ``--heal-text FILE``) to choose.
"""

from __future__ import annotations

import ast
import functools
import importlib
import re
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path

MODULES = (
    "argparse", "collections", "email", "json", "logging", "asyncio", "unittest", "subprocess", "threading",
    "pathlib", "typing", "inspect", "dataclasses", "functools", "itertools", "datetime", "decimal", "fractions",
    "statistics", "random",
)  # fmt: skip

# all of it (~1.16M characters, ~300k SmolLM2 tokens): 30 minutes of healing read ~435k tokens here, so the text is
# read 1.4 times; the first 400,000 characters alone were read 4 times, and healing memorised them (docs/conversion.md)
HEAL_TEXT_CHARS: int | None = None
HELD_OUT = (400_000, 450_000)  # characters of the docstrings kept for evaluation (``held_out_text``), never healed on
CALIBRATION_HEAL_CHARS = 170_000  # of the heal text, after the module docstrings: ~46k more calibration tokens
MIN_DOCSTRING_CHARS = 200  # shorter docstrings are mostly one-line summaries; prose is what the model should see
# package folders whose docstrings are not prose about the standard library (tests, the IDE, demos, vendored code)
SKIPPED_FOLDERS = frozenset({"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo", "__phello__"})


def module_docstrings() -> str:
    """The module docstrings of ``MODULES`` (about 4.8k SmolLM2 tokens), joined by blank lines."""
    docs = [importlib.import_module(name).__doc__ or "" for name in MODULES]
    return "\n\n".join(d.strip() for d in docs if d.strip())


def default_calibration_text() -> str:
    """``module_docstrings()`` then the first ``CALIBRATION_HEAL_CHARS`` characters of ``default_heal_text()``
    (about 51k SmolLM2 tokens in all): the ``o_proj`` refit solves ``H_q * D`` unknowns per output, so it wants
    several times that many tokens (with 4.8k it fits the module docstrings and loses on other text)."""
    return module_docstrings() + "\n\n" + default_heal_text(CALIBRATION_HEAL_CHARS)


def _shingles(text: str, n: int = 8) -> set[tuple[str, ...]]:
    """Every run of ``n`` consecutive lower-cased words of ``text``."""
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def _stdlib_files() -> list[Path]:
    """The standard library's top-level modules (``<stdlib>/*.py``, sorted), then its packages' modules (sorted, but
    ``SKIPPED_FOLDERS``)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    packages = [p for p in root.glob("*/**/*.py") if SKIPPED_FOLDERS.isdisjoint(p.relative_to(root).parts[:-1])]
    return sorted(root.glob("*.py")) + sorted(packages)


def _docstrings(exclude: str | None) -> Iterator[str]:
    """The docstrings of ``_stdlib_files()`` (read with ``ast``, nothing imported) in file order, each at least
    ``MIN_DOCSTRING_CHARS`` long, but any sharing a run of 8 consecutive words with ``exclude`` (default: the default
    evaluation text, if this Python has it)."""
    if exclude is None:
        from ..evaluation.perplexity import default_eval_text

        try:
            exclude = default_eval_text()[0]
        except FileNotFoundError:
            exclude = ""
    banned = _shingles(exclude)
    for path in _stdlib_files():
        yield from (doc for doc in _file_docstrings(path) if banned.isdisjoint(_shingles(doc)))


@functools.cache
def _file_docstrings(path: Path) -> tuple[str, ...]:
    """The docstrings of ``path`` at least ``MIN_DOCSTRING_CHARS`` long, in ``ast.walk`` order (none where it does not
    parse); parsed once a process (the whole standard library takes ~7 s)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return ()
    nodes = (
        n for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
    )
    return tuple(doc for doc in map(ast.get_docstring, nodes) if doc is not None and len(doc) >= MIN_DOCSTRING_CHARS)


def _joined(docs: Iterable[str], max_chars: int) -> str:
    """``"\\n\\n".join(docs)[:max_chars]``, reading ``docs`` only as far as needed."""
    out, total = [], 0
    for doc in docs:
        out.append(doc)
        total += len(doc) + 2
        if total >= max_chars:
            break
    return "\n\n".join(out)[:max_chars]


def held_out_text(exclude: str | None = None) -> str:
    """Characters ``HELD_OUT`` of the joined docstrings (``_docstrings``): standard-library docstrings that neither
    ``default_heal_text()`` nor ``default_calibration_text()`` contains — an evaluation text of their kind."""
    start, end = HELD_OUT
    return _joined(_docstrings(exclude), end)[start:]


def default_heal_text(max_chars: int | None = HEAL_TEXT_CHARS, exclude: str | None = None) -> str:
    """Docstrings of the standard library's modules (top level, then packages; ``_docstrings``), joined by blank
    lines, without the ``held_out_text()`` span: its first ``HELD_OUT[0]`` characters, then the docstrings that
    start after the span and share no run of 8 consecutive words with it; up to ``max_chars`` (``None``: all).

    ``exclude`` (default: the default evaluation text, if this Python has it) is kept out: a docstring sharing any
    run of 8 consecutive words with it is skipped, so healing never sees the evaluation text.
    """
    start, end = HELD_OUT
    docs = _docstrings(exclude)
    if max_chars is not None and max_chars <= start:
        return _joined(docs, max_chars)
    joined = _joined(docs, end)  # reads ``docs`` up to the one that crosses the span's end
    held = _shingles(joined[start:])
    tail = [doc for doc in docs if held.isdisjoint(_shingles(doc))]  # the docs starting after the held-out span
    text = joined[:start] + "\n\n" + "\n\n".join(tail)
    return text if max_chars is None else text[:max_chars]
