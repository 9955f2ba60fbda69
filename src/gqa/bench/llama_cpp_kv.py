"""llama.cpp's KV cache types for gqa's ``--kv-cache-dtype`` names, so that the peer runs with the cache gqa runs with:
llama-cpp-python's ``Llama(type_k=, type_v=, flash_attn=True)`` and its server's ``--type_k`` / ``--type_v`` /
``--flash_attn`` take ggml type ids, llama.cpp's ``llama-server`` ``-ctk`` / ``-ctv`` / ``-fa`` take names. A quantized
V cache needs llama.cpp's flash-attention path, so a chosen type turns it on. ``auto`` leaves llama.cpp's default, an
f16 cache. Neither torch nor numpy is imported here (``gqa bench serve --help`` loads this module).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from ..cache.kv_dtypes import KV_DTYPES, KVDtype

__all__ = ["cache_kind", "ggml_type", "llama_kwargs", "llama_server_flags", "server_flags"]

_GGML_NAMES = {"fp32": "F32", "fp16": "F16", "bf16": "BF16", "q8_0": "Q8_0", "q4_0": "Q4_0"}


def ggml_type(kv: str) -> int:
    """The ggml type id of the KV dtype ``kv`` (``"q8_0"`` -> 8); ``ValueError`` naming the choices otherwise."""
    from ..loaders.gguf_reader import GGML_TYPES  # numpy: only when a server is started

    if kv not in _GGML_NAMES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(_GGML_NAMES)} for llama.cpp, got {kv!r}")
    return next(t.id for t in GGML_TYPES.values() if t.name == _GGML_NAMES[kv])


def cache_kind(kv: str) -> KVDtype:
    """What llama.cpp's cache stores for ``kv``: that type, or for ``auto`` its default, f16."""
    return KV_DTYPES["fp16" if kv == "auto" else kv]


def llama_kwargs(kv: str) -> dict[str, object]:
    """``llama_cpp.Llama``'s keyword arguments for a ``kv`` cache (none for ``auto``)."""
    if kv == "auto":
        return {}
    return {"type_k": ggml_type(kv), "type_v": ggml_type(kv), "flash_attn": True}


def server_flags(kv: str) -> list[str]:
    """``python -m llama_cpp.server``'s flags for a ``kv`` cache (none for ``auto``)."""
    return [x for k, v in llama_kwargs(kv).items() for x in (f"--{k}", str(v))]


def llama_server_flags(kv: str, binary: Path) -> list[str]:
    """``llama-server``'s flags for a ``kv`` cache (none for ``auto``). Its ``-fa`` was a switch and takes
    ``on|off|auto`` since late 2025: ``binary --help`` says which."""
    if kv == "auto":
        return []
    name = _GGML_NAMES[kv].lower()
    usage = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=60).stdout
    flash = ["-fa", "on"] if "on|off|auto" in usage else ["-fa"]
    return ["-ctk", name, "-ctv", name, *flash]
