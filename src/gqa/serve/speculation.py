"""Prompt-lookup speculative decoding: draft tokens without a draft model, verified exactly.

A request that copies from its context (summarising, editing or quoting a given text, code) often continues with
tokens it has already seen: when its last 3 tokens (4 for a draft of 2 or more tokens before a draft of it had a
token accepted, and after a wasted one) occurred earlier, the tokens that followed the latest such occurrence are
proposed as a draft (HF's ``prompt_lookup_num_tokens``, vLLM's n-gram proposer). The engine feeds the draft as extra
rows of the request in the same call as every other row; each row's greedy token is what plain decoding would pick
after the tokens before it, so the drafted tokens are accepted while they equal those picks and the first pick that
differs (or the one after the whole draft) comes free: the output is exactly greedy decoding's, 1 to ``k + 1``
tokens per step. Rows are independent in the kernels (a row's result does not depend on the others), so verifying a
draft gives the same logits as decoding the tokens one by one.

A copy with edits (a spelling fixed, a name replaced, a sentence skipped) breaks the 3-token match for the next 3
tokens. Whenever neither lookup finds anything, a request that has had a draft verified looks up its last 2 tokens
near where its copy last stopped (8 tokens before the first draft token it did not write to 32 after) and drafts what
follows them there: the copy resumes after the edit.

When it pays: a draft's rows are not free (2 rows cost ~1.3x a 1-row step, 3 rows ~1.7-1.9x: the weights unpacked
once for them), and proposals shorter than 3 tokens are dropped (or than the draft asked for, when that is shorter).
Where the quantized kernels put the rows in SIMD lanes (``kernels.lane_rows``, AVX-512 VNNI; quantized weights) 4 to
8 rows are one 8-lane pass costing about 1.8-2.1x a 1-row step and 9 to 16 rows one 16-lane pass costing about 3.4x
(SmolLM2, Q4_1, 2 cores), so a request's first draft is a 1-token probe (a miss wastes ~0.3 of a step), then drafts
are up to 7 tokens long, 15 after one of 7 accepted whole, 2 after one with a single token accepted. Elsewhere the
kernels take rows four at a time (on 2 cores 4 rows ~1.7x the 1-row step, 8 rows ~3x: SmolLM2, Q4_1) and drafts are 3
tokens, 7 after a draft accepted whole. A request that drafts in vain pauses its drafts for 2, 4, ... 32 steps, and
only a batch of at most ``MAX_DRAFTING`` decoding requests drafts at all — in a bigger batch the kernels are busy with
every row and an extra row costs about a token's time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from .. import kernels

__all__ = [
    "MAX_DRAFTING",
    "MIN_DRAFT",
    "DraftLengths",
    "DraftState",
    "accepted",
    "draft_lengths",
    "latest_match",
    "nearest_match",
    "propose",
]

NGRAMS = (3,)  # the suffix lengths looked up, longest first (shorter ones match too often to pay)
# ... and before a request's first accepted draft, or after a wasted one, for drafts longer than a PROBE: a wasted
# 8-row draft costs 1.2-1.6 steps, so it needs a longer match while nothing says the request copies (SmolLM2's
# free-form answers 1.04x against 0.99x, copying ones 1.90x against 1.94x, in a replay of the benchmark's requests
# with the passes' measured costs)
COLD_NGRAMS = (4,)
# ... and when neither occurred: the last 2 tokens, looked up near the copy's source (the first draft token the
# request did not write, ``DraftState.source``), from RESYNC[0] tokens before it to RESYNC[1] after; the copy goes
# on there (SmolLM2 fixing a text's spelling 2.18x against 2.00x, its copy-heavy responses 2.00x against 1.89x, the
# others 1.48x against 1.46x, in a replay of the benchmark's requests with the passes' measured costs)
RESYNC_NGRAM = 2
RESYNC = (8, 32)
MAX_DRAFTING = 2  # decoding requests at most in a step whose requests draft
# shorter proposals are dropped (or than a draft asked for with fewer tokens, a probe's 1 or a ``single`` draft's 2:
# min(k, MIN_DRAFT)); keeping them made no difference in the benchmark
MIN_DRAFT = 3


class DraftLengths(NamedTuple):
    """A request's draft lengths: ``first`` for its first draft (0: ``short``), ``short`` after a wasted draft,
    ``long`` after one accepted whole, ``single`` after one with a single token accepted (0: ``short``); ``keep``: a
    draft with ``KEEP_TAKEN`` or more of its tokens accepted, not all, keeps the length (else the next is short)."""

    short: int
    long: int
    keep: bool = False
    first: int = 0
    single: int = 0


LENGTHS = DraftLengths(3, 7)  # 4 and 8 rows with the newest token; 8 rows cost ~3x one on these kernels
# With lane kernels 8 rows (4 to 8) and 16 rows (9 to 16) are one pass each, and a copy that a correction interrupts
# goes on after it (SmolLM2 fixing a text's spelling: 2.17x against 2.07x when a partly accepted draft shortens the
# next, in a replay of the benchmark's requests with the passes' measured costs).
# A request's first draft is a 1-token probe: 2 rows cost ~1.3 steps, so a probe that misses wastes ~0.3 of a step
# where a 7-token cold draft wasted 1.3; one accepted is followed by 7 tokens, then 15; a draft with a single token
# accepted made the next one short instead of keeping 15 (an answer that copies little, SmolLM2 fixing an email's
# grammar: 1.01x against 0.98x; since then 2 tokens, below). In a replay of the benchmark's requests with the
# passes' measured costs: copy-heavy responses 1.89x against 1.90x, the 21-token answers that part from their text
# after a few words 1.03x against 0.95x.
# After a draft with a single token accepted the next has 2 tokens (3 rows: ~1.7 steps where 8 cost 2.3-2.6): the
# email fix 1.05x against 1.01x, copy-heavy responses 1.86x against 1.84x, the free-form ones unchanged (replay, with
# the costs measured on 2026-12-02: 1.34, 1.67, 2.05, 2.35, 3.45 steps for 2, 3, 4, 8, 16 rows).
LANE_LENGTHS = DraftLengths(7, 15, keep=True, first=1, single=2)
KEEP_TAKEN = 2
PROBE = 1  # a draft this short is cheap enough to need only the 3-token match, even cold


def draft_lengths(quantized: bool = True) -> DraftLengths:
    """The draft lengths (``DraftLengths``: first, short, long, whether a draft accepted in part keeps the length, and
    the length after a single accepted token) for this machine's kernels and a model with ``quantized`` weights (the
    lanes take quantized products only)."""
    return LANE_LENGTHS if quantized and 0 < kernels.lane_rows() <= MIN_DRAFT + 1 else LENGTHS


def propose(tokens: list[int], k: int, ngrams: tuple[int, ...] = NGRAMS) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of ``tokens``' last ``n`` tokens (the longest
    ``n`` of ``ngrams`` that occurred); ``[]`` when none did."""
    start = latest_match(tokens, ngrams)
    return tokens[start : start + k] if start is not None and k > 0 else []


