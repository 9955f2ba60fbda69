"""Healing (``gqa.convert.healing``): a merged tiny model gets closer to its source, deterministically; the loss curve
is a real PNG; ``convert(..., heal=...)`` and ``gqa convert --heal-steps`` write the healed model safely, validate their
flags before loading anything, and an interrupted heal leaves no destination and an untouched source."""

from __future__ import annotations

import itertools
import json
import os
import random
import re
import struct
import time
from pathlib import Path

import pytest
import torch
from helpers.checkpoints import TRAIN_IDS, WORDS, digest, tensors, tiny_dir, tiny_pair

import gqa
from gqa.cli import main as cli
from gqa.convert import HealConfig, calibration, convert, heal, layer_local, resolve_precision, save_loss_curve
from gqa.convert import healing as healing_module
from gqa.convert.calibration import _shingles, default_heal_text, held_out_text
from gqa.evaluation.perplexity import default_eval_text, mean_kl

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# ---------------------------------------------------------------------------------------------------------------------
# heal() on models in memory


HELD_OUT = torch.randint(0, 64, (120,), generator=torch.Generator().manual_seed(2))


def test_heal_lowers_the_kl_to_the_teacher():
    teacher, student = tiny_pair()
    before = mean_kl(student, teacher, HELD_OUT, window=32)
    res = heal(student, teacher, TRAIN_IDS, steps=30, lr=3e-3, seq_len=32, batch_size=2, progress=False)
    after = mean_kl(student, teacher, HELD_OUT, window=32)
    assert before > 0.05, before  # the merge really changed the model
    assert after < 0.7 * before, (before, after)  # on text it never trained on
    assert len(res.losses) == len(res.lrs) == 30 and res.tokens_per_step == 64
    assert sum(res.losses[-5:]) < 0.7 * sum(res.losses[:5])
    assert res.lrs[0] < res.lrs[3] == pytest.approx(3e-3) and res.lrs[-1] == pytest.approx(3e-4)  # warm-up, cosine
    assert not student.training and all(p.requires_grad for p in student.parameters())  # left as found
    assert all(p.grad is None for p in student.parameters())


def test_heal_is_deterministic_with_a_seed():
    runs = []
    for seed in (0, 0, 1):
        teacher, student = tiny_pair()
        res = heal(student, teacher, TRAIN_IDS, steps=5, lr=1e-3, seq_len=32, seed=seed, progress=False)
        runs.append((res.losses, student.state_dict()))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])
    assert runs[0][0] != runs[2][0]  # another seed reads other windows


def test_bf16_autocast_heals_like_fp32():
    """``precision="bf16"`` really runs the passes in bfloat16 (the losses differ from float32's in the low bits) and
    heals as well; the trained weights stay float32."""
    runs = {}
    for precision in ("bf16", "fp32"):
        teacher, student = tiny_pair()
        seen = set()
        hook = student.lm_head.register_forward_hook(lambda _m, _a, out, seen=seen: seen.add(out.dtype))
        res = heal(student, teacher, TRAIN_IDS, steps=30, lr=3e-3, seq_len=32, batch_size=2, precision=precision,
                   progress=False)  # fmt: skip
        hook.remove()
        runs[precision] = (res.losses, mean_kl(student, teacher, HELD_OUT, window=32), seen)
        assert all(p.dtype == torch.float32 for p in student.parameters())
        assert res.config.precision == precision
    (bf16_losses, bf16_kl, bf16_dtypes), (fp32_losses, fp32_kl, fp32_dtypes) = runs["bf16"], runs["fp32"]
    assert bf16_dtypes == {torch.bfloat16} and fp32_dtypes == {torch.float32}
    assert bf16_losses != fp32_losses and bf16_losses[0] == pytest.approx(fp32_losses[0], rel=0.05)
    assert bf16_kl == pytest.approx(fp32_kl, rel=0.2, abs=0.02), (bf16_kl, fp32_kl)


