"""Continuations of many prompts at once, for data a model writes itself (``gqa.convert.conversations``, the
answers ``gqa eval --suite`` compares): resumable, and the same whichever rows run together.

``generate_continuous`` runs them through the serving engine (``gqa.serve.engine``): continuous batching — a finished
row's slot goes to the next prompt at the next step, so the batch stays full — over a paged KV cache whose cached
prefix blocks (the chat template's system prompt) are read once, not once per prompt. ``generate_batched`` is the
fallback for models the engine does not take (GPU, float16, no native kernels): fixed batches of rows of similar
length through ``gqa.decoding.generate.generate``.

With a ``BatchJournal``, each finished row is recorded under its index (the rows finished in one step or one batch
on one line), and rows already recorded are not generated again: an interrupted run loses at most the rows in flight.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .batch_journal import BatchJournal

if TYPE_CHECKING:
    from ..models import CausalLM

__all__ = ["ROW_SEED", "generate_batched", "generate_continuous", "generate_many"]

ROW_SEED = 1_000_003  # row (or batch) i of a run seeded with s samples from the seed s * ROW_SEED + i


def generate_many(model: CausalLM, prompts: Sequence[list[int]], **kw: Any) -> list[list[int]]:
    """``generate_continuous`` where the serving engine takes ``model``, else ``generate_batched`` (same arguments;
    ``batch_size`` is the engine's ``max_running``)."""
    from ..serve.engine import Engine, EngineError

    try:
        Engine.check_model(model)
    except EngineError:
        return generate_batched(model, prompts, **kw)
    return generate_continuous(model, prompts, **kw)


def generate_continuous(
    model: CausalLM,
    prompts: Sequence[list[int]],
    *,
    max_new_tokens: int,
    end_ids: set[int],
    batch_size: int,
    temperature: float = 0.0,
    top_p: float | None = None,
    seed: int | None = None,
    bar: Any = None,
    journal: BatchJournal | None = None,
    phase: str = "",
    on_step: Callable[[int], None] | None = None,
    prefill_chunk: int | None = None,
) -> list[list[int]]:
    """Continuations of ``prompts`` (module docstring), in the prompts' order, each ending with its end token when one
    came: greedy, or sampled (``temperature``, ``top_p``) with row ``i`` drawing from the seed ``seed * ROW_SEED + i``.
    A row's tokens depend only on its prompt and seed (the engine's rows are batch-invariant), so a resumed run gives
    what an uninterrupted one gives. At most ``batch_size`` rows decode together. ``on_step``, when given, is called
    after each engine step with the number of tokens it generated; ``prefill_chunk`` sets the engine's prompt tokens
    per step (default: the engine's; the rows' tokens do not depend on it).

    Raises
    ------
    ValueError : a prompt that leaves no room in the model's context.
    RuntimeError : a row the engine could not generate (its error).
    """
    from ..serve.engine import Engine
    from ..serve.sampling import SamplingParams

    out = _recorded(prompts, journal, phase, bar)
    todo = sorted((i for i, ids in enumerate(out) if ids is None), key=lambda i: prompts[i])  # shared prefixes adjacent
    if not todo:
        return out
    cfg = model.config
    context = cfg.max_position_embeddings
    rooms = {i: min(max_new_tokens, context - len(prompts[i])) for i in todo}
    if min(rooms.values()) < 1:
        raise ValueError(f"a prompt of {max(len(prompts[i]) for i in todo)} tokens leaves no room in the context")
    token_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * model.dtype.itemsize
    longest = max(len(prompts[i]) + rooms[i] for i in todo)
    kv_mib = (batch_size * (longest + 16) + 1024) * token_bytes / 2**20  # every running row whole, cached prefixes
    options = {} if prefill_chunk is None else {"prefill_chunk": prefill_chunk}
    engine = Engine(model, max_running=batch_size, kv_cache_mib=kv_mib, eos_token_ids=end_ids, **options)
    rows = {}  # request id: (row, request)
    for i in todo:
        params = SamplingParams(max_tokens=rooms[i], temperature=temperature, top_p=top_p,
                                seed=None if seed is None else seed * ROW_SEED + i)  # fmt: skip
        r = engine.add(prompts[i], params)
        rows[r.request_id] = (i, r)
    while engine.has_work:
        finished = {}
        outputs = engine.step()
        if on_step is not None:
            on_step(sum(len(o.token_ids) for o in outputs))
        for o in outputs:
            if o.finished:
                i, r = rows.pop(o.request_id)
                if o.finish_reason == "error":
                    raise RuntimeError(f"generating row {i} failed: {o.error}")
                finished[i] = out[i] = list(r.outputs)
        _record(finished, journal, phase, bar)
    return out


def generate_batched(
    model: CausalLM,
    prompts: Sequence[list[int]],
    *,
    max_new_tokens: int,
    end_ids: set[int],
    batch_size: int,
    temperature: float = 0.0,
    top_p: float | None = None,
    seed: int | None = None,
    bar: Any = None,
    journal: BatchJournal | None = None,
    phase: str = "",
) -> list[list[int]]:
    """Continuations of ``prompts`` (greedy, or sampled with the seed ``seed * ROW_SEED + b`` for batch ``b``), in the
    prompts' order, through ``gqa.decoding.generate.generate`` in fixed batches of ``batch_size`` rows of similar
    length. A
    batch whose rows the journal holds is not generated again (its rows and seed depend only on the prompts)."""
    from ..decoding.generate import generate

    out = _recorded(prompts, journal, phase, bar)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    for b, start in enumerate(range(0, len(order), batch_size)):
        rows = order[start : start + batch_size]
        if all(out[i] is not None for i in rows):  # finished by an earlier, interrupted run
            continue
        room = model.config.max_position_embeddings - max(len(prompts[i]) for i in rows)  # left in the context
        if room < 1:
            raise ValueError(f"a prompt of {len(prompts[rows[-1]])} tokens leaves no room in the model's context")
        got = generate(
            model, [prompts[i] for i in rows], max_new_tokens=min(max_new_tokens, room), temperature=temperature,
            top_p=top_p, seed=None if seed is None else seed * ROW_SEED + b, eos_token_ids=sorted(end_ids),
        )  # fmt: skip
        finished = {}
        for i, ids in zip(rows, got, strict=True):
            if out[i] is None:
                finished[i] = out[i] = ids
        _record(finished, journal, phase, bar)
    return out


def _recorded(prompts: Sequence[list[int]], journal: BatchJournal | None, phase: str, bar: Any) -> list[Any]:
    """A slot per prompt: the rows ``journal`` holds for ``phase``, ``None`` for the rest."""
    out: list[Any] = [None] * len(prompts)
    for i, ids in ({} if journal is None else journal.finished(phase)).items():
        if 0 <= i < len(out):
            out[i] = ids
    if bar is not None:
        bar.update(sum(ids is not None for ids in out))
    return out


def _record(finished: dict[int, list[int]], journal: BatchJournal | None, phase: str, bar: Any) -> None:
    if finished and journal is not None:
        journal.add(phase, finished)
    if bar is not None:
        bar.update(len(finished))
