"""``select_step``: the one place that decides which decode step runs a model's next token, and names it.

A decode step maps ``tokens (B, 1)`` and the model's static KV caches to the logits ``(B, 1, vocab)``, appending each
layer's K/V. Which one runs depends on the device, the model and the caller; ``CausalLM.forward`` is always the eager
one. The kinds, in the order ``select_step`` tries them:

* ``custom``: the caller's ``step_fn``;
* ``cuda-graphs`` (CUDA, triton installed, no tensor parallelism): the step replayed from a CUDA graph
  (``cuda_graphs.GraphedDecoder``; with ``compile``, the Inductor-compiled fused step inside the graph);
* ``compiled`` (``compile`` elsewhere): ``model.forward`` under ``torch.compile`` (``compiled.compiled_step``);
* ``native`` (CPU, float32/bfloat16, native kernels built, the model's own forward, no soft-capping or sinks): the
  whole step in one native call (``native_step``; q/k-normed layers op by op, and a quantized KV cache only where the
  one call runs the model), which also finds each row's argmax while writing the logits; a call it cannot take (more
  rows than it handles, a full cache, autograd on, a context longer than a layer's sliding window) runs eagerly;
* ``eager``: ``model(tokens, caches=caches)``.

Steps whose batch size is baked in (``fixed_batch``: graphs, compiled, custom) keep every row to the end; the others
let the generate loop drop finished rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import kernels
from ..cache.kv import StaticKVCache
from . import native_step

__all__ = ["DecodeStep", "select_step"]

Step = Callable[[torch.Tensor, list], torch.Tensor]


@dataclass(frozen=True)
class DecodeStep:
    """A decode step and what it is (module docstring). ``step(tokens (B, 1), caches, greedy=None)`` -> logits
    ``(B, 1, vocab)``; with ``finds_greedy``, an int64 ``greedy (B,)`` gets each row's argmax from the step itself."""

    name: str
    run: Callable[..., torch.Tensor]
    fixed_batch: bool = False
    finds_greedy: bool = False

    def __call__(self, tokens: torch.Tensor, caches: list, greedy: torch.Tensor | None = None) -> torch.Tensor:
        if greedy is not None and not self.finds_greedy:
            raise ValueError(f"the {self.name} step does not find greedy tokens (finds_greedy is False)")
        return self.run(tokens, caches, greedy) if self.finds_greedy else self.run(tokens, caches)


def _native_possible(model: torch.nn.Module) -> bool:
    """What of ``native_step.applies`` depends on the model alone (the rest is checked per call)."""
    rope = model.model.rope
    return (
        model.device.type == "cpu"
        and model.dtype in native_step.DTYPES
        and not model.training
        and not rope.interleaved
        and rope.rotary_dim == rope.head_dim
        and kernels.vectorized()
        and model.runs_own_forward()
        # the one call computes every option it takes; the call per layer, Llama's layers without soft-caps or sinks
        and (native_step.whole_model(model) or (model.runs_llama_layers() and not _scores_modified(model)))
    )


def _scores_modified(model: torch.nn.Module) -> bool:
    return any(layer.self_attn.softcap is not None or layer.self_attn.sinks is not None for layer in model.model.layers)


def _window_left(model: torch.nn.Module) -> int | None:
    """The narrowest left side of the layers' sliding windows (None: no layer has one). A decoded token is the last
    query, so a window's right side never hides a key from it."""
    lefts = [a.window[0] for a in (layer.self_attn for layer in model.model.layers) if a.window is not None]
    return min((n for n in lefts if n is not None), default=None)


def _within(cache, left: int) -> bool:
    """Whether every row's keys after this token is written (``[start, cursor]``) fit a window of ``left`` keys
    before the token: then the window hides nothing and the windowless native step is exact."""
    return int(cache.cursor) - int(cache.start.min()) <= left


def select_step(
    model: torch.nn.Module, caches: list, *, compile: bool = False, step_fn: Step | None = None
) -> DecodeStep:
    """The decode step for ``model`` over ``caches`` (module docstring). ``compile``: a compiled step (on CUDA, inside
    the CUDA graph); ``step_fn(tokens, caches) -> logits``: the caller's own."""

    def eager(tokens: torch.Tensor, caches: list) -> torch.Tensor:
        return model(tokens, caches=caches)

    if step_fn is not None:
        if compile:
            raise ValueError("pass either compile=True or a step_fn, not both")
        return DecodeStep("custom", step_fn, fixed_batch=True)
    if model.device.type == "cuda":
        from ..kernels.triton.split_kv import triton_available
        from .cuda_graphs import GraphedDecoder, graphs_apply

        if triton_available() and graphs_apply(model, caches) is None:
            decoder = GraphedDecoder(model, caches, compile=compile)
            return DecodeStep(f"cuda-graphs ({decoder.name} step)", decoder, fixed_batch=True)
    if compile:
        from .compiled import compiled_step

        return DecodeStep("compiled", compiled_step(model), fixed_batch=True)
    possible = _native_possible(model)
    # the one call's weights (None: the model is not one call's), gathered once for the step's life (a generation):
    # not checked again at every token
    weights = native_step.decode_weights(model, model.dtype) if possible else None
    whole = weights is not None  # the one call: window caches too
    # the call per layer reads float caches only: over a quantized one (tensor parallelism's ranks) every token would
    # go the eager way, so that is the step
    if possible and all(isinstance(c, StaticKVCache) or whole for c in caches) and (whole or not caches[0].quantized):
        # the one native call computes windows; the call per layer does not, so it runs while they hide nothing
        left = None if whole else _window_left(model)

        def native(tokens: torch.Tensor, caches: list, greedy: torch.Tensor | None) -> torch.Tensor:
            if native_step.applies(model, tokens, caches) and (left is None or _within(caches[0], left)):
                return native_step.decode_step(model, tokens, caches, greedy=greedy, weights=weights)
            logits = eager(tokens, caches)
            if greedy is not None:
                greedy.copy_(logits[:, -1].float().argmax(-1))
            return logits

        return DecodeStep("native", native, finds_greedy=True)
    return DecodeStep("eager", eager)
