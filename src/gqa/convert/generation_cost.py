"""What generating a conversion's calibration conversations will cost, said before it is paid (``gqa convert`` and
``gqa convert --dry-run`` print it with the plan).

The cache may already hold the rows (``gqa.convert.conversations``: a set of ``n`` user turns serves any count up to
``n``, and a journal keeps the rows of a run that stopped). For the rows it lacks, a short timed probe runs the first
rows through the same generation (``generate_many``: the serving engine's batched native step, or the fallback) for a
few tokens; the estimate is the work left in generated tokens over the probe's rate. The tokens a row takes on average
come from SmolLM2-135M-Instruct's own set (docs/conversion.md, "The calibration budget"): another model writes longer
or shorter turns, so the estimate is a guide, within a factor of about two.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .conversations import (
    HELD_OUT_PER_MILLE,
    ConversationSet,
    GenerationSettings,
    cached_file,
    cached_path,
    end_of_turn_ids,
    model_content_hash,
    read_cached,
    stored_count,
    user_turn_prompts,
)

if TYPE_CHECKING:
    from ..loaders.tokenizer import Tokenizer
    from ..models import CausalLM

__all__ = ["CALIBRATION_TOKENS_PER_TURN", "GenerationCost", "cached_rows", "generation_cost", "source_generation_cost"]

# SmolLM2-135M-Instruct's 1,400-turn set: generated tokens per sampled user turn (dropped ones included), answers per
# user turn kept, tokens per answer
TURN_TOKENS = 22.7
KEPT_SHARE = 0.85
ANSWER_TOKENS = 113.0
PROMPT_TOKENS = 49.0  # per conversation: the system prompt, the user turn, the template's markers
# calibration tokens a sampled user turn gives (kept, in the training split, prompt and answer)
CALIBRATION_TOKENS_PER_TURN = KEPT_SHARE * (1 - HELD_OUT_PER_MILLE / 1000) * (PROMPT_TOKENS + ANSWER_TOKENS)
PROBE_TOKENS = 5  # tokens each probe row generates: the first, then 4 timed decode steps


@dataclass(frozen=True)
class GenerationCost:
    """The conversations a conversion reads: ``settings.count`` user turns, ``cached`` of them (and ``answers`` of
    their answers) already made, ``done`` when the cache file holds the whole set; ``seconds`` the estimate for the
    rest on this machine (0 when done), from a probe that timed ``probe_tokens`` tokens at ``rate`` tokens/s."""

    settings: GenerationSettings
    model_hash: str
    cached: int
    answers: int
    seconds: float
    done: bool = False
    rate: float = 0.0
    probe_tokens: int = 0

    @property
    def count(self) -> int:
        return self.settings.count

    @property
    def path(self) -> Path:
        return cached_path(self.model_hash, self.settings)

    def read(self, count: int) -> ConversationSet:
        """The cached set of the first ``count`` user turns (``done`` must hold)."""
        return read_cached(self.model_hash, dataclasses.replace(self.settings, count=count))

    def describe(self) -> str:
        """One line for the plan."""
        if self.done:
            return f"conversations of {self.count:,} user turns, read from the cache {self.path}"
        if self.cached or self.answers:
            what = (f"the {self.count - self.cached:,} user turns and the answers left to generate (a stopped run made "
                    f"{self.cached:,} turns and {self.answers:,} answers)")  # fmt: skip
        else:
            what = f"{self.count:,} user turns and their answers to generate"
        return (
            f"conversations: {what} (~{self.seconds / 60:.1f} min here: {self.rate:,.0f} tokens/s in a short "
            f"probe); cached in {self.path.parent}"
        )


def cached_rows(model_hash: str, settings: GenerationSettings) -> tuple[int, int, bool]:
    """``(user turns, answers, whole)`` the cache already holds for this model and these settings: in the set's file,
    or in the journal of the rows made so far, whichever holds more; ``whole`` when the file holds a set of at least
    ``settings.count`` user turns."""
    from .batch_journal import BatchJournal

    data = cached_file(model_hash, settings)
    turns, answers = (0, 0) if data is None else (stored_count(data), len(data["conversations"]))
    whole = turns >= settings.count
    journal = cached_path(model_hash, settings).with_suffix(".rows.jsonl")
    if journal.is_file():
        rows = BatchJournal(journal, read_only=True)  # a run may be writing it
        turns, answers = max(turns, len(rows.finished("user turns"))), max(answers, len(rows.finished("answers")))
    return turns, answers, whole


def generation_cost(
    model: CausalLM | None, tok: Tokenizer, model_hash: str, settings: GenerationSettings
) -> GenerationCost:
    """What making ``settings``' conversations will cost (module docstring). ``model`` is only run when rows are
    missing (``None`` then gives no time estimate)."""
    return _cost(model, tok, model_hash, settings, cached_rows(model_hash, settings))


def _cost(
    model: CausalLM | None, tok: Tokenizer, model_hash: str, settings: GenerationSettings, rows: tuple[int, int, bool]
) -> GenerationCost:
    """``generation_cost`` given the cache's ``cached_rows``."""
    turns, answers, whole = rows
    turns = min(turns, settings.count)
    if whole or model is None:
        return GenerationCost(settings, model_hash, turns, answers, 0.0, done=whole)
    rate, tokens = probe_rate(model, tok, settings)
    left = (settings.count - turns) * TURN_TOKENS + max(0.0, settings.count * KEPT_SHARE - answers) * ANSWER_TOKENS
    return GenerationCost(settings, model_hash, turns, answers, left / rate, rate=rate, probe_tokens=tokens)


