"""Per-request sampling settings, with OpenAI's names."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..decoding.sampling import check_sampling

__all__ = ["SEED_RANGE", "SamplingParams"]

# The seeds torch.Generator.manual_seed takes: [-2**63, 2**64) (a negative seed is taken modulo 2**64)
SEED_RANGE = (-(2**63), 2**64)


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded: greedy when ``temperature == 0``, else sampled from a generator seeded with
    ``seed`` (fresh randomness without one); ``stop``: strings that end the output (not included in it);
    ``max_tokens``: new tokens at most; ``ignore_eos``: go on past the end-of-sequence token."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    seed: int | None = None
    ignore_eos: bool = False

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
        check_sampling(float(self.temperature), self.top_k, self.top_p)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
