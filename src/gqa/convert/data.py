"""What calibration and healing read: self-generated conversations mixed with prose, or prose alone.

A chat model's source (one with a chat template) is calibrated and healed by default on a mix of the conversations it
wrote itself (``gqa.convert.conversations``, training split only) and the built-in standard-library docstrings
(``gqa.convert.calibration``); a model without a chat template, or a conversion given its own texts, reads prose.
The shares are the measured defaults of docs/conversion.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .calibration import default_calibration_text, default_heal_text
from .conversations import Conversation, chat_stream

if TYPE_CHECKING:
    from ..loaders.tokenizer import Tokenizer

__all__ = [
    "ANSWER_WEIGHT",
    "CALIBRATION_PROSE_TOKENS",
    "HEAL_PROSE_SHARE",
    "HealData",
    "calibration_ids",
    "heal_data",
]

CALIBRATION_PROSE_TOKENS = 12_000  # of the default calibration text (docstrings), after the conversations
HEAL_PROSE_SHARE = 0.25  # of the healing windows, drawn from the docstrings; the rest start at a conversation
ANSWER_WEIGHT = 2.0  # loss weight of a prediction of an answer token, against 1 for the prompt's and prose's


@dataclass(frozen=True)
class HealData:
    """Healing's input: token ids ``(N,)``, each position's loss weight ``(N,)`` (``None``: all 1), and where
    windows may begin (``None``: every ``seq_len`` tokens)."""

    ids: list[int]
    weights: list[float] | None = None
    starts: list[int] | None = None


def calibration_ids(
    tok: Tokenizer,
    conversations: Sequence[Conversation],
    conversation_tokens: int | None = None,
    prose_tokens: int = CALIBRATION_PROSE_TOKENS,
) -> list[int]:
    """Calibration token ids: the conversations (whole ones, until ``conversation_tokens`` are reached; ``None``:
    all), then ``prose_tokens`` of the default calibration text."""
    ids: list[int] = []
    for c in conversations:
        if conversation_tokens is not None and len(ids) >= conversation_tokens:
            break
        ids += c.ids
    if prose_tokens > 0:
        ids += tok.encode(default_calibration_text())[:prose_tokens]
    return ids


def heal_data(
    tok: Tokenizer,
    conversations: Sequence[Conversation],
    seq_len: int,
    prose_share: float = HEAL_PROSE_SHARE,
    answer_weight: float = ANSWER_WEIGHT,
) -> HealData:
    """The conversations end to end (answer tokens weighted ``answer_weight``, windows starting at each one), then
    enough of the default heal text (docstrings, weight 1, non-overlapping windows) that ``prose_share`` of the
    windows are prose."""
    if not 0 <= prose_share < 1:
        raise ValueError(f"prose_share must be in [0, 1), got {prose_share}")
    ids, weights, starts = chat_stream(conversations, answer_weight)
    prose_windows = round(len(starts) * prose_share / (1 - prose_share))
    if prose_windows:
        prose = tok.encode(default_heal_text())[: prose_windows * seq_len]
        offset = len(ids)
        ids += prose
        weights += [1.0] * len(prose)
        starts += range(offset, offset + len(prose) - seq_len + 1, seq_len)
    return HealData(ids, weights, starts)
