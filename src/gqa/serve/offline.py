"""Offline batch generation through the serving engine (continuous batching, paged KV cache), like vLLM's
``LLM.generate``:

    llm = LLM()                                   # the embedded SmolLM2, or a path, or a loaded CausalLM
    for c in llm.generate(["Name a planet.", "Name a colour."], SamplingParams(max_tokens=32), chat=True):
        print(c.text, c.finish_reason)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .engine import Engine
from .sampling import SamplingParams

__all__ = ["LLM", "Completion"]


@dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]
    text: str | None  # None without a tokenizer
    finish_reason: str


class LLM:
    """A model and an ``Engine`` for it. ``model``: a ``CausalLM``, or what ``gqa.load_model`` takes (``None``: the
    embedded SmolLM2) loaded with ``dtype``; ``engine_options`` go to ``Engine`` (``kv_cache_mib``, ``block_size``,
    ``max_running``, ``prefill_chunk``)."""

    def __init__(
        self, model: torch.nn.Module | str | Path | None = None, *, dtype: str | torch.dtype = "auto", **engine_options
    ) -> None:
        if model is None or isinstance(model, (str, Path)):
            from ..loaders.model import load_model

            model = load_model(model, dtype=dtype)
        self.model = model
        self.tokenizer = getattr(model, "tokenizer", None)
        self.engine = Engine(model, self.tokenizer, **engine_options)

    def generate(
        self,
        prompts: str | list[int] | list[str | list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        *,
        chat: bool = False,
    ) -> list[Completion]:
        """A completion per prompt, in order. A prompt is text (needs a tokenizer; ``chat``: one user message through
        the chat template) or token ids; ``params``: one for all or one per prompt."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        ids = [self._ids(p, chat) for p in prompts]
        requests = [self.engine.add(p, sp) for p, sp in zip(ids, params, strict=True)]
        done: dict[str, str] = {}
        while self.engine.has_work:
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out.finish_reason
        return [
            Completion(r.prompt, r.outputs, None if r.text is None else r.text.text, done[r.request_id])
            for r in requests
        ]

    def _ids(self, prompt: str | list[int], chat: bool) -> list[int]:
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        if self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer; this model has none (give token ids)")
        return self.tokenizer.apply_chat(prompt) if chat else self.tokenizer.encode(prompt)
