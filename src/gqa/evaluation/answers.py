"""Judging a chat model by its answers, against the model it came from.

Three measures, each of a converted model against its original (``gqa eval MODEL --suite``):

- ``answer_kl``: mean ``KL(original || model)`` of the next-token distributions on the answer tokens of held-out
  self-generated conversations (``gqa.convert.conversations``), both models reading the original's own answer;
- ``agreement``: the model's greedy answers to the held-out user turns against the original's, as the length of
  their common prefix in tokens and as token F1 (multiset overlap of the two answers' tokens);
- the question set: ``QUESTIONS_FILE``, short factual questions with known answers written for the project;
  ``is_correct`` counts a reply as right when it contains an expected answer as whole words, case-insensitively,
  and ``retention`` is the fraction of the questions the original gets right that the model also gets right.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from ..convert.conversations import Conversation
    from ..loaders.tokenizer import Tokenizer
    from ..models import CausalLM

__all__ = [
    "QUESTIONS_FILE",
    "Agreement",
    "Question",
    "agreement",
    "answer_kl",
    "chat_answers",
    "is_correct",
    "load_questions",
    "retention",
]

QUESTIONS_FILE = "questions.json"  # in the package folder gqa/data
QUESTION_ANSWER_TOKENS = 48  # a short factual answer is in its first sentence


@dataclass(frozen=True)
class Question:
    question: str
    answers: tuple[str, ...]


@dataclass(frozen=True)
class Agreement:
    """Greedy answers of a model against the original's, averaged over the user turns.

    Attributes
    ----------
    prefix_tokens : mean length of the common prefix, in tokens.
    identical : fraction of answers equal to the original's token for token.
    token_f1 : mean F1 of the two answers' token multisets (1: the same tokens, in any order).
    """

    prefix_tokens: float
    identical: float
    token_f1: float


def load_questions() -> list[Question]:
    """The project's question set (at least 50 questions, each with one or more accepted answers)."""
    data = json.loads(resources.files("gqa").joinpath("data", QUESTIONS_FILE).read_text(encoding="utf-8"))
    return [Question(q["question"], tuple(q["answers"])) for q in data["questions"]]


def is_correct(reply: str, answers: Sequence[str]) -> bool:
    """Whether ``reply`` contains one of ``answers`` as whole words (not inside a longer word), ignoring case."""
    return any(re.search(rf"(?<!\w){re.escape(a)}(?!\w)", reply, flags=re.IGNORECASE) for a in answers)


def retention(original: Sequence[bool], model: Sequence[bool]) -> float:
    """The fraction of the questions ``original`` gets right that ``model`` gets right too (``nan`` if none)."""
    if len(original) != len(model):
        raise ValueError(f"need one verdict per question from both, got {len(original)} and {len(model)}")
    kept = [m for o, m in zip(original, model, strict=True) if o]
    return sum(kept) / len(kept) if kept else float("nan")


def chat_answers(
    model: CausalLM,
    tok: Tokenizer,
    prompts: Sequence[str] | Sequence[list[int]],
    *,
    max_new_tokens: int = QUESTION_ANSWER_TOKENS,
    batch_size: int = 64,
    progress: bool = False,
    desc: str = "answering",
) -> list[list[int]]:
    """Greedy answers (token ids, end-of-turn token included when it came) to user turns: strings are rendered with
    the chat template; token lists are used as they are (e.g. ``Conversation.prompt_ids``). Generated as the
    self-generated conversations are (``gqa.convert.bulk_generation.generate_many``: the serving engine where it
    takes the model), so the original model answers its held-out turns exactly as it wrote them."""
    from ..convert.bulk_generation import generate_many
    from ..convert.conversations import end_of_turn_ids

    chats = [tok.apply_chat(p) if isinstance(p, str) else list(p) for p in prompts]
    from tqdm.auto import tqdm

    with tqdm(total=len(chats), desc=desc, unit="answer", disable=not progress, dynamic_ncols=True) as bar:
        return generate_many(
            model, chats, max_new_tokens=max_new_tokens, end_ids=end_of_turn_ids(tok, model),
            batch_size=batch_size, bar=bar,
        )  # fmt: skip


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _token_f1(a: Sequence[int], b: Sequence[int]) -> float:
    if not a and not b:
        return 1.0
    common = sum((Counter(a) & Counter(b)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(a), common / len(b)
    return 2 * precision * recall / (precision + recall)


def agreement(answers: Sequence[Sequence[int]], references: Sequence[Sequence[int]]) -> Agreement:
    """How closely ``answers`` (token ids) follow ``references``, the original's answers to the same turns."""
    if len(answers) != len(references) or not answers:
        raise ValueError(f"need as many answers as references (at least one), got {len(answers)}, {len(references)}")
    n = len(answers)
    pairs = list(zip(answers, references, strict=True))
    return Agreement(
        sum(_common_prefix(a, r) for a, r in pairs) / n,
        sum(list(a) == list(r) for a, r in pairs) / n,
        sum(_token_f1(a, r) for a, r in pairs) / n,
    )


@torch.inference_mode()
def answer_kl(model: nn.Module, reference: nn.Module, conversations: Sequence[Conversation]) -> float:
    """Mean ``KL(reference || model)`` in nats over the positions that predict an answer token, both models reading
    each whole conversation (one forward pass each, float64 softmax)."""
    total, count = 0.0, 0
    device = next(model.parameters()).device
    for c in conversations:
        ids = torch.tensor([c.ids], device=device)
        first, last = len(c.prompt_ids) - 1, len(c.ids) - 1  # positions predicting answer tokens
        if last <= first:
            continue
        log_q = model(ids)[0, first:last].double().log_softmax(-1)
        log_p = reference(ids.to(next(reference.parameters()).device))[0, first:last].double().log_softmax(-1)
        total += F.kl_div(log_q, log_p.to(log_q.device), log_target=True, reduction="sum").item()
        count += last - first
    if count == 0:
        raise ValueError("the conversations have no answer tokens")
    return total / count