@pytest.mark.parametrize("fast_bf16", [True, False])
def test_auto_precision_follows_the_cpu(monkeypatch, fast_bf16):
    """``"auto"`` runs bf16 only on a CPU that multiplies bf16 natively: on an AVX2-only CPU bf16 autocast is emulated
    and a SmolLM2 healing step took 55 s instead of 2.3 s in fp32. The flags are faked both ways; the lm_head hook
    shows what the passes really ran in, and the result records it."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: fast_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    expected = "bf16" if fast_bf16 else "fp32"
    assert resolve_precision("auto") == expected == resolve_precision("auto", torch.device("cpu"))
    assert resolve_precision("bf16") == "bf16" and resolve_precision("fp32") == "fp32"  # explicit choices stand
    teacher, student = tiny_pair()
    seen = set()
    student.lm_head.register_forward_hook(lambda _m, _a, out: seen.add(out.dtype))
    res = heal(student, teacher, TRAIN_IDS, steps=2, seq_len=32, progress=False)  # precision defaults to "auto"
    assert res.config.precision == "auto" and res.precision == expected
    assert seen == {torch.bfloat16 if fast_bf16 else torch.float32}


def test_auto_precision_amx_counts_and_unknown_names_fail(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert resolve_precision("auto") == "bf16"
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported")  # a torch without the probe: fp32 unless AMX says so
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert resolve_precision("auto") == "fp32"
    with pytest.raises(ValueError, match="precision must be one of auto, bf16, fp32; got 'fp16'"):
        resolve_precision("fp16")


@pytest.mark.parametrize("train", ["attention", "all"])
def test_only_the_chosen_parameters_train(train):
    teacher, student = tiny_pair()
    before = {k: v.clone() for k, v in student.state_dict().items()}
    teacher_before = {k: v.clone() for k, v in teacher.state_dict().items()}
    res = heal(student, teacher, TRAIN_IDS, steps=3, lr=1e-3, seq_len=32, train=train, progress=False)
    after = student.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    attention = {k for k in before if any(f".{p}_proj." in k for p in "qkvo")}
    assert changed == (attention if train == "attention" else set(before)), changed ^ attention
    n_attention = sum(before[k].numel() for k in attention)
    assert res.trained_parameters == (
        n_attention if train == "attention" else sum(p.numel() for p in student.parameters())
    )
    assert all(torch.equal(teacher_before[k], v) for k, v in teacher.state_dict().items())  # the teacher is only read


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(steps=0), "steps must be >= 1"),
        (dict(steps=2, lr=-1.0), "lr must be a positive number"),
        (dict(steps=2, train="mlp"), "train must be one of attention, attention+mlp-lora, all"),
        (dict(steps=2, seq_len=1), "seq_len must be >= 2"),
        (dict(steps=2, seq_len=100), "seq_len (100) exceeds the model's context of 64"),
        (dict(steps=2, seq_len=32, warmup=3), "warmup must be an int in [0, steps=2]"),
        (dict(steps=2, seq_len=32, precision="fp16"), "precision must be one of auto, bf16, fp32; got 'fp16'"),
        (dict(steps=2, seq_len=32, minutes=0), "minutes must be a positive number or None, got 0"),
        (dict(steps=2, seq_len=32, minutes=float("inf")), "minutes must be a positive number or None, got inf"),
    ],
)
def test_bad_heal_arguments(kwargs, message):
    teacher, student = tiny_pair()
    with pytest.raises(ValueError, match=re.escape(message)):
        heal(student, teacher, TRAIN_IDS, progress=False, **kwargs)
    with pytest.raises(ValueError, match="healing text is 10 tokens long"):
        heal(student, teacher, TRAIN_IDS[:10], steps=2, seq_len=32, progress=False)


class FakeClock:
    """``healing._clock`` stand-in: every reading is ``tick`` seconds after the previous one."""

    def __init__(self, tick: float) -> None:
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def test_a_time_budget_stops_healing_and_ends_the_schedule(monkeypatch):
    """``minutes`` stops the loop once the budget is spent (the fake clock moves 2 s per reading: one at the start,
    one before each step), and the cosine follows the elapsed time: the last step's rate is near the floor although
    far fewer than ``steps`` ran."""
    teacher, student = tiny_pair()
    monkeypatch.setattr(healing_module, "_clock", FakeClock(2.0))
    res = heal(student, teacher, TRAIN_IDS, steps=1000, lr=1e-3, seq_len=32, warmup=2, minutes=0.5, progress=False)
    assert len(res.losses) == len(res.lrs) == 14  # readings at 4, 6, ..., 30 s start a step; at 32 s the budget is out
    assert res.seconds == pytest.approx(32.0)
    assert res.lrs[1] == pytest.approx(1e-3)  # warm-up
    assert all(a > b for a, b in itertools.pairwise(res.lrs[2:]))  # decaying along the time, not along 1000 steps
    assert res.lrs[-1] < 0.15e-3 and res.lrs[-1] >= 1e-4  # near the floor of a tenth at the end of the budget
    assert res.config.minutes == 0.5


def test_steps_still_bound_a_time_budget(monkeypatch):
    teacher, student = tiny_pair()
    monkeypatch.setattr(healing_module, "_clock", FakeClock(0.001))
    res = heal(student, teacher, TRAIN_IDS, steps=5, lr=1e-3, seq_len=32, minutes=60.0, progress=False)
    assert len(res.losses) == 5 and res.lrs[-1] == pytest.approx(1e-4)  # the step count ends the cosine


def test_cli_heal_minutes(src, tmp_path, capsys, monkeypatch):
    """``--heal-minutes`` alone: the time is the only limit of both phases (fake clocks end each after a few steps;
    the layer-local phase used to read the real clock and ran for its real 30 s)."""
    monkeypatch.setattr(healing_module, "_clock", FakeClock(10.0))
    monkeypatch.setattr(layer_local, "_clock", FakeClock(0.5))  # the capture reads it once a window
    text = tmp_path / "heal.txt"
    text.write_text(HEAL_TEXT)
    dst = tmp_path / "out"
    flags = ["--heal-minutes", "1", "--heal-text", str(text), "--heal-seq-len", "16", "--heal-precision", "fp32"]
    assert cli(["convert", str(src), str(dst), "--kv-heads", "2", "--method", "first", *flags]) == 0
    log = json.loads((dst / "heal_log.json").read_text())
    assert log["config"]["minutes"] == 1.0 and log["config"]["steps"] == 10**9
    assert 2 <= len(log["losses"]) <= 6, len(log["losses"])  # 10 s per clock reading against a 60 s budget
    assert 5 <= len(log["local"]["losses"]) <= 60, len(log["local"]["losses"])  # ~15 s of 0.5 s readings left
    assert f"healed       {len(log['losses'])} steps x 16 tokens" in capsys.readouterr().out


def test_loss_curve_is_a_valid_png(tmp_path):
    teacher, student = tiny_pair()
    res = heal(student, teacher, TRAIN_IDS, steps=4, lr=1e-3, seq_len=32, progress=False)
    path = save_loss_curve(res, tmp_path / "curve.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    assert struct.unpack(">II", data[16:24]) == (700, 400)  # 7 x 4 inches at 100 dpi
    from PIL import Image

    with Image.open(path) as img:
        img.verify()  # checks the chunks' CRCs
    assert [p.name for p in tmp_path.iterdir()] == ["curve.png"]  # no temporary file left
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # an ordinary file, not mkstemp's private one


def test_default_heal_text_is_disjoint_from_the_eval_text_and_the_held_out_text():
    text = default_heal_text()
    assert len(text) >= 800_000 and text == default_heal_text()  # top level and packages; stable
    eval_text = default_eval_text()[0]
    assert _shingles(text).isdisjoint(_shingles(eval_text))
    start, end = calibration.HELD_OUT
    held = held_out_text()
    assert len(held) == end - start and held[:200] not in text and held[-200:] not in text
    assert _shingles(text[start:]).isdisjoint(_shingles(held))  # nothing after the span repeats 8 words of it
    assert text[:start] == default_heal_text(start) and default_heal_text(start + 5_000) == text[: start + 5_000]
    # the exclusion really works: excluding the start of the text removes the docstrings it came from
    assert text[:300] not in default_heal_text(max_chars=20_000, exclude=text[:300])
    assert default_heal_text(max_chars=20_000, exclude="").startswith(text[:300])


# ---------------------------------------------------------------------------------------------------------------------
# convert(..., heal=...) and gqa convert --heal-steps, on a tiny HF checkpoint

HEAL_TEXT = " ".join(random.Random(0).choices(WORDS, k=400))


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    # Llama, not Qwen2: transformers 5 loads any qwen2-typed folder's tokenizer as Qwen2Tokenizer, which maps this
    # word-level vocabulary to one token id, and healing on a constant text cannot train q/k (found by bf16 healing)
    folder = tiny_dir(tmp_path_factory.mktemp("heal") / "src", "llama", 8, 4)
    assert len(set(gqa.load_tokenizer(folder).encode(HEAL_TEXT))) == len(WORDS)  # the heal text really varies
    return folder


def _kl_to_source(folder: Path, src: Path) -> float:
    ids = torch.tensor([1, *random.Random(1).choices(range(3, 3 + len(WORDS)), k=60)])  # held out: another seed
    return mean_kl(
        gqa.load_model(folder, tokenizer=False, dtype=torch.float32),
        gqa.load_model(src, tokenizer=False, dtype=torch.float32),
        ids,
        window=64,
    )


def test_convert_with_healing_writes_the_healed_model(src, tmp_path):
    before = digest(src)
    plain = convert(src, tmp_path / "plain", kv_heads=1, method="first")
    config = HealConfig(steps=25, lr=3e-3, seq_len=16, batch_size=2, local_share=0.0)  # end-to-end only
    healed = convert(src, tmp_path / "healed", kv_heads=1, method="first", heal=config, heal_text=HEAL_TEXT,
                     progress=False)  # fmt: skip
    assert digest(src) == before  # the source was only read
    assert {"config.json", "model.safetensors", "heal_loss.png", "heal_log.json", "tokenizer.json"} <= {
        p.name for p in healed.iterdir()
    }
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folders left
    log = json.loads((healed / "heal_log.json").read_text())
    assert len(log["losses"]) == 25 and log["config"]["lr"] == 3e-3 and log["tokens_per_step"] == 32
    assert (healed / "heal_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert gqa.load_model(healed).config.num_kv_heads == 1
    a, b = tensors(plain), tensors(healed)
    assert a.keys() == b.keys()
    for proj in "qkvo":  # every attention projection really trained (not just round-off)
        name = f"model.layers.0.self_attn.{proj}_proj.weight"
        assert (a[name] - b[name]).abs().max() > 1e-3, name
    assert torch.equal(a["model.layers.0.mlp.up_proj.weight"], b["model.layers.0.mlp.up_proj.weight"])
    assert _kl_to_source(healed, src) < 0.8 * _kl_to_source(plain, src)


@pytest.mark.parametrize("existing", [False, True])
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_interrupted_healing_leaves_no_destination(src, tmp_path, monkeypatch, existing, error):
    dst = tmp_path / "out"
    if existing:
        dst.mkdir()
        (dst / "mine.txt").write_text("keep me")
    before, source_before = digest(tmp_path), digest(src)
    calls = []
    real = healing_module.kl_loss

    def failing(*args):
        calls.append(None)
        if len(calls) == 3:
            raise error("interrupted (simulated)")
        return real(*args)

    monkeypatch.setattr(healing_module, "kl_loss", failing)
    with pytest.raises(error, match="simulated"):
        convert(src, dst, kv_heads=1, method="mean", heal=HealConfig(steps=10, seq_len=16), heal_text=HEAL_TEXT,
                force=True, progress=False)  # fmt: skip
    assert len(calls) == 3  # it failed inside the loop
    assert digest(tmp_path) == before  # DST absent, or the user's folder untouched; no temporary folder
    assert digest(src) == source_before


def test_convert_healing_arguments(src, tmp_path):
    dst = tmp_path / "out"
    with pytest.raises(ValueError, match=r"healing only applies when merging KV heads \(kv_heads < 4\)"):
        convert(src, dst, kv_heads=8, heal=HealConfig(steps=2), heal_text=HEAL_TEXT)
    with pytest.raises(ValueError, match="heal_text is only used when healing"):
        convert(src, dst, kv_heads=1, heal_text=HEAL_TEXT)
    with pytest.raises(TypeError, match="heal must be a HealConfig"):
        convert(src, dst, kv_heads=1, heal=5)
    assert not dst.exists()


# ---------------------------------------------------------------------------------------------------------------------
# The CLI


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--heal-steps", "5", "--conversations"], "needs a source whose tokenizer has a chat template"),
        (["--heal-minutes", "-1"], "--heal-minutes must be a positive number, got -1.0"),
        (["--heal-minutes", "0", "--heal-text", "stdlib"], "--heal-minutes must be a positive number, got 0.0"),
        (["--heal-minutes", "nan", "--heal-text", "stdlib"], "--heal-minutes must be a positive number, got nan"),
        (["--heal-steps", "-1", "--heal-text", "stdlib"], "--heal-steps must be >= 0, got -1"),
        (["--heal-text", "stdlib"], "--heal-text is only used with --heal-steps N (N > 0) or --heal-minutes M"),
        # any healing flag without healing (they were ignored, --heal-text alone was refused)
        (
            ["--heal-lr", "-1", "--heal-local-share", "2", "--heal-train", "all"],
            "--heal-lr, --heal-train, --heal-local-share are only used with --heal-steps N (N > 0) or --heal-minutes M",
        ),
        (["--heal-seed", "5"], "--heal-seed is only used with --heal-steps N"),
        (["--heal-steps", "5", "--heal-text", "stdlib", "--heal-lr", "0"], "heal lr must be a positive number"),
        (["--heal-steps", "5", "--heal-text", "stdlib", "--heal-batch", "0"], "heal batch_size must be >= 1"),
        (["--heal-steps", "5", "--heal-text", "/nonexistent/heal.txt"], "No such file"),
        (["--heal-steps", "5", "--heal-text", "stdlib", "--heal-local-share", "1"], "heal local_share must be a"),
    ],
)
def test_cli_heal_flag_errors(src, tmp_path, capsys, flags, message):
    dst = tmp_path / "out"
    assert cli(["convert", str(src), str(dst), "--kv-heads", "1", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gqa convert: error: ") and message in err, err
    assert not dst.exists()


def test_cli_heal_needs_a_merge(src, tmp_path, capsys):
    assert cli(["convert", str(src), str(tmp_path / "o"), "--kv-heads", "8", "--heal-steps", "3", "--heal-text",
                "stdlib"]) == 2  # fmt: skip
    assert "healing only applies when merging KV heads (--kv-heads < 4)" in capsys.readouterr().err


def test_cli_heals(src, tmp_path, capsys):
    text = tmp_path / "heal.txt"
    text.write_text(HEAL_TEXT)
    dst = tmp_path / "out"
    flags = ["--heal-steps", "6", "--heal-text", str(text), "--heal-seq-len", "16", "--heal-lr", "1e-3",
             "--heal-precision", "fp32", "--heal-local-share", "0"]  # fmt: skip
    assert cli(["convert", str(src), str(dst), "--kv-heads", "2", "--method", "first", *flags]) == 0
    out = capsys.readouterr().out
    assert "healed       6 steps x 16 tokens (attention, lr 0.001, fp32)" in out and "layer-local" not in out
    assert f"loss curve   {dst.resolve() / 'heal_loss.png'}" in out
    log = json.loads((dst / "heal_log.json").read_text())
    assert log["config"] == {"steps": 6, "lr": 1e-3, "seq_len": 16, "batch_size": 1, "train": "attention",
                             "warmup": None, "seed": 0, "precision": "fp32", "minutes": None,
                             "sharding": "auto", "local_share": 0.0}  # fmt: skip
    assert log["precision"] == "fp32"  # what the passes ran in
    assert (log["processes"], log["sharding"], log["device"]) == (1, "none", "cpu")  # one process: nothing shared
    assert log["local"] is None


def test_cli_heals_layer_local_first(src, tmp_path, capsys):
    """By default ``gqa convert`` spends half the budget (here of the steps) on the layer-local phase."""
    text = tmp_path / "heal.txt"
    text.write_text(HEAL_TEXT)
    dst = tmp_path / "out"
    flags = ["--heal-steps", "8", "--heal-text", str(text), "--heal-seq-len", "16", "--heal-precision", "fp32"]
    assert cli(["convert", str(src), str(dst), "--kv-heads", "2", "--method", "first", *flags]) == 0
    out = capsys.readouterr().out
    assert "healed       4 steps x 16 tokens (attention, lr 2e-05, fp32)" in out, out  # the rate after the phase
    assert "layer-local  4 steps in " in out, out
    log = json.loads((dst / "heal_log.json").read_text())
    assert log["config"]["local_share"] == 0.5 and len(log["local"]["losses"]) == 4 and len(log["losses"]) == 4
    assert max(log["lrs"]) == pytest.approx(2e-5)
    assert len(log["local"]["errors_before"]) == len(log["local"]["errors_after"]) > 0


def test_the_callbacks_time_is_not_healing_time(monkeypatch):
    """A callback that takes 100 s (say, scoring an evaluation text) neither ends a 30-second budget nor counts in
    ``seconds``: the fake clock moves 2 s per reading, and the callback moves it 100 s more. It also burns 0.3 s of
    real CPU time per call, which stays out of ``cpu_seconds``."""
    clock = FakeClock(2.0)
    monkeypatch.setattr(healing_module, "_clock", clock)
    calls = []

    def slow_callback(step: int, loss: float) -> None:
        calls.append(step)
        clock.now += 100.0
        busy = time.process_time()
        while time.process_time() - busy < 0.3:
            pass

    teacher, student = tiny_pair()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # CPU time, not OpenMP threads spinning for a core another process holds
    try:
        res = heal(student, teacher, TRAIN_IDS, steps=1000, lr=1e-3, seq_len=32, warmup=2, minutes=0.5,
                   progress=False, callback=slow_callback)  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    # healing time: 2 s per step before it and 2 s for the reading that opens the callback (its 100 s and the reading
    # that closes it are left out): the steps start at 2, 6, ..., 26 s; at 30 s the budget is spent
    assert len(res.losses) == len(calls) == 7 and calls == list(range(7))
    assert res.seconds == pytest.approx(32.0)  # not 7 x 102 s more
    assert res.lrs[-1] < 0.2e-3  # the schedule ran on healing time too
    assert res.cpu_seconds < 0.3 * len(calls) / 2, res.cpu_seconds  # 2.1 s were burnt in the callback


@pytest.mark.parametrize(
    ("kwargs", "lr"),
    [({}, 2e-5), ({"local_share": 0.0}, 1e-4), ({"local_share": 0.25}, 2e-5), ({"lr": 3e-4}, 3e-4),
     ({"lr": 3e-4, "local_share": 0.0}, 3e-4)],
)  # fmt: skip
def test_the_default_rate_follows_the_phases(kwargs, lr):
    """Without ``lr``, end-to-end healing from the merge peaks at 1e-4 and after a layer-local phase at 2e-5; a given
    ``lr`` is kept."""
    assert HealConfig(steps=10, **kwargs).lr == lr


def test_heal_defaults_to_end_to_end_at_the_merge_rate():
    res = heal(*tiny_pair(), TRAIN_IDS, steps=30, seq_len=24, progress=False)
    assert res.config.lr == 1e-4 and max(res.lrs) == pytest.approx(1e-4) and res.local is None
