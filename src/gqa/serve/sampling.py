"""Per-request sampling settings, with OpenAI's names."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ..decoding.sampling import SEED_RANGE, check_sampling
from .structured import StructuredOutput

__all__ = ["MAX_LOGPROBS", "SEED_RANGE", "SamplingParams"]

MAX_LOGPROBS = 20  # the most alternatives a token's logprobs list (OpenAI's top_logprobs limit)


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded: greedy when ``temperature == 0``, else sampled from a generator seeded with
    ``seed`` (fresh randomness without one); ``stop``: strings that end the output (not included in it);
    ``max_tokens``: new tokens at most; ``ignore_eos``: go on past the end-of-sequence token. Sampling keeps the
    tokens at least ``min_p`` times as likely as the likeliest (vLLM's and llama.cpp's min-p; 0: off), then the
    ``top_k`` most likely, then the nucleus of ``top_p`` (``decoding.sampling.sample_next``).

    Logit adjustments before sampling (or the greedy choice), OpenAI's and vLLM's: ``frequency_penalty`` and
    ``presence_penalty`` (in [-2, 2]) subtract ``count * frequency + (count > 0) * presence`` from each token's logit,
    counting the tokens generated so far; ``repetition_penalty`` (> 0, HF's and vLLM's) divides the positive logits
    and multiplies the negative ones of every token in the prompt or the output; ``logit_bias`` adds a bias in
    [-100, 100] to the logits of the token ids it names.

    ``logprobs``: report each new token's log-probability and the ``logprobs`` most likely tokens' (0-20; ``None``:
    none) — the log-softmax of the logits the token was chosen from: after the penalties and bias, divided by the
    temperature when sampling (before top-k/top-p cut the distribution); tokens a grammar excludes are not listed.

    ``min_tokens``: the end-of-sequence and ``stop_token_ids`` tokens are not chosen before this many new tokens
    (vLLM's); ``stop_token_ids``: more tokens that end the output (kept in the token ids, not in the text; also with
    ``ignore_eos``); ``structured``: the output held to a JSON schema, a regex, ... (``StructuredOutput``; the end of
    the grammar ends the response)."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    seed: int | None = None
    ignore_eos: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    logprobs: int | None = None
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]
        ):
            raise ValueError(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
        if self.top_p is not None and self.top_p >= 1.0:
            object.__setattr__(self, "top_p", None)  # 1.0 keeps every token
        if self.min_p is not None and self.min_p <= 0.0:
            object.__setattr__(self, "min_p", None)  # 0 keeps every token
        check_sampling(float(self.temperature), self.top_k, self.top_p, self.min_p)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        p = self.repetition_penalty
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (math.isfinite(p) and p > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {p!r}")
        bias = tuple(dict(self.logit_bias).items()) if isinstance(self.logit_bias, dict) else tuple(self.logit_bias)
        for pair in bias:
            token, value = pair if isinstance(pair, tuple) and len(pair) == 2 else (None, None)
            number = isinstance(value, (int, float)) and not isinstance(value, bool) and -100 <= value <= 100
            if not (isinstance(token, int) and not isinstance(token, bool) and token >= 0 and number):
                raise ValueError(f"logit_bias must map token ids >= 0 to numbers in [-100, 100], got {pair!r}")
        object.__setattr__(self, "logit_bias", bias)
        n = self.logprobs
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] (or None), got {n!r}")
        m = self.min_tokens
        if isinstance(m, bool) or not isinstance(m, int) or not 0 <= m <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {m!r}")
        ids = tuple(self.stop_token_ids)
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", ids)
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError(f"structured must be a StructuredOutput, got {type(self.structured).__name__}")

    def for_choice(self, index: int) -> SamplingParams:
        """The settings of answer ``index`` of several to one prompt (``n``): a given seed advanced by ``index`` (as
        vLLM), so seeded answers differ and each is reproducible."""
        if self.seed is None or index == 0:
            return self
        seed = self.seed + index
        return replace(self, seed=seed if seed < SEED_RANGE[1] else seed - 2**64)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalizes(self) -> bool:
        """Whether a penalty or a bias changes the logits."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)  # fmt: skip

    @property
    def adjusts_logits(self) -> bool:
        """Whether a penalty, a bias, ``min_tokens`` or a grammar changes the logits before the choice (then no
        kernel's argmax is the token)."""
        return self.penalizes or bool(self.min_tokens) or self.structured is not None
