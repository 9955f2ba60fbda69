"""A request's life in the serving engine: its state, what it holds while it runs, and what a step hands back.

WAITING --admitted--> PREFILL --prompt read--> DECODE --EOS / stop / max_tokens / abort / error--> FINISHED
   ^                     |                       |
   +------ preempted ----+-----------------------+        (its blocks freed; recomputed when admitted again)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .speculation import DraftState

if TYPE_CHECKING:
    from .blocks import BlockTable
    from .detokenizer import TextStream
    from .sampling import SamplingParams
    from .structured import GrammarState

__all__ = ["EngineError", "Request", "RequestOutput", "RequestState", "TokenLogprob"]

# A new token's log-probability: (token id, logprob, ((id, logprob) of the most likely tokens, most likely first))
TokenLogprob = tuple[int, float, tuple[tuple[int, float], ...]]


class EngineError(ValueError):
    """A request the engine cannot take (too long for the context or the cache, bad token ids). ``param``: the
    request field at fault where the engine knows it (``logit_bias``, ``stop_token_ids``), else the API's prompt
    field is named."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class RequestState(enum.Enum):
    WAITING = "waiting"  # queued (new, or preempted): holds no blocks
    PREFILL = "prefill"  # admitted: its prompt (and, after a preemption, its output so far) is being read
    DECODE = "decode"  # read to the end: each step feeds its newest token and samples the next
    FINISHED = "finished"


@dataclass
class Request:
    """One request inside the engine. ``tokens`` is the prompt and the output so far (the last one not yet fed while
    decoding); ``computed`` counts the leading tokens whose K/V are in the pool."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    tokens: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    state: RequestState = RequestState.WAITING
    table: BlockTable | None = None
    computed: int = 0
    generator: Any = None  # the request's torch.Generator when it samples
    text: TextStream | None = None
    finish_reason: str | None = None
    preemptions: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per output token, when params.logprobs is set
    logprobs_sent: int = 0  # how many of them earlier outputs carried
    grammar: GrammarState | None = None  # where the output is in its grammar, when params.structured is set
    draft: list[int] = field(default_factory=list)  # tokens proposed after the newest one, verified this step
    drafting: DraftState = field(default_factory=DraftState)  # how long its next draft is, or whether it pauses


@dataclass
class RequestOutput:
    """What one step produced for one request: its new token ids and text, and whether it is done (and why:
    ``"stop"`` — an end-of-sequence token or a stop string, ``"length"`` — ``max_tokens``, ``"abort"``,
    ``"error"``)."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None  # for the new tokens (an end-of-sequence token has none)
