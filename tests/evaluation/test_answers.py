"""Judging a model by its answers (``gqa.evaluation.answers``, ``gqa.evaluation.suite``, ``gqa eval --suite``): the
question set is scored
correctly on known strings, agreement and KL are right on known inputs (KL of a model with itself is 0), and the
suite runs end to end on tiny chat models."""

from __future__ import annotations

import functools
import json

import pytest
import torch
import torch.nn.functional as F
from helpers.checkpoints import chat_dir

import gqa
from gqa.cli import main as cli
from gqa.convert import conversations as conv
from gqa.convert import convert
from gqa.convert.conversations import Conversation
from gqa.evaluation.answers import agreement, answer_kl, is_correct, load_questions, retention


@pytest.mark.parametrize(
    ("reply", "answers", "right"),
    [
        ("The capital of France is Paris.", ["Paris"], True),
        ("paris, of course", ["Paris"], True),
        ("The Parisian suburbs are large.", ["Paris"], False),  # inside a longer word
        ("The capital of France is London.", ["Paris"], False),
        ("Water is H2O.", ["H2O", "H₂O"], True),
        ("It is H₂O!", ["H2O", "H₂O"], True),
        ("A spider has 8 legs.", ["eight", "8"], True),
        ("A spider has 18 legs.", ["eight", "8"], False),
        ("Water freezes at 0 degrees.", ["0", "zero"], True),
        ("It froze in 2010.", ["0", "zero"], False),
        ("It was painted by Leonardo da Vinci.", ["Leonardo", "da Vinci"], True),
        ("The capital is New  Delhi", ["New Delhi"], False),  # the answer's own spacing
        ("", ["Paris"], False),
    ],
)
def test_is_correct_on_known_strings(reply, answers, right):
    assert is_correct(reply, answers) is right


def test_the_question_set():
    questions = load_questions()
    assert len(questions) >= 50
    assert len({q.question for q in questions}) == len(questions)
    assert all(q.question.endswith("?") and q.answers and all(a.strip() == a != "" for a in q.answers)
               for q in questions)  # fmt: skip
    for q in questions:  # each question is answered by its first accepted answer, and not by another question's
        assert is_correct(f"The answer is {q.answers[0]}.", q.answers)


def test_retention_and_agreement():
    assert retention([True, True, False, True], [True, False, True, True]) == pytest.approx(2 / 3)
    assert retention([False, False], [True, True]) != retention([False, False], [True, True])  # nan: nothing to keep
    with pytest.raises(ValueError, match="one verdict per question"):
        retention([True], [True, False])
    got = agreement([[1, 2, 3, 4], [5, 6], [9]], [[1, 2, 7, 4], [5, 6], [8]])
    assert got.prefix_tokens == pytest.approx((2 + 2 + 0) / 3) and got.identical == pytest.approx(1 / 3)
    assert got.token_f1 == pytest.approx((0.75 + 1.0 + 0.0) / 3)  # 3 of 4 tokens shared: F1 0.75
    assert agreement([[1, 1, 2]], [[1, 2, 2]]).token_f1 == pytest.approx(2 / 3)  # multisets
    with pytest.raises(ValueError, match="as many answers as references"):
        agreement([[1]], [])


@pytest.fixture(scope="module")
def chat_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    src = chat_dir(root / "src")
    return src, convert(src, root / "mqa", kv_heads=1, method="mean", progress=False)


def test_answer_kl_of_a_model_with_itself_is_zero_and_matches_a_direct_sum(chat_pair):
    src, mqa = chat_pair
    a, b = gqa.load_model(src, dtype=torch.float32), gqa.load_model(mqa, dtype=torch.float32)
    convs = [Conversation("q", "a", [1, 5, 6, 7], [8, 9, 2]), Conversation("r", "b", [1, 4], [3])]
    assert answer_kl(a, a, convs) == 0.0
    kl = answer_kl(b, a, convs)
    total = 0.0
    for c in convs:  # positions 2..5 predict the answer tokens of the first, 1 of the second
        ids = torch.tensor([c.ids])
        p, q = (m(ids)[0].double().log_softmax(-1) for m in (a, b))
        rows = slice(len(c.prompt_ids) - 1, len(c.ids) - 1)
        total += F.kl_div(q[rows], p[rows], log_target=True, reduction="sum").item()
    assert kl > 0 and kl == pytest.approx(total / 4)


def test_suite_end_to_end(chat_pair, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GQA_CACHE_DIR", str(tmp_path / "cache"))
    import gqa.evaluation.suite as suite

    monkeypatch.setattr(conv, "EVALUATION_CONVERSATIONS", 80)  # the suite's set: 80 user turns, 40 rows at a time
    monkeypatch.setattr(suite, "GenerationSettings", functools.partial(conv.GenerationSettings, batch_size=40))
    src, mqa = chat_pair
    out = tmp_path / "suite.json"
    assert cli(["eval", str(src), "--suite", "--reference", str(src), "--json", str(out), "--conversations", "3"]) == 0
    same = json.loads(out.read_text())
    assert same["answer_kl"] == 0.0 and same["identical"] == 1.0 and same["token_f1"] == 1.0
    assert same["correct_model"] == same["correct_original"] and same["conversations"] == 3
    assert all(a == b for a, b in same["perplexity"].values())
    assert cli(["eval", str(mqa), "--suite", "--reference", str(src), "--json", str(out), "--show-answers"]) == 0
    text = capsys.readouterr().out
    other = json.loads(out.read_text())
    assert other["answer_kl"] > 0 and other["questions"] == len(load_questions())
    assert "keeps" in text and "perplexity   encyclopedic prose" in text and "Q: What is the capital of France?" in text


def test_suite_flags_are_checked(capsys):
    assert cli(["eval", "--json", "x.json"]) == 2
    assert "--json and --show-answers go with --suite" in capsys.readouterr().err
    assert cli(["eval", "--suite"]) == 2
    assert "give its folder" in capsys.readouterr().err
