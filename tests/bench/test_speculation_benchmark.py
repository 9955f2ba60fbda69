"""``benchmarks/speculation.py``: the share of a response copied from its prompt, which decides what counts as a
copy-heavy response, and a short run end to end (the table, the groups, exit 0 when every output is identical)."""

from __future__ import annotations

import sys

import pytest
from helpers.scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("speculation")


@pytest.mark.parametrize(
    ("tokens", "share"),
    [
        ([3, 4, 5, 6], 1.0),  # a run of 4 from the prompt
        ([9, 3, 4, 5, 6, 9], 4 / 6),  # inside, with a token of its own on each side
        ([3, 4, 5, 9, 4, 5, 6, 7], 4 / 8),  # 3 of a run do not count; the second run does
        ([1, 2, 3, 4, 5, 6, 7, 8], 1.0),  # overlapping runs count each token once
        ([6, 5, 4, 3], 0.0),  # the prompt's tokens backwards
        ([], 0.0),
    ],
)
def test_copied_counts_the_tokens_inside_runs_of_four_from_the_prompt(bench, tokens, share):
    assert bench.copied([1, 2, 3, 4, 5, 6, 7, 8], tokens) == pytest.approx(share)


def test_a_short_run_prints_the_table_and_the_groups(bench, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["speculation.py", "--rounds", "1", "--max-tokens", "24"])
    assert bench.main() == 0  # every drafted output identical to plain greedy
    out = capsys.readouterr().out
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in out.splitlines() if line.startswith("| ")}
    rows.pop("request")
    assert set(rows) == {*bench.COPYING, *bench.FREE} and all(r[-1].strip() == "True |" for r in rows.values())
    taken, drafted = map(int, rows["spelling"][7].split("/"))
    assert 0 < taken <= drafted  # drafts were verified and accepted: the identical outputs were not all plain steps
    for group in ("copy-heavy responses (>= 50% copied)", "asked to copy", "the others"):
        assert f"{group}: geometric mean ratio" in out
