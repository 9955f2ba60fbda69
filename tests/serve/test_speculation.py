"""Prompt lookup's proposals and verification, against brute force: the draft follows the latest earlier occurrence
of the last three tokens, else that of the last two nearest to where the request's copy left off; verification keeps
the leading draft tokens equal to the greedy picks, then one pick; a request's drafting pauses after drafts wasted and
lengthens after drafts wholly accepted."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gqa import kernels
from gqa.serve.speculation import RESYNC, DraftLengths, DraftState, accepted, draft_lengths, nearest_match, propose


def brute_propose(tokens: list[int], k: int, n: int = 3) -> list[int]:
    starts = [i for i in range(len(tokens) - n) if tokens[i : i + n] == tokens[len(tokens) - n :]]
    return tokens[max(starts) + n :][:k] if starts and k > 0 else []


@given(st.lists(st.integers(0, 3), max_size=40), st.integers(0, 9))
def test_propose_is_the_latest_earlier_occurrence(tokens, k):
    assert propose(tokens, k) == brute_propose(tokens, k)


def brute_nearest(tokens: list[int], n: int, source: int) -> int | None:
    before, after = RESYNC
    starts = [i for i in range(len(tokens) - n) if tokens[i : i + n] == tokens[len(tokens) - n :]]
    starts = [i for i in starts if source - before <= i <= source + after]
    return min(starts, key=lambda i: (abs(i - source), i)) + n if starts else None


@given(st.lists(st.integers(0, 2), max_size=60), st.integers(1, 3), st.integers(0, 70))
def test_nearest_match_is_the_occurrence_nearest_the_source_within_its_span(tokens, n, source):
    assert nearest_match(tokens, n, source) == brute_nearest(tokens, n, source)


def test_propose_examples():
    assert propose([1, 2, 3, 9, 8, 1, 2, 3], 3) == [9, 8, 1]
    assert propose([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3], 2) == [5, 1]  # the latest occurrence wins
    assert propose([1, 2, 3, 4], 3) == [] and propose([7, 7, 7, 7], 5) == [7]


@given(st.lists(st.integers(0, 2), min_size=1, max_size=8), st.data())
def test_accepted_is_the_matching_prefix_then_one_pick(draft, data):
    picks = data.draw(st.lists(st.integers(0, 2), min_size=len(draft) + 1, max_size=len(draft) + 1))
    got = accepted(draft, picks)
    n = len(got) - 1
    assert got[:n] == draft[:n] == picks[:n] and got[n] == picks[n]
    assert n == len(draft) or draft[n] != picks[n]


@pytest.mark.parametrize(
    ("lane_rows", "quantized", "lengths"),
    [(0, True, (3, 7, False, 0, 0)), (4, True, (7, 15, True, 1, 2)), (4, False, (3, 7, False, 0, 0))],
)
def test_a_request_pauses_after_wasted_drafts_and_lengthens_after_whole_ones(
    lane_rows, quantized, lengths, monkeypatch
):
    """GEMV kernels (or float weights): drafts of 3, 7 after a whole one, 3 again after one accepted in part; lane
    kernels on quantized weights (4 to 8 rows in one 8-lane pass, 9 to 16 in one 16-lane pass): a 1-token probe
    first, 7 after it, 15 after a whole one of 7, still 15 after one with 2 or more tokens accepted, 2 after one with
    a single token accepted (then 7 after those 2 accepted), 7 after a wasted one."""
    monkeypatch.setattr(kernels, "lane_rows", lambda: lane_rows)
    lengths = DraftLengths(*lengths)
    assert draft_lengths(quantized) == lengths
    short, long, keep, first, single = lengths
    s = DraftState()
    assert s.wanted(16, lengths) == (first or short) and s.wanted(2, lengths) == min(2, first or short)
    if first:
        s.verified(first, first, lengths)  # a probe accepted: a short draft next
        assert s.wanted(16, lengths) == short
        s.verified(2, 2, lengths)  # so does any draft shorter than short, accepted whole
        assert s.wanted(16, lengths) == short
    s.verified(short, short, lengths)
    assert s.wanted(16, lengths) == long and s.wanted(7, lengths) == 7
    s.verified(long, 2, lengths)  # accepted in part
    assert s.wanted(16, lengths) == (long if keep else short)
    s.verified(long, 1, lengths)  # a single token accepted: the next is single (or short)
    assert s.wanted(16, lengths) == (single or short)
    if single:
        s.verified(single, 1, lengths)  # and again
        assert s.wanted(16, lengths) == single
        s.verified(single, single, lengths)  # accepted whole: shorter than short, so short next
        assert s.wanted(16, lengths) == short
    s.verified(7, 0, lengths)  # wasted: pause 2 steps
    assert [s.wanted(16, lengths) for _ in range(3)] == [0, 0, short]
    s.verified(3, 0, lengths)  # wasted again: pause 4
    assert [s.wanted(16, lengths) for _ in range(5)] == [0, 0, 0, 0, short]
    s.verified(3, 1, lengths)  # a partly accepted draft ends the streak
    assert s.misses == 0 and s.wanted(16, lengths) == (single or short)
    for _ in range(10):
        s.verified(3, 0)
    assert s.misses == 10 and s.pause == 32  # the pause stops growing at 32 steps


def test_drafts_need_a_four_token_match_until_one_had_a_token_accepted_unless_they_are_probes():
    """A cold request (no draft yet, or the last one wasted) looks up its last 4 tokens for a draft of 2 or more
    tokens, its last 3 for a 1-token probe; after a draft with a token accepted, its last 3: ``propose`` then finds a
    continuation that a 4-token lookup does not."""
    tokens = [1, 2, 3, 4, 5, 9, 3, 4, 5]  # the last 3 tokens occurred before, the last 4 did not
    s = DraftState()
    assert s.ngrams() == s.ngrams(2) == (4,) and propose(tokens, 3, s.ngrams()) == []
    assert s.propose(tokens, 2) == [] and s.ngrams(1) == (3,) and s.propose(tokens, 1) == [9]
    s.verified(7, 2)
    assert s.ngrams() == (3,) and propose(tokens, 3, s.ngrams()) == [9, 3, 4] and s.propose(tokens, 3) == [9, 3, 4]
    s.verified(7, 0)
    assert s.ngrams() == s.ngrams(7) == (4,) and s.ngrams(1) == (3,)


def test_a_copy_interrupted_by_an_edit_resumes_near_where_it_stopped():
    """A request copying its prompt replaces one token: the 3-token lookup fails for the next 3 tokens, but its last 2
    tokens occur near the first draft token it did not write, and the draft goes on from there (not from an
    occurrence of them far away, nor without a verified draft to say where the copy was)."""
    far, near, later = [9, 11, 50, 51, 52], [5, 1, 2, 3, 4, 6, 7, 8, 9, 11, 12, 13, 14, 15], [16, 9, 11, 77]
    prompt = far + [0] * 40 + near + later  # 9, 11 three times: far before the copy, in it, and after it (the latest)
    s = DraftState()
    tokens = [*prompt, 1, 2, 3, 4]
    assert s.propose(tokens, 7) == [6, 7, 8, 9, 11, 12, 13]  # the 4 tokens before occurred: a cold draft
    s.verified(7, 2)  # 6 and 7 accepted, then 80 instead of 8
    assert s.source == prompt.index(8)
    tokens += [6, 7, 80, 9, 11]
    assert propose(tokens, 3, s.ngrams()) == [] and propose(tokens, 3, (2,)) == [77, 1, 2]
    assert s.propose(tokens, 3) == [12, 13, 14]  # the occurrence nearest the copy's source
    assert DraftState().propose(tokens, 3) == []  # no copy to resume: no draft
