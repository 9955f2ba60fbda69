"""Names a package exports without importing their modules until first use (PEP 562): ``import gqa`` and the
torch-free parts of a package stay torch-free, and ``from gqa.cache import StaticKVCache`` works as if it were
imported there."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_names(package: str, homes: dict[str, str]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package``: name -> its value, imported from submodule ``homes[name]`` (relative
    to ``package``) on first use and kept in the package, so later lookups skip this function."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{home}", package), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