def latest_match(tokens: list[int], ngrams: tuple[int, ...] = NGRAMS) -> int | None:
    """Where the tokens after the latest earlier occurrence of ``tokens``' last ``n`` tokens begin (the longest ``n``
    of ``ngrams`` that occurred), or None."""
    for n in ngrams:
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        first = suffix[0]
        # the latest start i < len - n with tokens[i:i + n] == suffix, searched backwards
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i] == first and tokens[i : i + n] == suffix:
                return i + n
    return None


def nearest_match(tokens: list[int], n: int, source: int, span: tuple[int, int] = RESYNC) -> int | None:
    """Where the tokens after the occurrence of ``tokens``' last ``n`` tokens nearest to ``source`` begin, among the
    earlier occurrences starting ``span[0]`` tokens before ``source`` to ``span[1]`` after it (the nearer of two
    equally near ones: the earlier); None when there is none."""
    if len(tokens) <= n:
        return None
    suffix = tokens[-n:]
    best = None
    for i in range(max(0, source - span[0]), min(len(tokens) - n - 1, source + span[1]) + 1):
        if tokens[i : i + n] == suffix and (best is None or abs(i - source) < abs(best - source)):
            best = i
    return None if best is None else best + n


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
    whether the last draft had a token accepted, where the last draft came from and where its copy stopped."""

    length: int = 0  # 0: the first one (``DraftLengths.first``, else short)
    misses: int = 0
    pause: int = 0
    hot: bool = False
    start: int | None = None  # the position in the request's tokens that the draft proposed last began at
    source: int | None = None  # that of the first draft token the request did not write (its last verified draft)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens to draft after ``tokens`` (``[]``: none): those after the latest earlier occurrence of
        the last 3 tokens (4 when cold and ``k`` is more than a probe: ``ngrams``), else after the last 2 near the
        copy's ``source``."""
        start = latest_match(tokens, self.ngrams(k))
        if start is None and self.source is not None:
            start = nearest_match(tokens, RESYNC_NGRAM, self.source)
        self.start = start
        return tokens[start : start + k] if start is not None and k > 0 else []

    def ngrams(self, k: int | None = None) -> tuple[int, ...]:
        """The suffix lengths to look up (``propose``) for a draft of ``k`` tokens (None: any length): 3 tokens after
        an accepted draft or for a probe (``k <= PROBE``), else 4."""
        return NGRAMS if self.hot or (k is not None and k <= PROBE) else COLD_NGRAMS

    def wanted(self, speculate: int, lengths: DraftLengths = LENGTHS) -> int:
        """The draft length to ask for this step (0: none), at most ``speculate``; ``lengths``: ``draft_lengths``."""
        if self.pause:
            self.pause -= 1
            return 0
        return min(self.current(lengths), speculate)

    def current(self, lengths: DraftLengths) -> int:
        """The length the next draft takes: the one set by the last verified draft, or ``lengths``' first."""
        return self.length or lengths.first or lengths.short

    def verified(self, drafted: int, taken: int, lengths: DraftLengths = LENGTHS) -> None:
        """A draft of ``drafted`` tokens had its first ``taken`` accepted: a whole one lengthens the next (to short
        after a draft shorter than that, else long), a wasted one shortens it and pauses drafting (twice as long as
        the last pause, up to 32 steps), one accepted in part keeps the length or shortens it (``lengths.keep``: kept
        when ``KEEP_TAKEN`` or more were accepted; ``lengths.single`` after a single one)."""
        self.hot = taken > 0
        if self.start is not None:
            self.source = self.start + taken
        if taken == drafted:  # a probe's (or another draft shorter than short) next is short
            self.length, self.misses = (lengths.long if drafted >= lengths.short else lengths.short), 0
        elif taken == 0:
            self.length, self.misses = lengths.short, self.misses + 1
            self.pause = 2 ** min(self.misses, 5)
        else:
            kept = lengths.keep and taken >= KEEP_TAKEN
            after = lengths.single if taken == 1 and lengths.single else lengths.short
            self.length, self.misses = (self.current(lengths) if kept else after), 0
