"""Text generation: one prefill of the (left-padded) prompts, then one token per step through static KV caches.

Greedy (``temperature=0``) or sampling with temperature, top-k and top-p from a seeded generator; stops at EOS per
row or after ``max_new_tokens``; ``generate_stream`` yields each step's tokens as they come.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from .sampling import SEED_RANGE, check_sampling, sample_next
from .steps import DecodeStep, select_step

if TYPE_CHECKING:  # a type only: models.llama's CausalLM.generate imports this module
    from ..models.llama import CausalLM


def _left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, list[int]]:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    pads = [width - len(p) for p in prompts]
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    for row, (p, pad) in enumerate(zip(prompts, pads, strict=True)):
        ids[row, pad:] = torch.as_tensor(list(p), dtype=torch.long)
    return ids, pads


def _prompt_batch(prompts: object) -> tuple[list[list[int]], bool]:
    """Token-id prompts as a list of lists, and whether a single prompt was given.

    One prompt: a list of ints or a 1-D integer tensor. Several: a list of those, or a 2-D ``(B, L)`` tensor.
    """
    if isinstance(prompts, torch.Tensor):
        if prompts.is_floating_point() or prompts.is_complex() or prompts.dtype == torch.bool:
            raise TypeError(f"prompts must hold integer token ids, got a tensor of {prompts.dtype}")
        if prompts.dim() not in (1, 2):
            raise ValueError(f"a prompts tensor must be 1-D (one prompt) or 2-D (B, L), got {tuple(prompts.shape)}")
        return (prompts.tolist(), False) if prompts.dim() == 2 else ([prompts.tolist()], True)
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be token ids (list of ints, integer tensor), got {type(prompts).__name__}")
    if len(prompts) == 0 or isinstance(prompts[0], int):  # one prompt (an empty one is refused later)
        return [list(prompts)], True
    batch = []
    for p in prompts:
        rows, single = _prompt_batch(p)
        if not single:
            raise ValueError("each prompt of a batch must be one sequence of token ids (a list or a 1-D tensor)")
        batch += rows
    return batch, False


# Finished rows stop being computed once no more than this share of the computed rows is still running: the caches
# are cut to the running rows (a copy). A row's tokens do not depend on it: the native step computes each row the
# same way whatever rows are beside it (the eager GEMMs up to float rounding), and a sampled row draws its own number
# per step. Not with a step whose batch size is baked in (``DecodeStep.fixed_batch``: compiled, CUDA graphs, a step_fn).
DROP_FINISHED_AT = 0.75


def _token_ids(ids: object, name: str) -> list[int]:
    """``ids`` (token ids, or one id) as a list of ints; ``ValueError`` naming ``name`` otherwise."""
    if isinstance(ids, int) and not isinstance(ids, bool):
        return [ids]
    try:
        out = list(ids)  # type: ignore[call-overload]
    except TypeError:
        out = None
    if out is None or any(isinstance(t, bool) or not isinstance(t, int) for t in out):
        raise ValueError(f"{name} must be token ids (ints), got {ids!r}")
    return out


@torch.inference_mode()
def generate_stream(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    eos_token_ids: Sequence[int] | None = None,
    pad_token_id: int | None = None,
    step_fn: Callable[[torch.Tensor, list], torch.Tensor] | None = None,
    compile: bool = False,
    on_step: Callable[[DecodeStep], None] | None = None,
    kv_dtype: object = None,
) -> Iterator[torch.Tensor]:
    """Yield the next token of every row ``(B,)`` per step; a row that has finished yields ``pad_token_id``.

    ``prompts`` are token-id lists (or 1-D tensors) of any lengths, left-padded into one batch, each row with its
    own positions; a single list of ints is one prompt.
    ``step_fn(tokens (B, 1), caches) -> logits (B, 1, vocab)`` replaces the plain decode step (e.g. a compiled one).
    ``compile``: decode through ``torch.compile`` (``gqa.decoding.compiled``): compiled once per batch size and cache
    bucket, kept on disk for the next process; on CUDA the compiled fused step inside the CUDA graph
    (``gqa.decoding.cuda_graphs``). Without it, decoding on CPU runs the native step (``decoding.native_step``),
    and on CUDA a captured CUDA graph of the step (``gqa.decoding.cuda_graphs``) where triton is installed: which one
    ``decoding.steps.select_step`` decides, after the prompt, and ``on_step`` is told (``gqa generate --stats``).
    ``kv_dtype``: what the caches store (``CausalLM.new_caches``; ``None``: ``model.kv_dtype``); a quantized cache
    decodes natively on CPU and in a CUDA graph on CUDA, never compiled.
    ``temperature``, ``top_k``, ``top_p``, ``min_p``: how a token is chosen (``sampling.sample_next``; 0: greedy).
    """
    cfg = model.config
    check_sampling(temperature, top_k, top_p, min_p)  # before the prompt is run, not at the first sampled token
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not SEED_RANGE[0] <= seed <
                             SEED_RANGE[1]):  # fmt: skip
        raise ValueError(f"seed must be an int in [-2**63, 2**64), got {seed!r}")
    if compile and step_fn is not None:
        raise ValueError("pass either compile=True or a step_fn, not both")
    eos = _token_ids(cfg.eos_token_id if eos_token_ids is None else eos_token_ids, "eos_token_ids")
    pad_id = pad_token_id if pad_token_id is not None else (cfg.pad_token_id if cfg.pad_token_id is not None else 0)
    ids, pads = _left_pad(_prompt_batch(prompts)[0], pad_id, model.device)
    B, P = ids.shape
    if P + max_new_tokens > cfg.max_position_embeddings:
        raise ValueError(
            f"prompt of {P} tokens + max_new_tokens {max_new_tokens} exceeds the model's context of "
            f"{cfg.max_position_embeddings} tokens; shorten the prompt or lower max_new_tokens"
        )
    if seed is None and temperature > 0 and getattr(model, "shard", None) is not None:
        from ..parallel.distributed import shared_seed

        seed = shared_seed()  # tensor-parallel ranks must draw the same samples
    generator = None
    if seed is not None:
        generator = torch.Generator(device=model.device).manual_seed(seed)

    capacity = P + max_new_tokens
    if compile:
        from .compiled import cache_bucket

        capacity = cache_bucket(capacity, cfg.max_position_embeddings)  # a few cache sizes: a few compilations
    caches = model.new_caches(B, capacity, window_caches=not (compile or _graphed(model, step_fn)), kv_dtype=kv_dtype)
    if compile and caches[0].quantized:
        raise ValueError("compile=True takes a float KV cache; a quantized one (kv_dtype) decodes natively or eagerly")
    for cache in caches:
        cache.set_left_padding(pads)
    logits = model(ids, caches=caches, last_only=True)[:, -1]  # (B, vocab)
    step = select_step(model, caches, compile=compile, step_fn=step_fn)
    if on_step is not None:
        on_step(step)
    eos_ids = torch.tensor(eos, dtype=torch.long, device=model.device)
    finished = torch.zeros(B, dtype=torch.bool, device=model.device)
    rows = torch.arange(B, device=model.device)  # the rows still computed (finished ones are dropped in bulk)
    picked = None  # greedy tokens the native step found while writing the logits
    for i in range(max_new_tokens):
        if picked is None:
            uniforms = None  # one number per row and step, whichever rows are still computed
            if temperature > 0:
                uniforms = torch.rand(B, generator=generator, device=model.device)[rows]
            picked = sample_next(
                logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, uniforms=uniforms
            )
        token = torch.full((B,), pad_id, dtype=torch.long, device=model.device)
        token[rows] = picked
        token.masked_fill_(finished, pad_id)
        yield token
        finished |= torch.isin(token, eos_ids)
        if bool(finished.all()) or i == max_new_tokens - 1:
            return
        picked = None
        alive = ~finished[rows]
        if not step.fixed_batch and int(alive.sum()) <= DROP_FINISHED_AT * len(rows):
            keep = alive.nonzero().squeeze(1)
            for cache in caches:
                cache.keep_rows(keep)
            rows = rows[keep]
        new = token[rows][:, None]  # (rows, 1)
        if temperature == 0 and step.finds_greedy:
            picked = torch.empty(len(rows), dtype=torch.long, device=model.device)
            logits = step(new, caches, greedy=picked)[:, -1]
        else:
            logits = step(new, caches)[:, -1]  # (rows, vocab)


def generate(
    model: CausalLM,
    prompts: Sequence[Sequence[int]] | Sequence[int] | torch.Tensor,
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    eos_token_ids: Sequence[int] | None = None,
    on_token: Callable[[torch.Tensor], None] | None = None,
    step_fn: Callable[[torch.Tensor, list], torch.Tensor] | None = None,
    compile: bool = False,
    on_step: Callable[[DecodeStep], None] | None = None,
    kv_dtype: object = None,
) -> list[list[int]] | list[int]:
    """Generate continuations of token-id prompts; returns the new tokens of each row, EOS included, padding not.

    A single prompt (a list of ints or a 1-D integer tensor) gives a single list back; a batch (a list of those, or
    a ``(B, L)`` tensor) gives a list per row. ``on_token(tokens (B,))`` is called at every step; ``compile`` and
    ``on_step`` and ``kv_dtype`` as in ``generate_stream``.
    """
    batch, single = _prompt_batch(prompts)
    eos = set(_token_ids(model.config.eos_token_id if eos_token_ids is None else eos_token_ids, "eos_token_ids"))
    out: list[list[int]] = [[] for _ in batch]
    done = [False] * len(batch)
    for token in generate_stream(
        model,
        batch,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        seed=seed,
        eos_token_ids=eos_token_ids,
        step_fn=step_fn,
        compile=compile,
        on_step=on_step,
        kv_dtype=kv_dtype,
    ):
        if on_token is not None:
            on_token(token)
        for row, t in enumerate(token.tolist()):
            if not done[row]:
                out[row].append(t)
                done[row] = t in eos
    return out[0] if single else out


def _graphed(model: torch.nn.Module, step_fn: object) -> bool:
    """Whether decoding will replay a CUDA graph, which takes static caches (a sliding-window layer's kernel reads
    only its window's keys of them: compute as a window cache, memory as a full one)."""
    if step_fn is not None or model.device.type != "cuda":
        return False
    from ..kernels.triton.split_kv import triton_available
    from .cuda_graphs import graphs_apply

    return triton_available() and graphs_apply(model, None) is None
