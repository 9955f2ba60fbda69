"""gqa: grouped-query attention for PyTorch — MHA, GQA and MQA as one mechanism, with K/V shared, never copied.

The packages are the layers, each using only the ones above it in this list:

* ``kernels`` — native CPU kernels (``csrc``, typed in ``kernels.ops``) and Triton GPU kernels (``kernels.triton``);
* ``attention`` — the attention call, its backends and routing, masks, RoPE, the ``GroupedQueryAttention`` module;
* ``cache`` — KV caches for decoding and the one KV-size formula;
* ``models`` — Llama/Qwen2 decoders, their linear and block-quantized layers;
* ``decoding`` — the decode steps (native, compiled, CUDA graphs) and the generate loop with sampling;
* ``loaders`` — GGUF files, HF folders and tokenizers into models; ``integrations`` — HF transformers;
* ``parallel`` — tensor parallelism over torch.distributed; ``evaluation`` — perplexity, answers, the suite;
* ``convert`` — changing a checkpoint's number of KV heads; ``serve`` — continuous batching and the OpenAI API;
* ``bench``, ``cli`` — the benchmarks and the ``gqa`` command.

The public names are imported on first use (PEP 562), so ``import gqa`` does not import torch (~2 s): ``gqa info``
and ``gqa --help`` run without it. ``from gqa import X`` and ``gqa.X`` work as if they were imported here, and so do
submodules reached as attributes (``gqa.kernels``).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import TYPE_CHECKING, Any

from ._lazy import lazy_names

# OpenMP threads that wait passively (sleep) between torch's parallel regions, not spinning first (libgomp's default):
# on a machine whose cores other work shares, a spinning thread holds a core while its descheduled peer waits for one,
# and every small op of a prompt costs a scheduler slice. Read when torch loads libgomp, so only where gqa is imported
# first (the gqa command, its benchmarks' processes); the user's own setting wins. A 3B Q4_K_M on 2 shared cores
# (load ~4): a 16-token prompt's first token 0.7 s instead of 4-6 s, prefill at 128 tokens +40%, decode +13%
# (docs/bench/models-3b-8b.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

if TYPE_CHECKING:
    from .attention.backends import BACKENDS
    from .attention.functional import grouped_attention, last_backend
    from .attention.masks import causal_mask, padding_mask
    from .attention.module import GroupedQueryAttention
    from .attention.rope import RoPE
    from .cache.kv import DynamicKVCache, StaticKVCache, kv_cache_bytes
    from .cache.window import WindowKVCache
    from .loaders import load_tokenizer
    from .loaders.model import load_model

__all__ = [
    "BACKENDS",
    "DynamicKVCache",
    "GroupedQueryAttention",
    "RoPE",
    "StaticKVCache",
    "WindowKVCache",
    "causal_mask",
    "grouped_attention",
    "kv_cache_bytes",
    "last_backend",
    "load_model",
    "load_tokenizer",
    "padding_mask",
]
__version__ = "0.1.0"

_HOMES = {  # public name -> the submodule that defines it
    "load_model": "loaders.model",
    "load_tokenizer": "loaders",
    "GroupedQueryAttention": "attention.module",
    "BACKENDS": "attention.backends",
    "DynamicKVCache": "cache.kv",
    "StaticKVCache": "cache.kv",
    "WindowKVCache": "cache.window",
    "kv_cache_bytes": "cache.kv",
    "grouped_attention": "attention.functional",
    "last_backend": "attention.functional",
    "causal_mask": "attention.masks",
    "padding_mask": "attention.masks",
    "RoPE": "attention.rope",
}


_public = lazy_names(__name__, _HOMES)


def __getattr__(name: str) -> Any:
    """A public name, imported from its submodule on first use and kept here; or a submodule, imported."""
    if name in _HOMES:
        return _public(name)
    if not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f".{name}", __name__)  # the import sets it as an attribute too
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
