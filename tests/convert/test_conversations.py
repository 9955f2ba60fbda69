"""Self-generated conversations (``gqa.convert.conversations``, ``gqa.convert.data``) on a tiny random chat model:
generation is deterministic with a seed, the cache is keyed by the model's content, the held-out split never reaches
calibration or healing, and the stream's loss weights fall on the answer tokens."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers.checkpoints import chat_dir, tiny_dir

import gqa
from gqa.convert import HealConfig, convert
from gqa.convert import conversations as conv
from gqa.convert.conversations import GenerationSettings, chat_stream, is_held_out, model_content_hash
from gqa.convert.data import calibration_ids, heal_data

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SMALL = GenerationSettings(count=48, batch_size=16, seed=5)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    return chat_dir(tmp_path_factory.mktemp("chat") / "src")


@pytest.fixture(autouse=True)
def cache_root(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("GQA_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def generated(folder: Path, settings: GenerationSettings = SMALL, cache: bool = True) -> conv.ConversationSet:
    model = gqa.load_model(folder, dtype=torch.float32)  # float32: a row's tokens do not depend on its batch
    return conv.self_generated_conversations(
        model, model.tokenizer, model_content_hash(folder), settings, cache=cache, progress=False
    )


def interrupted_while_answering(folder: Path, monkeypatch) -> None:
    """Generate ``SMALL`` into the cache until the first answers are in the journal, then stop as an interrupt
    would."""
    from gqa.convert.batch_journal import BatchJournal

    real = BatchJournal.add

    def add(self, phase, rows):
        real(self, phase, rows)
        if phase == "answers":
            raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(BatchJournal, "add", add)
        with pytest.raises(KeyboardInterrupt):
            generated(folder)


def test_generation_is_deterministic_with_a_seed(chat_model):
    a, b = generated(chat_model, cache=False), generated(chat_model, cache=False)
    other = generated(chat_model, GenerationSettings(count=48, batch_size=16, seed=6), cache=False)
    assert len(a) > 10 and a.train == b.train and a.held_out == b.held_out
    assert [c.question for c in other.train] != [c.question for c in a.train]
    narrow = generated(chat_model, GenerationSettings(count=48, batch_size=5, seed=5), cache=False)
    assert narrow.train == a.train and narrow.held_out == a.held_out  # a row does not depend on the rows beside it
    questions = [c.question for c in a.train + a.held_out]
    assert len(set(questions)) == len(questions)  # deduplicated
    assert all(len(q.split()) >= conv.MIN_QUESTION_WORDS for q in questions)
    model = gqa.load_model(chat_model)
    for c in a.train[:5]:  # the prompt is the chat template's rendering of the user turn
        assert c.prompt_ids == model.tokenizer.apply_chat(c.question)
        assert 0 < len(c.answer_ids) <= conv.ANSWER_TOKENS


def test_the_held_out_split_is_a_stable_tenth():
    questions = [f"question number {i} about something" for i in range(4000)]
    share = sum(map(is_held_out, questions)) / len(questions)
    assert 0.08 < share < 0.12
    assert is_held_out("What is  the Capital?") == is_held_out("what is the capital")  # normalised text
    assert [is_held_out(q) for q in questions[:50]] == [is_held_out(q) for q in reversed(questions[:50])][::-1]


def test_cache_is_keyed_by_the_model_content(chat_model, tmp_path, monkeypatch):
    first = generated(chat_model)
    assert first.path is not None and first.path.is_file() and first.seconds > 0
    copy = shutil.copytree(chat_model, tmp_path / "copy")  # same bytes elsewhere: same key, read from the cache

    def no_generation(*args, **kwargs):
        raise AssertionError("generated again although the cache has this model")

    monkeypatch.setattr(conv, "_generate", no_generation)
    again = generated(copy)
    assert again.train == first.train and again.held_out == first.held_out and again.seconds == 0.0
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of one weight
    weights.write_bytes(bytes(data))
    assert model_content_hash(copy) != model_content_hash(chat_model)
    with pytest.raises(AssertionError, match="generated again"):
        generated(copy)
    assert generated(chat_model, GenerationSettings(count=48, batch_size=16, seed=5)).train == first.train
    with pytest.raises(AssertionError, match="generated again"):  # other settings: another key
        generated(chat_model, GenerationSettings(count=48, batch_size=16, seed=6))


def test_a_cached_set_serves_fewer_user_turns_and_extends_to_more(chat_model, monkeypatch):
    """Row i depends only on i: the first n rows of a cached set are the set of n, and a larger count generates only
    the rows the cache lacks (its journal is kept), giving what a fresh run of that count gives."""
    fresh = {n: generated(chat_model, dataclasses.replace(SMALL, count=n), cache=False) for n in (20, 48)}
    assert 0 < len(fresh[20]) < len(fresh[48])
    made = generated(chat_model, GenerationSettings(count=20, batch_size=16, seed=5))
    assert made.train == fresh[20].train and made.held_out == fresh[20].held_out
    from gqa.serve.engine import Engine

    added, real_add = [], Engine.add
    monkeypatch.setattr(Engine, "add", lambda self, *a, **k: added.append(1) or real_add(self, *a, **k))
    more = generated(chat_model, GenerationSettings(count=48, batch_size=16, seed=5))
    assert more.train == fresh[48].train and more.held_out == fresh[48].held_out
    assert len(added) == (48 - 20) + len(fresh[48]) - len(fresh[20])  # the new user turns and their answers only
    assert more.settings.count == 48 and all(c.row < 48 for c in more.train)
    monkeypatch.setattr(conv, "_generate", lambda *a, **k: pytest.fail("generated again"))
    fewer = generated(chat_model, GenerationSettings(count=20, batch_size=16, seed=5))  # now from the larger file
    assert fewer.train == fresh[20].train and fewer.held_out == fresh[20].held_out and fewer.settings.count == 20
    assert fresh[48].first(20).train == fresh[20].train


def test_a_corrupt_cache_file_is_generated_again(chat_model):
    first = generated(chat_model)
    first.path.write_text("{not json")
    again = generated(chat_model)
    assert again.train == first.train and json.loads(first.path.read_text())["format"] == conv.CACHE_FORMAT


def test_an_interrupted_generation_resumes_with_the_rows_it_lacks(chat_model, cache_root, monkeypatch):
    """Interrupted while answering (just after the first answers were recorded), a run leaves a journal of the rows
    finished so far; the next run generates exactly the rows the journal lacks and gives the set an uninterrupted run
    gives. The journal stays beside the written set (a larger count continues from it)."""
    from gqa.serve.engine import Engine

    whole = generated(chat_model, cache=False)
    real_add = Engine.add
    interrupted_while_answering(chat_model, monkeypatch)
    (journal,) = cache_root.rglob("*.rows.jsonl")
    entries = [json.loads(line) for line in journal.read_text().splitlines()]
    assert [e["phase"] for e in entries][-2:] == ["user turns", "answers"]
    kept = len(entries[-1]["rows"])
    assert 0 < kept < len(whole)  # else this test could not fail
    added = []
    monkeypatch.setattr(Engine, "add", lambda self, *a, **k: added.append(1) or real_add(self, *a, **k))
    resumed = generated(chat_model)
    assert len(added) == len(whole) - kept  # no user turn and no recorded answer again
    assert resumed.train == whole.train and resumed.held_out == whole.held_out
    assert journal.exists() and resumed.path.is_file()


def test_the_journal_drops_a_line_cut_short_and_goes_on(tmp_path):
    from gqa.convert.batch_journal import BatchJournal

    path = tmp_path / "j.partial.jsonl"
    journal = BatchJournal(path)
    journal.add("a", {0: [1, 2], 5: [3]})
    journal.add("b", {1: [4]})
    whole = path.read_bytes()
    journal.add("a", {2: [6, 7]})
    path.write_bytes(cut := path.read_bytes()[:-5])  # the last line cut while written (or being written)
    reader = BatchJournal(path, read_only=True)  # beside a running writer: reads, never truncates
    assert reader.finished("a") == {0: [1, 2], 5: [3]} and path.read_bytes() == cut
    again = BatchJournal(path)
    assert again.finished("a") == {0: [1, 2], 5: [3]} and again.finished("b") == {1: [4]}
    assert path.read_bytes() == whole  # truncated to the whole lines
    again.add("a", {2: [6, 7]})
    assert BatchJournal(path).finished("a") == {0: [1, 2], 5: [3], 2: [6, 7]} and again.finished("c") == {}


def test_a_model_the_engine_does_not_take_is_generated_in_batches(chat_model, monkeypatch):
    """Without the serving engine (a GPU, float16, no native kernels), the set comes from fixed batches through
    ``gqa.decoding.generate.generate``; its greedy answers are the ones the engine gives to the same prompts."""
    from gqa.convert.bulk_generation import generate_continuous
    from gqa.serve.engine import Engine, EngineError

    def refuse(model):
        raise EngineError("not this one")

    monkeypatch.setattr(Engine, "check_model", staticmethod(refuse))
    batched = generated(chat_model, cache=False)
    assert len(batched) > 10
    monkeypatch.undo()
    model = gqa.load_model(chat_model, dtype=torch.float32)
    convs = batched.train + batched.held_out
    again = generate_continuous(
        model, [c.prompt_ids for c in convs], max_new_tokens=conv.ANSWER_TOKENS,
        end_ids=conv.end_of_turn_ids(model.tokenizer, model), batch_size=7,
    )  # fmt: skip
    assert again == [c.answer_ids for c in convs]


def test_no_chat_template_is_an_error(tmp_path):
    folder = tiny_dir(tmp_path / "plain")
    model = gqa.load_model(folder)
    with pytest.raises(ValueError, match="need a chat template"):
        conv.self_generated_conversations(model, model.tokenizer, "0" * 64, SMALL, progress=False)


def test_settings_are_checked():
    with pytest.raises(ValueError, match="count and batch_size must be >= 1"):
        GenerationSettings(count=0)
    with pytest.raises(TypeError, match="seed must be an int"):
        GenerationSettings(seed=1.5)
    with pytest.raises(ValueError, match="temperature > 0"):
        GenerationSettings(temperature=0)


def test_the_stream_weights_the_answer_tokens():
    a = conv.Conversation("q", "a", [5, 6, 7], [8, 9])
    b = conv.Conversation("r", "b", [5, 6], [10])
    ids, weights, starts = chat_stream([a, b], answer_weight=3.0)
    assert ids == [5, 6, 7, 8, 9, 5, 6, 10] and starts == [0, 5]
    # position t predicts ids[t + 1]: 7 -> 8 and 8 -> 9 are answer predictions; 9 -> 5 crosses conversations
    assert weights == [1.0, 1.0, 3.0, 3.0, 0.0, 1.0, 3.0, 0.0]


def test_held_out_conversations_never_reach_calibration_or_healing(chat_model, tmp_path, monkeypatch):
    chats = generated(chat_model)
    assert chats.held_out and chats.train  # else this test could not fail
    import gqa.convert as convert_module
    from gqa.convert import run, shared_healing

    seen: dict[str, list[int]] = {}
    real_refit, real_heal = convert_module.refit_convert_state, shared_healing.heal

    def refit(cfg, state, kv_heads, method, ids, **kw):
        seen["calibration"] = list(ids)
        return real_refit(cfg, state, kv_heads, method, ids, **kw)

    def heal(student, teacher, ids, **kw):
        seen["healing"] = list(ids)
        return real_heal(student, teacher, ids, **kw)

    monkeypatch.setattr(convert_module, "refit_convert_state", refit)
    monkeypatch.setattr(shared_healing, "heal", heal)
    monkeypatch.setattr(run, "_source_conversations", lambda *a: chats)  # the set made above
    config = HealConfig(steps=2, seq_len=32, precision="fp32")
    convert(chat_model, tmp_path / "out", kv_heads=1, heal=config, progress=False)
    as_text = {k: " ".join(map(str, v)) for k, v in seen.items()}
    for name, text in as_text.items():
        assert " ".join(map(str, chats.train[0].ids)) in text, name  # the training conversations are read
        for c in chats.held_out:
            assert " ".join(map(str, c.ids)) not in text, (name, c.question)
    log = json.loads((tmp_path / "out" / "heal_log.json").read_text())
    assert "self-generated conversations" in log["text"]


def test_without_a_chat_template_or_with_conversations_off_calibration_reads_prose(tmp_path, monkeypatch):
    from gqa.convert import run

    called = []
    monkeypatch.setattr(run, "_source_conversations", lambda *a: called.append(a))
    convert(tiny_dir(tmp_path / "plain"), tmp_path / "a", kv_heads=1, progress=False)
    convert(chat_dir(tmp_path / "chat"), tmp_path / "b", kv_heads=1, conversations=False, progress=False)
    convert(tmp_path / "chat", tmp_path / "c", kv_heads=1, calibration_text="the cat sat " * 40, progress=False)
    assert called == []
    with pytest.raises(ValueError, match="needs a source whose tokenizer has a chat template"):
        convert(tmp_path / "plain", tmp_path / "d", kv_heads=1, conversations=True)


def test_the_mixes_hold_conversations_and_prose(chat_model):
    chats = generated(chat_model)
    tok = gqa.load_model(chat_model).tokenizer
    ids = calibration_ids(tok, chats.train, conversation_tokens=100, prose_tokens=50)
    assert ids[: len(chats.train[0].ids)] == chats.train[0].ids and 100 + 50 <= len(ids) < 100 + 50 + 200
    data = heal_data(tok, chats.train, seq_len=16, prose_share=0.25)
    n = len(chats.train)
    prose_starts = [s for s in data.starts if s >= len(chat_stream(chats.train)[0])]
    assert len(data.starts) == n + len(prose_starts) and abs(len(prose_starts) - n / 3) <= 1
    assert len(data.ids) == len(data.weights) and set(data.weights) == {0.0, 1.0, 2.0}
    with pytest.raises(ValueError, match="prose_share"):
        heal_data(tok, chats.train, 16, prose_share=1.0)


def test_heal_reads_windows_at_the_starts_with_the_weights(monkeypatch):
    from helpers.checkpoints import tiny_pair

    from gqa.convert import heal
    from gqa.convert import healing as healing_module

    teacher, student = tiny_pair()
    ids = torch.randint(0, 64, (200,), generator=torch.Generator().manual_seed(0))
    batches = []
    real = healing_module.kl_loss
    monkeypatch.setattr(
        healing_module, "kl_loss", lambda s, t, w=None, *rest: batches.append(w) or real(s, t, w, *rest)
    )
    weights = torch.zeros(200)
    weights[50:60] = 1.0
    heal(student, teacher, ids, steps=6, seq_len=16, starts=[50, 190], weights=weights, progress=False,
         precision="fp32")  # fmt: skip
    for w in batches:  # each window starts at 50 or at 184 (190 moved back to fit)
        assert torch.equal(w[0], weights[50:66]) or torch.equal(w[0], weights[184:200])
    with pytest.raises(ValueError, match="weights must be"):
        heal(student, teacher, ids, steps=1, seq_len=16, weights=torch.ones(10), progress=False)
    with pytest.raises(ValueError, match="window starts must lie"):
        heal(student, teacher, ids, steps=1, seq_len=16, starts=[500], progress=False)


def test_weighted_kl_loss_is_the_weighted_mean():
    from gqa.convert.healing import kl_loss

    s, t = torch.randn(2, 5, 11), torch.randn(2, 5, 11)
    per = (t.log_softmax(-1).exp() * (t.log_softmax(-1) - s.log_softmax(-1))).sum(-1)  # (2, 5)
    w = torch.rand(2, 5)
    torch.testing.assert_close(kl_loss(s, t, w), (per * w).sum() / w.sum())
    torch.testing.assert_close(kl_loss(s, t), per.mean())
    # a share of a larger batch: divided by the whole batch's weight (or position count), not its own
    torch.testing.assert_close(kl_loss(s, t, w, total=3.0), (per * w).sum() / 3.0)
    torch.testing.assert_close(kl_loss(s, t, None, total=40), per.sum() / 40)


def test_the_plan_says_what_generating_costs_before_paying_it(chat_model, cache_root, tmp_path, capsys):
    """``gqa convert --dry-run`` with an empty cache names the user turns to generate and an estimate from a probe;
    the real run prints the same plan before it starts; afterwards the plan reads them from the cache, with the
    calibration's own token count."""
    from gqa.cli import main as cli
    from gqa.convert import generation_cost

    flags = ["--kv-heads", "1", "--calibration-conversations", "24"]
    assert cli(["convert", str(chat_model), str(tmp_path / "dry"), *flags, "--dry-run"]) == 0
    out = capsys.readouterr().out
    (line,) = [s for s in out.splitlines() if s.startswith("calibration  conversations: ")]
    assert "24 user turns and their answers to generate (~" in line and "tokens/s in a short probe)" in line, out
    assert "(generating ~" in out and not (tmp_path / "dry").exists() and not list(cache_root.rglob("*.json"))
    assert cli(["convert", str(chat_model), str(tmp_path / "out"), *flags]) == 0
    run = capsys.readouterr()
    assert "24 user turns and their answers to generate" in run.err and "wrote" in run.out
    assert cli(["convert", str(chat_model), str(tmp_path / "dry"), *flags, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "calibration  conversations of 24 user turns, read from the cache" in out and "(generating" not in out, out
    cost = generation_cost.source_generation_cost(chat_model, gqa.load_model(chat_model).tokenizer,
                                                  GenerationSettings(count=24))  # fmt: skip
    ids = calibration_ids(gqa.load_model(chat_model).tokenizer, cost.read(24).train)
    assert f"~{len(ids):,} calibration tokens" in out
    assert cli(["convert", str(chat_model), str(tmp_path / "dry"), "--kv-heads", "1", "--calibration-conversations",
                "0", "--dry-run"]) == 2  # fmt: skip
    assert "calibration_conversations must be >= 1, got 0" in capsys.readouterr().err


def test_calibration_reads_its_first_rows_and_healing_the_larger_set(chat_model, tmp_path, monkeypatch):
    """With healing on conversations the set is ``HEALING_CONVERSATIONS`` user turns; the calibration still reads
    the training conversations of its own first ``calibration_conversations`` rows, healing all of them."""
    from gqa.convert import plan, run, shared_healing

    monkeypatch.setattr(plan, "HEALING_CONVERSATIONS", 48)
    monkeypatch.setattr(plan, "GenerationSettings", functools.partial(GenerationSettings, batch_size=16))
    big = generated(chat_model, GenerationSettings(count=48, batch_size=16))
    small = big.first(20)
    assert 0 < len(small.train) < len(big.train)
    seen: dict[str, str] = {}
    real_refit, real_heal = run.stream_convert, shared_healing.heal

    def stream(*a, calibration_ids=None, **kw):
        seen["calibration"] = " ".join(map(str, calibration_ids))
        return real_refit(*a, calibration_ids=calibration_ids, **kw)

    def heal(student, teacher, ids, **kw):
        seen["healing"] = " ".join(map(str, ids))
        return real_heal(student, teacher, ids, **kw)

    monkeypatch.setattr(run, "stream_convert", stream)
    monkeypatch.setattr(shared_healing, "heal", heal)
    config = HealConfig(steps=1, seq_len=32, precision="fp32")
    convert(chat_model, tmp_path / "out", kv_heads=1, heal=config, calibration_conversations=20, progress=False)
    for c in big.train:
        assert (" ".join(map(str, c.ids)) in seen["calibration"]) == (c.row < 20), c.row
        assert " ".join(map(str, c.ids)) in seen["healing"]
    convert(chat_model, tmp_path / "plain", kv_heads=1, calibration_conversations=20, progress=False)
    assert seen["calibration"] == " ".join(map(str, calibration_ids(gqa.load_model(chat_model).tokenizer, small.train)))


def test_the_cost_counts_the_rows_an_interrupted_run_left(chat_model, cache_root, monkeypatch):
    """A run stopped while answering leaves a journal: the cost says how many user turns were made before and
    estimates only the rest (a probe run on the model), reading the journal without cutting a line being written."""
    from gqa.convert import generation_cost

    interrupted_while_answering(chat_model, monkeypatch)
    model = gqa.load_model(chat_model)
    (journal,) = cache_root.rglob("*.rows.jsonl")
    journal.write_bytes(journal.read_bytes() + b'{"phase": "answers", "rows": {"9')  # a line being written
    before = journal.read_bytes()
    cost = generation_cost.generation_cost(model, model.tokenizer, model_content_hash(chat_model), SMALL)
    assert cost.cached == SMALL.count and 0 < cost.answers < SMALL.count and not cost.done  # answers left to make
    assert cost.seconds > 0 and cost.rate > 0 and journal.read_bytes() == before
    assert (
        f"the 0 user turns and the answers left to generate (a stopped run made 48 turns and {cost.answers} answers)"
        in cost.describe()
    )
