"""Attention: one call and one module for MHA, GQA and MQA.

* ``functional`` — ``grouped_attention(query, key, value, ...)``, validated once and routed to a backend;
* ``backends`` — the implementations (``reference``, ``grouped``, ``sdpa``, ``fused``, ``split_kv``) and how
  ``auto`` picks among them on CPU (``backends``) and CUDA (``backends.cuda_routing``);
* ``checks`` — the argument checks and shapes every backend shares;
* ``masks``, ``rope`` — bottom-right causal and padding masks; rotary position embeddings;
* ``module`` — ``GroupedQueryAttention``, the Llama/Qwen2-style layer with projections, RoPE and a KV cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_names

if TYPE_CHECKING:
    from .functional import grouped_attention, last_backend
    from .masks import causal_mask, padding_mask
    from .module import GroupedQueryAttention
    from .rope import RoPE

__all__ = ["GroupedQueryAttention", "RoPE", "causal_mask", "grouped_attention", "last_backend", "padding_mask"]
# importing gqa.attention.checks (as gqa.cache does) runs none of the modules below
__getattr__ = lazy_names(__name__, {"GroupedQueryAttention": "module", "RoPE": "rope", "causal_mask": "masks",
                                    "padding_mask": "masks", "grouped_attention": "functional",
                                    "last_backend": "functional"})  # fmt: skip
