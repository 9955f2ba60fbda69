"""Which of a server's models stay loaded: least recently used first out, under a count and a memory budget (no
models here: names and byte counts alone, tested without a server).

    loaded = LoadedModels(max_loaded=2, max_bytes=4 * 2**30)
    for name in loaded.to_unload("qwen", 1_500_000_000):   # least recently used first
        ...unload it; loaded.remove(name)
    loaded.add("qwen", 1_500_000_000)                       # most recently used now
    loaded.touch("smol")                                    # a request for it: most recently used
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["LoadedModels"]


class LoadedModels:
    """The loaded models' bytes (weights + KV pool), least recently used first. ``max_loaded``: how many may be loaded
    at once; ``max_bytes``: how many bytes they may take together (``None``: no bound). A model that alone takes more
    than ``max_bytes`` is still served, alone."""

    def __init__(self, max_loaded: int | None = None, max_bytes: int | None = None) -> None:
        if max_loaded is not None and (
            isinstance(max_loaded, bool) or not isinstance(max_loaded, int) or max_loaded < 1
        ):
            raise ValueError(f"max_loaded must be a positive int or None, got {max_loaded!r}")
        if max_bytes is not None and not (
            isinstance(max_bytes, int) and not isinstance(max_bytes, bool) and max_bytes > 0
        ):
            raise ValueError(f"max_bytes must be a positive int or None, got {max_bytes!r}")
        self.max_loaded, self.max_bytes = max_loaded, max_bytes
        self._bytes: OrderedDict[str, int] = OrderedDict()  # least recently used first

    @property
    def names(self) -> list[str]:
        """The loaded models, least recently used first."""
        return list(self._bytes)

    @property
    def nbytes(self) -> int:
        return sum(self._bytes.values())

    def __contains__(self, name: object) -> bool:
        return name in self._bytes

    def nbytes_of(self, name: str) -> int:
        """The bytes ``name`` takes (0 when it is not loaded)."""
        return self._bytes.get(name, 0)

    def touch(self, name: str) -> None:
        """``name`` was used now (a request for it): the last to go."""
        self._bytes.move_to_end(name)

    def add(self, name: str, nbytes: int) -> None:
        """``name`` is loaded now and takes ``nbytes``; the most recently used."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        self._bytes[name] = nbytes
        self._bytes.move_to_end(name)

    def remove(self, name: str) -> None:
        self._bytes.pop(name, None)

    def to_unload(self, name: str, nbytes: int) -> list[str]:
        """The models to unload, least recently used first, so that ``name`` (taking ``nbytes``) fits beside the
        rest under both bounds; never ``name`` itself (already loaded, it counts with ``nbytes`` instead)."""
        others = [(n, b) for n, b in self._bytes.items() if n != name]
        count, total, out = len(others) + 1, sum(b for _, b in others) + nbytes, []
        for other, size in others:
            over_count = self.max_loaded is not None and count > self.max_loaded
            over_bytes = self.max_bytes is not None and total > self.max_bytes
            if not (over_count or over_bytes):
                break
            out.append(other)
            count, total = count - 1, total - size
        return out
