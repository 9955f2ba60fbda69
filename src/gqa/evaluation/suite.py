"""``gqa eval MODEL --suite``: a model judged against its original on answers and on prose.

Four measures (``gqa.evaluation.answers`` has the first three):

1. mean ``KL(original || model)`` on the answer tokens of held-out self-generated conversations;
2. the model's greedy answers to those conversations' user turns against the original's: common prefix and token F1;
3. the project's question set: how many questions each model answers right, and the fraction of the original's
   right answers the model keeps;
4. perplexity of both on prose of several genres (``GENRES``): CPython's ``LICENSE.txt`` (licence and release
   history), held-out standard-library docstrings (technical), and the encyclopedic paragraphs written for the
   project (``gqa/data/encyclopedia.txt``).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch

from ..convert.conversations import GenerationSettings
from ..options.defaults import HELD_OUT_CONVERSATIONS
from .answers import agreement, answer_kl, chat_answers, is_correct, load_questions, retention
from .perplexity import _score

__all__ = ["GENRES", "SuiteResult", "genre_texts", "run_suite"]

GENRES = ("LICENSE.txt", "held-out docstrings", "encyclopedic prose")
GENRE_TOKENS = 2048  # the first tokens of each text (window 512, stride 256, as docs/conversion.md)
GENRE_WINDOW = 512


@dataclass
class SuiteResult:
    """Each measure for the model (and, where it has one, the original).

    Attributes
    ----------
    answer_kl : mean KL(original || model), nats per answer token.
    prefix_tokens, identical, token_f1 : ``gqa.evaluation.answers.Agreement`` of the model's greedy answers.
    questions : number of questions in the set.
    correct_original, correct_model : how many each answers right.
    kept : fraction of the original's right answers the model also gets right.
    perplexity : per genre, ``(original, model)``.
    answers : per question, ``(question, original's reply, model's reply)``.
    conversations : held-out conversations scored.
    seconds : wall time of the suite.
    """

    answer_kl: float
    prefix_tokens: float
    identical: float
    token_f1: float
    questions: int
    correct_original: int
    correct_model: int
    kept: float
    perplexity: dict[str, tuple[float, float]] = field(default_factory=dict)
    answers: list[tuple[str, str, str]] = field(default_factory=list)
    conversations: int = 0
    seconds: float = 0.0


def genre_texts() -> dict[str, str]:
    """The prose of each genre in ``GENRES``."""
    from ..convert.calibration import held_out_text
    from .perplexity import default_eval_text

    encyclopedia = resources.files("gqa").joinpath("data", "encyclopedia.txt").read_text(encoding="utf-8")
    return dict(zip(GENRES, (default_eval_text()[0], held_out_text(), encyclopedia), strict=True))


def _perplexity(model: torch.nn.Module, ids: list[int]) -> float:
    nll, _, count = _score(model, torch.tensor(ids), GENRE_WINDOW, GENRE_WINDOW // 2)
    return math.exp(nll / count)


def run_suite(
    model_path: str | Path,
    reference_path: str | Path | None = None,
    *,
    conversations: int = HELD_OUT_CONVERSATIONS,
    settings: GenerationSettings | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> SuiteResult:
    """Judge ``model_path`` against ``reference_path`` (default: the embedded SmolLM2) on the four measures, both in
    float32. The held-out conversations are the reference's own (``gqa.convert.conversations``, made with
    ``settings``, default ``EVALUATION_CONVERSATIONS`` user turns as ``gqa convert`` samples them; read from the
    cache, or generated the first time)."""
    from ..convert.conversations import (
        ANSWER_TOKENS,
        EVALUATION_CONVERSATIONS,
        model_content_hash,
        self_generated_conversations,
    )
    from ..loaders import resolve_model_path
    from ..loaders.model import load_model

    say = log or (lambda line: print(line, file=sys.stderr, flush=True))
    if isinstance(conversations, bool) or not isinstance(conversations, int) or conversations < 1:
        raise ValueError(f"conversations must be a positive int, got {conversations!r}")
    start = time.perf_counter()
    # float32, not load_model's "auto": the reference's conversations are cached by its file's hash alone, so they must
    # not depend on the machine's dtype, and the KL compares the two models' own weights
    model = load_model(model_path, dtype=torch.float32)
    reference = load_model(reference_path, dtype=torch.float32)
    tok = reference.tokenizer
    if model.config.vocab_size != reference.config.vocab_size:
        raise ValueError(f"model and reference vocabularies differ: {model.config.vocab_size} vs "
                         f"{reference.config.vocab_size} tokens")  # fmt: skip
    ref_path = resolve_model_path(None if reference_path is None else Path(reference_path))
    settings = settings or GenerationSettings(count=EVALUATION_CONVERSATIONS)
    chats = self_generated_conversations(reference, tok, model_content_hash(ref_path), settings, progress=progress)
    held = chats.held_out[:conversations]
    if not held:
        raise ValueError("the reference's self-generated conversations have no held-out part")
    say(f"scoring {len(held)} held-out conversations")
    kl = answer_kl(model, reference, held)
    mine = chat_answers(model, tok, [c.prompt_ids for c in held], max_new_tokens=ANSWER_TOKENS, progress=progress,
                        desc="answering held-out turns")  # fmt: skip  # as long as the original's could be
    agree = agreement(mine, [c.answer_ids for c in held])
    questions = load_questions()
    texts = [q.question for q in questions]
    replies = [
        [tok.decode(a) for a in chat_answers(m, tok, texts, progress=progress, desc=f"question set, {who}")]
        for who, m in (("original", reference), ("model", model))
    ]
    right = [[is_correct(r, q.answers) for r, q in zip(rs, questions, strict=True)] for rs in replies]
    perplexity = {}
    for genre, text in genre_texts().items():
        ids = tok.encode(text)[:GENRE_TOKENS]
        with torch.inference_mode():
            perplexity[genre] = (_perplexity(reference, ids), _perplexity(model, ids))
    return SuiteResult(
        answer_kl=kl, prefix_tokens=agree.prefix_tokens, identical=agree.identical, token_f1=agree.token_f1,
        questions=len(questions), correct_original=sum(right[0]), correct_model=sum(right[1]),
        kept=retention(right[0], right[1]), perplexity=perplexity,
        answers=[(q, a, b) for q, a, b in zip(texts, *replies, strict=True)], conversations=len(held),
        seconds=time.perf_counter() - start,
    )  # fmt: skip
