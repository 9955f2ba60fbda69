"""Serving: ``gqa serve``'s layers, one file each.

* ``request`` — a request's states (``RequestState``), what it holds, what a step hands back (``RequestOutput``);
* ``config`` — ``EngineConfig``, the engine's settings, checked once;
* ``blocks`` — the paged KV cache's bookkeeping: block tables, reference counts, prefix caching (no tensors);
* ``paged_cache`` — the per-layer pools of K/V blocks;
* ``scheduler`` — who runs in a step: admission, prompt chunks, finishing, preemption (no tensors);
* ``runner`` — the KV pool and one native paged decode call per step;
* ``triton_runner``, ``step_graphs`` — the GPU's step (the paged Triton kernel), its decode steps replayed from
  CUDA graphs per batch-size bucket;
* ``sampler``, ``sampling``, ``detokenizer`` — tokens for the sampled rows, per-request settings, incremental text;
* ``structured`` — structured output: grammars (xgrammar) that mask a row's logits; ``schema_check``, the JSON
  schemas it takes; ``grammar_compiles``, the server's compiles on threads of their own, bounded in time;
* ``speculation`` — prompt-lookup drafts, verified as extra rows of the same call;
* ``engine`` — ``step = schedule -> run -> sample -> update``;
* ``offline`` — ``LLM(...).generate(prompts)``, the engine without a server;
* ``async_engine``, ``openai_api``, ``tools``, ``server``, ``http_protocol`` — the engine on its own thread, OpenAI's
  shapes and function calling, the HTTP app, uvicorn's protocol with a deadline for headers;
* ``driver`` — what every HTTP API does with the engine; ``answers`` — an answer's text, calls and end, whole or as
  deltas; ``anthropic_api`` + ``messages_routes``, ``responses_api`` + ``responses_routes`` + ``response_store`` —
  Anthropic's Messages API and OpenAI's Responses API over it;
* ``model_router``, ``loaded_models``, ``asgi_calls`` — several models behind one server: the app that routes by a
  request's ``model`` and loads and unloads models, which ones stay loaded (LRU under a count and a budget), the ASGI
  plumbing it needs.

``LLM``, ``Engine`` and ``SamplingParams`` are loaded on first use (they import torch).
"""

from .._lazy import lazy_names
from .blocks import BlockManager, BlockTable, OutOfBlocks

__all__ = ["LLM", "BlockManager", "BlockTable", "Engine", "EngineConfig", "OutOfBlocks", "SamplingParams"]

__getattr__ = lazy_names(
    __name__, {"LLM": "offline", "Engine": "engine", "EngineConfig": "config", "SamplingParams": "sampling"}
)
