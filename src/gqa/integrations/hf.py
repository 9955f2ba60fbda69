"""HF transformers integration: run any ``AttentionInterface`` model (Llama, Qwen2, Mistral, ...) on ``gqa``.

>>> import gqa.integrations.hf
>>> name = gqa.integrations.hf.register()  # "gqa"
>>> model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name)  # doctest: +SKIP

``register`` adds two entries to transformers' global registries under the same name:

* ``AttentionInterface`` → :func:`gqa_attention_forward`, which calls :func:`gqa.grouped_attention` with the K/V
  heads as the model (and its cache) hold them: ``H_kv`` heads, never repeated to ``H_q``;
* ``AttentionMaskInterface`` → transformers' own ``sdpa_mask``: bool masks ``(B, 1, L, S)``, True = attend, or
  ``None`` where a plain causal (or no) mask is enough. This entry is required: transformers builds *no mask at all*
  for an attention implementation without a registered mask function (it assumes the backend masks on its own,
  as for TGI/vLLM), which would silently ignore padding and, with a cache, causality.

Importing this module has no side effects and does not import transformers; only :func:`register` does.
"""

from __future__ import annotations

from typing import Any

import torch

from ..attention.functional import grouped_attention

__all__ = ["gqa_attention_forward", "register"]

# Substrings transformers tests implementation names for while dispatching (besides the exact name "eager",
# the "paged|" prefix and "owner/repo" hub kernels).
_RESERVED_SUBSTRINGS = ("sdpa", "flex_attention", "flash")


def gqa_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention function for transformers' ``AttentionInterface``, backed by :func:`gqa.grouped_attention`.

    Parameters
    ----------
    module : torch.nn.Module
        The calling attention layer. Read: ``training`` (dropout only in training mode) and ``is_causal``.
    query : Tensor ``(B, H_q, L, D)``
    key : Tensor ``(B, H_kv, S, D)``
    value : Tensor ``(B, H_kv, S, D_v)``
        As the model hands them over (after RoPE and the cache update), with ``H_kv`` heads: K/V are never repeated.
    attention_mask : Tensor, optional
        Broadcastable to ``(B, H_q, L, S')`` with ``S' >= S``; sliced to the key length. Bool (True = attend, as
        built by the registered ``sdpa_mask``) or float (added to the scores, e.g. a user-supplied 4D mask).
    scaling : float, optional
        Score scale; default ``D ** -0.5``.
    dropout : float
        Dropout on the attention weights; applied only when ``module.training``.
    **kwargs
        ``is_causal`` (overrides ``module.is_causal``), ``output_attentions`` (return the weights, as eager does),
        ``position_bias`` (an additive score bias, as in transformers' sdpa), ``softcap`` (Gemma 2's logit
        soft-capping) and ``s_aux`` (gpt-oss's sink logits, ``(H_q,)``) go to ``grouped_attention``. Paged caches are
        not supported; other keyword arguments (``sliding_window``, ``position_ids``, ...) are encoded in the mask by
        transformers and ignored here.

    Returns
    -------
    attn_output : Tensor ``(B, L, H_q, D_v)``
        Contiguous, the layout the model reshapes to ``(B, L, H_q * D_v)``.
    attn_weights : Tensor ``(B, H_q, L, S)`` or None
        The attention weights when ``output_attentions=True`` is passed, else None.

    Notes
    -----
    Causality: without a mask, transformers relies on the backend's ``is_causal`` exactly as torch SDPA defines it
    (top-left aligned). ``gqa``'s ``is_causal`` is bottom-right aligned, which agrees whenever ``S == L``. The only
    maskless prefill with ``S > L`` transformers produces is an empty static cache (``S`` = its capacity, the query
    at offset 0), where the keys past ``L`` are unwritten slots: they are dropped, as transformers' sdpa does, so the
    two alignments agree again. A single query (``L == 1``) without a mask sees every key.
    """
    if kwargs.get("cache") is not None:
        raise NotImplementedError("attn_implementation 'gqa' does not support paged caches (continuous batching)")
    output_attentions = bool(kwargs.get("output_attentions", False))
    position_bias = kwargs.get("position_bias")

    L, S = query.shape[-2], key.shape[-2]
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor):
            raise TypeError(
                f"attn_implementation 'gqa' needs a tensor attention mask, got {type(attention_mask).__name__}"
            )
        attention_mask = attention_mask[..., :S]

    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    is_causal = L > 1 and attention_mask is None and bool(is_causal)
    if is_causal and L < S:
        # Maskless prefill into an empty static cache: keys L.. are unwritten slots (see Notes).
        key, value = key[..., :L, :], value[..., :L, :]
        if position_bias is not None:
            position_bias = position_bias[..., :L]
        S = L

    if position_bias is not None:
        bias = position_bias[..., :S]
        if attention_mask is None:
            attention_mask = bias
        elif attention_mask.dtype == torch.bool:
            attention_mask = bias.masked_fill(~attention_mask, float("-inf"))
        else:
            attention_mask = attention_mask + bias

    result = grouped_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=float(dropout) if module.training else 0.0,
        is_causal=is_causal,
        scale=None if scaling is None else float(scaling),
        softcap=kwargs.get("softcap"),
        sinks=kwargs.get("s_aux"),
        return_weights=output_attentions,
    )
    out, weights = result if output_attentions else (result, None)
    return out.transpose(1, 2).contiguous(), weights


def _is_ours(fn: object) -> bool:
    return getattr(fn, "_gqa_hf", False) is True


def register(name: str = "gqa") -> str:
    """Register ``gqa`` as a transformers attention implementation, usable as ``attn_implementation=name``.

    Registers :func:`gqa_attention_forward` with ``AttentionInterface`` and transformers' ``sdpa_mask`` (bool masks,
    True = attend, or None where ``is_causal`` suffices) with ``AttentionMaskInterface``, both globally, under
    ``name``. Calling it again with the same name does nothing.

    Parameters
    ----------
    name : str
        The implementation name. Must not be a name transformers reserves (``eager``, ``sdpa``, ``flash_attention_*``,
        ``flex_attention``, ``paged|...``), contain ``/`` (a hub kernel) or be taken by another function.

    Returns
    -------
    str
        ``name``, to pass as ``attn_implementation`` to ``from_pretrained``, ``from_config`` or
        ``model.set_attn_implementation``.

    Raises
    ------
    ImportError
        If transformers is not installed.
    ValueError
        If ``name`` is reserved, or already registered to a function that is not ours.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    if name == "eager" or "/" in name or "|" in name or any(sub in name for sub in _RESERVED_SUBSTRINGS):
        raise ValueError(f"name {name!r} is reserved by transformers (or names a hub kernel); pick another, e.g. 'gqa'")
    try:
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
        from transformers.modeling_utils import AttentionInterface
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("gqa.integrations.hf.register() needs transformers (pip install transformers)") from e

    attn_fns = AttentionInterface._global_mapping
    mask_fns = AttentionMaskInterface._global_mapping
    if name in attn_fns and not _is_ours(attn_fns[name]):
        raise ValueError(f"attention implementation {name!r} is already registered to {attn_fns[name]!r}")
    if name in mask_fns and mask_fns[name] is not sdpa_mask:
        raise ValueError(f"attention mask function {name!r} is already registered to {mask_fns[name]!r}")
    AttentionInterface.register(name, gqa_attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


gqa_attention_forward._gqa_hf = True  # type: ignore[attr-defined]
