"""``torch.compile``'d decoding: ``model.generate(..., compile=True)`` and ``gqa generate --compile``.

The decode step is compiled once per model, batch size and cache bucket (cache capacities are rounded up to a multiple
of ``BUCKET`` tokens, so a longer prompt rarely means a new compilation), never per token: static KV caches keep
every shape fixed while decoding. Inductor's compiled code is kept on disk (``$TORCHINDUCTOR_CACHE_DIR``, by default
``~/.cache/gqa/torchinductor``), so a second process reuses it and only re-traces the model.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from pathlib import Path

import torch

from .. import kernels

BUCKET = 256  # cache capacity granularity, in tokens
_steps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def cache_dir() -> Path:
    """Where inductor keeps compiled code: ``$TORCHINDUCTOR_CACHE_DIR``, else ``~/.cache/gqa/torchinductor`` (set as
    that variable the first time a step is compiled)."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gqa" / "torchinductor"
    return Path(os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(default)))


def cache_bucket(length: int, limit: int) -> int:
    """``length`` rounded up to a multiple of ``BUCKET``, at most ``limit`` (the model's context)."""
    return min(-(-length // BUCKET) * BUCKET, max(limit, length))


def compiled_step(model: torch.nn.Module) -> Callable[[torch.Tensor, list], torch.Tensor]:
    """``step(tokens (B, 1), caches) -> logits (B, 1, vocab)``: ``model``'s decode step under ``torch.compile``,
    one per model (kept while the model lives)."""
    step = _steps.get(model)
    if step is None:
        cache_dir()
        kernels.load()  # settled before tracing: the traced code reads it as a constant
        ref = weakref.ref(model)
        step = torch.compile(lambda tokens, caches: ref()(tokens, caches=caches), dynamic=False)
        _steps[model] = step
    return step
