"""The tensors a Llama-family checkpoint must hold, by HF name and torch shape, and the check both loaders run.

Sizes: ``V`` vocab, ``H`` hidden, ``F`` intermediate (feed-forward), ``H_q``/``H_kv`` query/key-value heads,
``D`` head dim.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..models.config import ModelConfig

_SHOWN = 8  # names listed in an error before "... and N more"


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> torch shape for every tensor a checkpoint of ``cfg`` must hold.

    ``lm_head.weight`` ``(V, H)`` is expected only when ``cfg.tie_word_embeddings`` is false; q/k/v biases only
    when ``cfg.attention_bias`` is true, the o_proj bias ``(H,)`` when ``cfg.output_bias`` is, the q/k norms ``(D,)``
    when ``cfg.qk_norm`` is, Gemma's norms around the MLP ``(H,)`` when ``cfg.gemma`` is.
    """
    V, H, F = cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim  # H_q * D, H_kv * D
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (H,)
        shapes[p + "self_attn.q_proj.weight"] = (q, H)
        shapes[p + "self_attn.k_proj.weight"] = (kv, H)
        shapes[p + "self_attn.v_proj.weight"] = (kv, H)
        if cfg.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q,)
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (cfg.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (cfg.head_dim,)
        shapes[p + "self_attn.o_proj.weight"] = (H, q)
        if cfg.output_bias:
            shapes[p + "self_attn.o_proj.bias"] = (H,)
        shapes[p + "post_attention_layernorm.weight"] = (H,)
        if cfg.gemma:
            shapes[p + "pre_feedforward_layernorm.weight"] = (H,)
            shapes[p + "post_feedforward_layernorm.weight"] = (H,)
        shapes[p + "mlp.gate_proj.weight"] = (F, H)
        shapes[p + "mlp.up_proj.weight"] = (F, H)
        shapes[p + "mlp.down_proj.weight"] = (H, F)
    shapes["model.norm.weight"] = (H,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    return shapes


def _names(names: list[str]) -> str:
    more = f" ... and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def check_tensors(cfg: ModelConfig, shapes: Mapping[str, tuple[int, ...]], source: str) -> None:
    """Raise ``ValueError`` unless ``shapes`` (HF name -> torch shape) holds exactly the tensors ``cfg`` needs.

    Parameters
    ----------
    cfg : ModelConfig
        The model the tensors are for.
    shapes : mapping
        The checkpoint's tensor names (HF names) and shapes, read before any tensor data is.
    source : str
        The file or folder the tensors come from, named in the error.
    """
    expected = expected_shapes(cfg)
    missing = [name for name in expected if name not in shapes]
    if missing:
        raise ValueError(f"{source}: {len(missing)} tensor(s) missing: {_names(missing)}")
    unexpected = sorted(name for name in shapes if name not in expected)
    if unexpected:
        raise ValueError(
            f"{source}: {len(unexpected)} unexpected tensor(s) for a {cfg.arch} model "
            f"(tie_word_embeddings={cfg.tie_word_embeddings}, attention_bias={cfg.attention_bias}, "
            f"output_bias={cfg.output_bias}): "
            f"{_names(unexpected)}"
        )
    for name, want in expected.items():
        got = tuple(shapes[name])
        if got != want:
            raise ValueError(f"{source}: tensor {name} has shape {got}, expected {want} from the config")
