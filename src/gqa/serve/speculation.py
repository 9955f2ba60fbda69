"""Prompt-lookup speculative decoding: draft tokens without a draft model, verified exactly.

A request that copies from its context (summarising, editing or quoting a given text, code) often continues with
tokens it has already seen: when its last 3 tokens (4 before a draft of it had a token accepted, and after a wasted
one) occurred earlier, the tokens that followed the latest such occurrence are proposed as a draft (HF's
``prompt_lookup_num_tokens``, vLLM's n-gram proposer). The engine feeds the draft as extra rows of the request in
the same call as every other row; each row's greedy token is what plain decoding would pick after the tokens before
it, so the drafted tokens are accepted while they equal those picks and the first pick that differs (or the one
after the whole draft) comes free: the output is exactly greedy decoding's, 1 to ``k + 1`` tokens per step. Rows are
independent in the kernels (a row's result does not depend on the others), so verifying a draft gives the same
logits as decoding the tokens one by one.

When it pays: a draft's rows are not free, and 2 or 3 rows cost more than 4 (they run as separate GEMVs), so
proposals shorter than 3 tokens are dropped. Where the quantized kernels put the rows in SIMD lanes
(``kernels.lane_rows``, AVX-512 VNNI; quantized weights) 4 to 8 rows are one 8-lane pass costing about 2.5x a 1-row
step and 9 to 16 rows one 16-lane pass costing about 1.3-1.45x the 8-lane one (the same instructions, twice as wide;
more rows of lm_head), so drafts are up to 7 tokens long, 15 after a draft accepted whole. Elsewhere the kernels
take rows four at a time (on 2 cores 4 rows ~1.7x the 1-row step, 8 rows ~3x: SmolLM2, Q4_1) and drafts are 3
tokens, 7 after a draft accepted whole. A request that drafts in vain pauses its drafts for 2, 4, ... 32 steps, and
only a batch of at most ``MAX_DRAFTING`` decoding requests drafts at all — in a bigger batch the kernels are busy
with every row and an extra row costs about a token's time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from .. import kernels

__all__ = ["MAX_DRAFTING", "MIN_DRAFT", "DraftLengths", "DraftState", "accepted", "draft_lengths", "propose"]

NGRAMS = (3,)  # the suffix lengths looked up, longest first (shorter ones match too often to pay)
# ... and before a request's first accepted draft, or after a wasted one: a wasted draft costs 1.2-1.6 steps, so a
# draft needs a longer match while nothing says the request copies (SmolLM2's free-form answers 1.04x against 0.99x,
# copying ones 1.90x against 1.94x, in a replay of the benchmark's requests with the passes' measured costs)
COLD_NGRAMS = (4,)
MAX_DRAFTING = 2  # decoding requests at most in a step whose requests draft
MIN_DRAFT = 3  # shorter proposals are dropped: 2 or 3 rows cost more than 4


class DraftLengths(NamedTuple):
    """A request's draft lengths: ``short`` at first and after a wasted draft, ``long`` after one accepted whole;
    ``keep``: a draft accepted in part keeps the length (else the next is short)."""

    short: int
    long: int
    keep: bool = False


LENGTHS = DraftLengths(3, 7)  # 4 and 8 rows with the newest token; 8 rows cost ~3x one on these kernels
# With lane kernels 8 rows (4 to 8) and 16 rows (9 to 16) are one pass each, and a copy that a correction interrupts
# goes on after it (SmolLM2 fixing a text's spelling: 2.17x against 2.07x when a partly accepted draft shortens the
# next, in a replay of the benchmark's requests with the passes' measured costs).
LANE_LENGTHS = DraftLengths(7, 15, keep=True)


def draft_lengths(quantized: bool = True) -> DraftLengths:
    """The draft lengths (short, long, and whether a draft accepted in part keeps the length) for this machine's
    kernels and a model with ``quantized`` weights (the lanes take quantized products only)."""
    return LANE_LENGTHS if quantized and 0 < kernels.lane_rows() <= MIN_DRAFT + 1 else LENGTHS


def propose(tokens: list[int], k: int, ngrams: tuple[int, ...] = NGRAMS) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of ``tokens``' last ``n`` tokens (the longest
    ``n`` of ``ngrams`` that occurred); ``[]`` when none did."""
    if k < 1:
        return []
    for n in ngrams:
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        first = suffix[0]
        # the latest start i < len - n with tokens[i:i + n] == suffix, searched backwards
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i] == first and tokens[i : i + n] == suffix:
                return tokens[i + n : i + n + k]
    return []


def accepted(draft: list[int], picks: list[int]) -> list[int]:
    """The tokens a step adds for a request fed its newest token and ``draft``: ``picks[i]`` is the greedy token after
    row ``i`` (``len(draft) + 1`` rows). Draft tokens count while each equals the pick before it; then the next pick."""
    n = 0
    while n < len(draft) and draft[n] == picks[n]:
        n += 1
    return [*draft[:n], picks[n]]


@dataclass
class DraftState:
    """One request's drafting: the next draft's length, drafts in a row with nothing accepted, steps left to pause,
    whether the last draft had a token accepted."""

    length: int = 0  # 0: the short one
    misses: int = 0
    pause: int = 0
    hot: bool = False

    def ngrams(self) -> tuple[int, ...]:
        """The suffix lengths to look up (``propose``): 3 tokens after an accepted draft, else 4."""
        return NGRAMS if self.hot else COLD_NGRAMS

    def wanted(self, speculate: int, lengths: DraftLengths = LENGTHS) -> int:
        """The draft length to ask for this step (0: none), at most ``speculate``; ``lengths``: ``draft_lengths``."""
        if self.pause:
            self.pause -= 1
            return 0
        return min(self.length or lengths.short, speculate)

    def verified(self, drafted: int, taken: int, lengths: DraftLengths = LENGTHS) -> None:
        """A draft of ``drafted`` tokens had its first ``taken`` accepted: a whole one lengthens the next, a wasted
        one shortens it and pauses drafting (twice as long as the last pause, up to 32 steps), one accepted in part
        keeps the length or shortens it (``lengths.keep``)."""
        self.hot = taken > 0
        if taken == drafted:
            self.length, self.misses = lengths.long, 0
        elif taken == 0:
            self.length, self.misses = lengths.short, self.misses + 1
            self.pause = 2 ** min(self.misses, 5)
        else:
            self.length, self.misses = (self.length if lengths.keep else lengths.short), 0
