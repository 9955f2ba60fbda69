"""``torch.compile`` marks that leave dynamo unimported when ``gqa`` is imported (``torch.compiler.disable`` and
``torch.compiler.assume_constant_result`` import it, ~1.5-3 s, at decoration time).

- ``disable``: ``torch._disable_dynamo``, torch's own lazy form (dynamo skips its wrapper's module, so a call from
  compiled code runs eagerly, behind a graph break, as ``torch.compiler.disable`` would).
- ``assume_constant_result``: sets the mark ``torch._dynamo.assume_constant_result`` sets
  (``tests/cli/test_startup.py`` checks it is still the same mark).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)

disable = torch._disable_dynamo


def assume_constant_result(fn: F) -> F:
    """Mark ``fn`` as returning a constant of the graph when ``torch.compile`` traces a call to it."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn
