"""A Llama-family decoder (Llama, SmolLM, Qwen2) on ``gqa.GroupedQueryAttention`` and ``gqa`` KV caches.

Parameter names are HF transformers' (``model.layers.{i}.self_attn.q_proj.weight`` ...), so an HF state dict loads
as it is. One layer: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``; RMSNorm, SwiGLU MLP, RoPE on q and k.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ..attention.masks import padding_mask
from ..attention.rope import RoPE
from ..cache.kv import StaticKVCache
from ..cache.sizes import layer_cache_tokens
from ..cache.window import WindowKVCache
from .config import ModelConfig
from .gemma import GemmaBackbone, GemmaDecoderLayer
from .layers import MLP, layer_attention, model_rope
from .linear import Linear


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, computed in float32 and cast back (as HF does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RoPE, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = layer_attention(cfg, layer, rope)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None,
        rope_cos_sin: tuple[torch.Tensor, torch.Tensor],
        cache: StaticKVCache | None,
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        x = x + self.self_attn(h, attn_mask=attn_mask, is_causal=True, rope_cos_sin=rope_cos_sin, cache=cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """Embeddings, layers and the final norm (HF's ``model.`` prefix)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rope = rope = model_rope(cfg)
        self.layers = nn.ModuleList(DecoderLayer(cfg, rope, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids (B, L)`` -> the first layer's input ``(B, L, E)``."""
        return self.embed_tokens(input_ids)

    def rotations(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What every layer's RoPE takes for ``position_ids``: one ``(cos, sin)`` lookup per forward, shared."""
        return self.rope.cos_sin(position_ids)


@contextmanager
def _no_random_init() -> Iterator[None]:
    """Modules built inside skip ``nn.init``'s random fills (``nn.Linear``/``nn.Embedding`` parameters stay
    uninitialised): for weights about to be loaded, where filling 135M parameters at random costs a second."""
    names = ("kaiming_uniform_", "uniform_", "normal_")
    saved = {name: getattr(nn.init, name) for name in names}
    try:
        for name in names:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


class CausalLM(nn.Module):
    """A decoder-only language model: ``input_ids (B, L)`` -> ``logits (B, L, vocab)``.

    Caches come from ``new_caches``; with them ``forward`` appends the new tokens and attends to everything cached,
    and left padding declared with ``set_left_padding(caches, pad)`` is masked with per-row positions. ``generate``
    lives in ``gqa.decoding.generate``; ``tokenizer`` is attached by ``gqa.load_model``.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = GemmaBackbone(cfg) if cfg.gemma else Backbone(cfg)  # a family with layers of its own: its own
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.tokenizer = None
        self.kv_dtype: object = "auto"  # what new_caches stores K/V as by default (load_model(kv_dtype=...))
        self.register_state_dict_post_hook(_savable_state)
        self.register_load_state_dict_pre_hook(_tied_head_from_embeddings)

    # state_dict() is what safetensors.torch.save_file(model.state_dict(), path) can write as it is: no tensor twice
    # (a tied lm_head.weight is left out, as HF checkpoints leave it out) and every tensor contiguous (weights stored
    # input-major by use_input_major_weights come out as contiguous copies). load_state_dict takes it back.

    @classmethod
    def from_state(cls, cfg: ModelConfig, state: dict[str, torch.Tensor], *, assign: bool = False) -> CausalLM:
        """A model in eval mode holding ``state`` (HF names, as the loaders return it; ``lm_head.weight`` may be
        absent when the embeddings are tied). ``assign=True`` keeps the given tensors instead of copying them. The
        model is built without random initialisation: every parameter is overwritten by ``state``."""
        with _no_random_init():
            model = cls(cfg)
        state = dict(state)
        if cfg.tie_word_embeddings:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        model.load_state_dict(state, strict=True, assign=assign)
        if cfg.tie_word_embeddings:  # assign=True installs two Parameters: make them one again
            model.lm_head.weight = model.model.embed_tokens.weight
        return model.eval()

    @property
    def dtype(self) -> torch.dtype:
        """The float dtype of activations, norms and caches (the weights' too unless they are quantized)."""
        return self.model.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    def runs_own_forward(self) -> bool:
        """Whether calling the model runs exactly ``CausalLM.forward``: no subclass override, no forward hooks (so a
        native decode step in its place skips nothing: ``decoding.steps.select_step``; which layers that step
        computes is ``runs_llama_layers``)."""
        return type(self).forward is CausalLM.forward and not self._forward_hooks and not self._forward_pre_hooks

    def runs_llama_layers(self) -> bool:
        """Whether the layers are Llama's (pre-norm, SwiGLU), each with RoPE: the layer the native and fused decode
        steps compute. A family with its own layers (``models.gemma``) or layers without RoPE (SmolLM3's) decodes
        through its eager forward."""
        return type(self.model) is Backbone and all(layer.self_attn.rope is not None for layer in self.model.layers)

    def generate(self, prompts: list | torch.Tensor, **kwargs: object) -> list:
        """Generate continuations of token-id prompts (a list of ints or a 1-D tensor, or a batch of them); see
        ``gqa.decoding.generate.generate`` for the arguments."""
        from ..decoding.generate import generate

        return generate(self, prompts, **kwargs)

    def new_caches(self, batch_size: int, max_len: int, *, window_caches: bool = True, kv_dtype: object = None) -> list:
        """One cache per layer, ``H_kv`` heads each, in the model's dtype and device: a preallocated
        ``StaticKVCache`` of ``max_len`` tokens, or for a sliding-window layer (with ``window_caches``, when
        ``max_len`` exceeds its window and ``spare``) a ``WindowKVCache`` that holds the window only. Compiled and
        graphed decoding take static caches (``window_caches=False``). ``kv_dtype``: what they store K/V as
        (``"auto"``: the model's dtype; ``"q8_0"``, ``"q4_0"``; a ``(K, V)`` pair; ``None``: ``self.kv_dtype``)."""
        kv_dtype = self.kv_dtype if kv_dtype is None else kv_dtype
        if max_len > self.config.max_position_embeddings:
            raise ValueError(
                f"max_len ({max_len}) exceeds the model's context of {self.config.max_position_embeddings} tokens"
            )
        cfg, caches = self.config, []
        for layer in self.model.layers:
            window = layer.self_attn.window
            keys = None if window is None or window[1] is not None else window[0] + 1  # keys a query sees
            kw = dict(dtype=self.dtype, device=self.device, kv_dtype=kv_dtype)
            if window_caches and layer_cache_tokens(keys, max_len) < max_len:
                caches.append(WindowKVCache(batch_size, cfg.num_kv_heads, cfg.head_dim, max_len, keys, **kw))
            else:
                caches.append(StaticKVCache(batch_size, cfg.num_kv_heads, cfg.head_dim, max_len, **kw))
        return caches

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        caches: list[StaticKVCache] | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Logits ``(B, L, vocab)`` (``(B, 1, vocab)`` with ``last_only``) for ``input_ids (B, L)``.

        ``attention_mask (B, L)`` (1 = token, 0 = padding) is for cache-less calls on left-padded batches; with
        ``caches`` the padding is the caches' (``set_left_padding``) and positions come from them. This is the eager
        forward, always; the fast decode steps (native, CUDA graphs, compiled) are ``gqa.decoding.steps.select_step``'s.
        """
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.long, torch.int32):
            raise ValueError(
                f"input_ids must be an integer tensor (B, L), got {input_ids.dtype} {tuple(input_ids.shape)}"
            )
        if caches is not None and len(caches) != len(self.model.layers):
            raise ValueError(f"caches has {len(caches)} entries, the model has {len(self.model.layers)} layers")
        if not torch.compiler.is_compiling() and input_ids.numel():
            low, high = int(input_ids.min()), int(input_ids.max())
            if low < 0 or high >= self.config.vocab_size:
                raise ValueError(f"input_ids must be in [0, {self.config.vocab_size}), got values in [{low}, {high}]")
        mask = None
        if attention_mask is not None:
            if caches is not None:
                raise ValueError("pass padding to the caches (set_left_padding), not attention_mask, when using caches")
            if attention_mask.shape != input_ids.shape:
                raise ValueError(
                    f"attention_mask {tuple(attention_mask.shape)} must match input_ids {tuple(input_ids.shape)}"
                )
            mask = padding_mask(attention_mask)  # (B, 1, 1, L)
            if position_ids is None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)  # (B, L) per-row positions
        if position_ids is None:  # one lookup of positions and cos/sin per forward, shared by every layer
            L = input_ids.shape[1]
            position_ids = caches[0].positions(L) if caches is not None else torch.arange(L, device=input_ids.device)
        rotations = self.model.rotations(position_ids)  # (cos, sin) (*P, L, D) each, or the family's per layer kind
        x = self.model.embed(input_ids)  # (B, L, E)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, mask, rotations, None if caches is None else caches[i])
        if last_only:
            x = x[:, -1:]
        logits = self.lm_head(self.model.norm(x))  # (B, L, vocab)
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


def decoder_layer(cfg: ModelConfig, rope: RoPE, layer: int, local_rope: RoPE | None = None) -> nn.Module:
    """Layer ``layer`` of ``cfg``'s family rotating by ``rope``, or for Gemma 3's sliding layers by ``local_rope``
    where given (as ``gqa convert`` streams a model a layer at a time; the backbone builds its own)."""
    if cfg.gemma:
        local = local_rope is not None and cfg.layer_window(layer) is not None
        return GemmaDecoderLayer(cfg, local_rope if local else rope, layer, local_rope=local)
    return DecoderLayer(cfg, rope, layer)


def _savable_state(module: CausalLM, state: dict, prefix: str, local_metadata: dict) -> None:
    """``state_dict`` post-hook: drop the tied head (``lm_head.weight``; a quantized head's ``lm_head.blocks``, the
    embeddings' own tensor) and make strided weight views contiguous."""
    if module.config.tie_word_embeddings:
        state.pop(prefix + "lm_head.weight", None)
        head, embed = prefix + "lm_head.", prefix + "model.embed_tokens."
        for name in [n for n in state if n.startswith(head)]:
            twin = state.get(embed + name[len(head) :])
            if isinstance(twin, torch.Tensor) and _same_memory(state[name], twin):
                del state[name]
    for name, tensor in state.items():
        if name.startswith(prefix) and not isinstance(tensor, nn.Parameter) and not tensor.is_contiguous():
            state[name] = tensor.contiguous()


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _tied_head_from_embeddings(module: CausalLM, state: dict, prefix: str, *args: object) -> None:
    """``load_state_dict`` pre-hook: with tied embeddings, the head's tensors (``lm_head.weight``, a quantized
    head's ``lm_head.blocks``) are the embeddings' of the same name."""
    if not module.config.tie_word_embeddings:
        return
    embeddings = state.get(prefix + "model.embed_tokens.weight")
    if embeddings is not None:
        state.setdefault(prefix + "lm_head.weight", embeddings)
    for name in module.lm_head.state_dict():
        twin = state.get(prefix + "model.embed_tokens." + name)
        if twin is not None:
            state.setdefault(prefix + "lm_head." + name, twin)


def set_left_padding(caches: list[StaticKVCache], pad: torch.Tensor | list[int]) -> None:
    """Declare ``pad[b]`` left-padding slots for row ``b`` in every layer's cache."""
    for cache in caches:
        cache.set_left_padding(pad)


def use_input_major_weights(model: nn.Module) -> None:
    """Re-store every ``nn.Linear`` weight ``(out, in)`` as a transposed view of an ``(in, out)``-contiguous tensor.

    Values, names and shapes stay the same (state dicts load and save as before); only the memory layout changes.
    ``F.linear`` then runs ``x @ W_t`` on a contiguous ``W_t``: for float32 on CPU a batch-1 decode GEMV streams
    that layout about 1.4x faster than ``x @ W.T`` (measured on SmolLM2: 44 -> 32 ms per token). bf16 GEMVs prefer
    the usual layout, so ``gqa.load_model`` applies this to float32 models only. Tied weights stay tied.
    """
    new: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name in ("weight",):
            param = getattr(module, name, None)
            if not isinstance(module, (nn.Linear, nn.Embedding)) or not isinstance(param, nn.Parameter):
                continue
            if id(param) not in new:
                if isinstance(module, nn.Embedding) and not any(
                    m.weight is param for m in model.modules() if isinstance(m, nn.Linear)
                ):
                    continue  # an untied embedding is only gathered from: keep rows contiguous
                data = param.detach().t().contiguous().t()  # same (out, in) values, (in, out) memory
                new[id(param)] = nn.Parameter(data, requires_grad=param.requires_grad)
            setattr(module, name, new[id(param)])