def probe_rate(model: CausalLM, tok: Tokenizer, settings: GenerationSettings) -> tuple[float, int]:
    """``(tokens/s, tokens)``: the first ``min(count, batch_size)`` user-turn prompts generate ``PROBE_TOKENS`` tokens
    each through the same path as the real run. Through the serving engine every row is admitted in the first step
    and the decode steps after it are timed: a long run's batch is full, and its prompts' prefill a small share of its
    time, unlike a probe's few steps. Through the fallback, from start to end."""
    from ..serve.engine import Engine, EngineError
    from .bulk_generation import generate_continuous, generate_many

    rows = min(settings.count, settings.batch_size)
    prompts = user_turn_prompts(tok, rows)
    kw = {
        "max_new_tokens": PROBE_TOKENS, "end_ids": end_of_turn_ids(tok, model), "batch_size": rows,
        "temperature": settings.temperature, "top_p": settings.top_p, "seed": settings.seed,
    }  # fmt: skip
    try:
        Engine.check_model(model)
    except EngineError:
        start = time.perf_counter()
        tokens = sum(len(ids) for ids in generate_many(model, prompts, **kw))
        return tokens / max(time.perf_counter() - start, 1e-9), tokens
    steps: list[tuple[float, int]] = []  # (time, tokens) of each step

    def step(tokens: int) -> None:
        steps.append((time.perf_counter(), tokens))

    start = time.perf_counter()
    generate_continuous(model, prompts, on_step=step, prefill_chunk=sum(map(len, prompts)), **kw)
    tokens = sum(n for _, n in steps[1:])
    if tokens == 0:  # every row ended at its first token: only the whole probe to time
        return sum(n for _, n in steps) / max(steps[-1][0] - start, 1e-9), sum(n for _, n in steps)
    return tokens / (steps[-1][0] - steps[0][0]), tokens


def source_generation_cost(resolved: Path, tok: Tokenizer, settings: GenerationSettings) -> GenerationCost:
    """``generation_cost`` for the model at ``resolved`` (a conversion's source), loaded only when rows are missing."""
    model_hash = model_content_hash(resolved)
    rows = cached_rows(model_hash, settings)
    if rows[2]:
        return _cost(None, tok, model_hash, settings, rows)
    from ..loaders import read_model
    from ..models import CausalLM

    cfg, state = read_model(resolved)
    return _cost(CausalLM.from_state(cfg, state, assign=True), tok, model_hash, settings, rows)
