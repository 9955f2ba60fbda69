"""``gqa.convert``: KV-head conversion of checkpoints — exact expansion, the GQA paper's mean-pooling and keep-first
baseline against hand computations, round trips, HF transformers loading the result, safe writing, the CLI.

Most tests use tiny random HF Llama/Qwen2 checkpoints; the SmolLM2 tests share two conversions (3 -> 9 -> 3).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers.checkpoints import by_hand, digest, logits_hf, tensors, tiny_dir

import gqa
from gqa.cli import main as cli
from gqa.convert import METHODS, AttentionWeights, convert, register_method
from gqa.loaders import default_model_path, read_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")


# ---------------------------------------------------------------------------------------------------------------------
# Helpers


def logits_ours(folder: Path | None, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    with torch.inference_mode():
        return gqa.load_model(folder, dtype=dtype, tokenizer=False)(ids)


IDS = torch.tensor([[1, 5, 3, 9, 4, 7, 2, 8, 6, 0, 3], [4, 4, 7, 1, 9, 3, 5, 2, 2, 6, 8]])  # (B=2, L=11)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """Tiny sources: Llama 8 query / 2 KV heads (tied), Qwen2 8 / 4 (biases, untied)."""
    root = tmp_path_factory.mktemp("tiny")
    return {"llama": tiny_dir(root / "llama", "llama", 8, 2), "qwen2": tiny_dir(root / "qwen2", "qwen2", 8, 4)}


# ---------------------------------------------------------------------------------------------------------------------
# Expansion is exact; converted folders load in gqa and in transformers


@pytest.mark.parametrize(("arch", "n"), [("llama", 4), ("llama", 8), ("qwen2", 8)])
def test_expansion_is_exact_and_loads_in_both(tiny, tmp_path, arch, n):
    src = tiny[arch]
    dst = convert(src, tmp_path / "out", kv_heads=n, method="first")  # the method is irrelevant when expanding
    assert dst == (tmp_path / "out").resolve()
    cfg, _ = read_model(dst)
    assert cfg.num_kv_heads == n and cfg.num_heads == 8
    assert ("lm_head.weight" in tensors(dst)) == (arch == "qwen2")  # tied: omitted, as HF saves it
    torch.testing.assert_close(logits_ours(dst, IDS, torch.float64), logits_ours(src, IDS, torch.float64),
                               atol=1e-12, rtol=0)  # fmt: skip
    ours = logits_ours(dst, IDS)
    torch.testing.assert_close(ours, logits_ours(src, IDS), atol=1e-5, rtol=0)
    torch.testing.assert_close(logits_hf(dst, IDS), ours, atol=1e-4, rtol=0)
    model = gqa.load_model(dst)  # the tokenizer came along, and encodes as the source's does
    assert model.tokenizer.encode("the cat sat on a mat") == gqa.load_tokenizer(src).encode("the cat sat on a mat")
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in dst.iterdir()
    }


def test_same_count_copies(tiny, tmp_path):
    dst = convert(tiny["qwen2"], tmp_path / "same", kv_heads=4)
    before, after = tensors(tiny["qwen2"]), tensors(dst)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k].float(), after[k]) for k in before)


def test_source_without_tokenizer_converts_with_a_warning(tmp_path):
    src = tiny_dir(tmp_path / "src")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (src / name).unlink()
    with pytest.warns(UserWarning, match="no usable tokenizer"):
        dst = convert(src, tmp_path / "out", kv_heads=1, method="mean")  # the default, pca, needs a tokenizer
    assert not (dst / "tokenizer.json").exists()
    assert gqa.load_model(dst, tokenizer=False).config.num_kv_heads == 1
    with pytest.raises(ValueError, match=r"calibrates on text, which needs the source"), pytest.warns(UserWarning):
        convert(src, tmp_path / "cal", kv_heads=1, calibration_text="the cat")


# ---------------------------------------------------------------------------------------------------------------------
# Reduction: mean and first against hand computations


@pytest.mark.parametrize("method", ["mean", "first"])
@pytest.mark.parametrize(("arch", "n"), [("qwen2", 2), ("qwen2", 1), ("llama", 1)])
def test_reduction_matches_hand_computation(tiny, tmp_path, method, arch, n):
    src = tiny[arch]
    h_kv = {"llama": 2, "qwen2": 4}[arch]
    dst = convert(src, tmp_path / "out", kv_heads=n, method=method)
    before, after = tensors(src), tensors(dst)
    assert set(after) == set(before)
    for name, w in before.items():
        if ".k_proj." in name or ".v_proj." in name:  # weights and biases
            assert after[name].shape == (n * 4, *w.shape[1:])
            torch.testing.assert_close(after[name], by_hand(w, h_kv, n, method), atol=1e-7, rtol=1e-6)
        else:  # q, o, MLP, norms, embeddings: untouched
            assert torch.equal(after[name], w), name
    assert read_model(dst)[0].num_kv_heads == n
    torch.testing.assert_close(logits_hf(dst, IDS), logits_ours(dst, IDS), atol=1e-4, rtol=0)


@pytest.mark.parametrize("method", ["mean", "first"])
def test_expand_then_reduce_recovers_the_weights(tiny, tmp_path, method):
    src = tiny["qwen2"]
    wide = convert(src, tmp_path / "wide", kv_heads=8)
    back = convert(wide, tmp_path / "back", kv_heads=4, method=method)
    before, after = tensors(src), tensors(back)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


# ---------------------------------------------------------------------------------------------------------------------
# The method registry and calibration activations


def test_registered_method_gets_calibration_activations(tiny, tmp_path):
    seen = []

    @register_method("test_last")
    def keep_last(w: AttentionWeights, cfg, num_kv_heads: int, activations):
        seen.append(None if activations is None else tuple(activations.shape))
        D, m = cfg.head_dim, cfg.num_kv_heads // num_kv_heads
        pick = [(j * m + m - 1) * D + r for j in range(num_kv_heads) for r in range(D)]
        return AttentionWeights(w.q, w.k[pick], w.v[pick], w.o, w.q_bias, w.k_bias[pick], w.v_bias[pick])

    try:
        with pytest.raises(ValueError, match="test_last"):
            register_method("test_last")(keep_last)  # names are unique
        dst = convert(tiny["qwen2"], tmp_path / "a", kv_heads=2, method="test_last", calibration_text="the cat sat")
        T = len(gqa.load_tokenizer(tiny["qwen2"]).encode("the cat sat"))
        assert seen == [(T, 24), (T, 24)]  # per layer: (T tokens, hidden)
        name = "model.layers.1.self_attn.k_proj.bias"  # heads 1 and 3 of 4 (D = 4) are kept
        assert torch.equal(tensors(dst)[name], tensors(tiny["qwen2"])[name][[4, 5, 6, 7, 12, 13, 14, 15]])
        convert(tiny["qwen2"], tmp_path / "b", kv_heads=2, method="test_last")
        assert seen[2:] == [None, None]

        @register_method("test_bad")
        def bad(w, cfg, num_kv_heads, activations):
            return w

        with pytest.raises(ValueError, match=r"method 'test_bad' returned k of shape \(16, 24\), expected \(8, 24\)"):
            convert(tiny["qwen2"], tmp_path / "c", kv_heads=2, method="test_bad")
        assert not (tmp_path / "c").exists()
    finally:
        METHODS.pop("test_last", None)
        METHODS.pop("test_bad", None)


# ---------------------------------------------------------------------------------------------------------------------
# Safety: never into the source, never over an existing folder unless forced, nothing half-written


def test_existing_destination_needs_force(tiny, tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "mine.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="--force"):
        convert(tiny["llama"], dst, kv_heads=4)
    assert [p.name for p in dst.iterdir()] == ["mine.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    convert(tiny["llama"], dst, kv_heads=4, force=True)
    assert not (dst / "mine.txt").exists() and read_model(dst)[0].num_kv_heads == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the old folder moved aside is gone


def test_destination_overlapping_the_source_is_refused(tiny, tmp_path):
    src = tiny_dir(tmp_path / "models" / "src")
    before = digest(tmp_path / "models")
    for dst in (src, src / "sub", tmp_path / "models"):
        with pytest.raises(ValueError, match="source"):
            convert(src, dst, kv_heads=4, force=True)
    gguf = default_model_path()
    for dst in (gguf, gguf.parent):
        with pytest.raises(ValueError, match="source"):
            convert(None, dst, kv_heads=9, force=True)
        with pytest.raises(ValueError, match="source"):
            convert(gguf, dst, kv_heads=9, force=True)
    convert(src, tmp_path / "elsewhere", kv_heads=1)
    assert digest(tmp_path / "models") == before  # the source was only read


@pytest.mark.parametrize("existing", [False, True])
def test_failure_mid_write_leaves_nothing(tiny, tmp_path, monkeypatch, existing):
    from gqa.convert.shards import ShardedWriter

    dst = tmp_path / "out"
    if existing:
        dst.mkdir()
        (dst / "mine.txt").write_text("keep me")
    before = digest(tmp_path)

    def fail(*args, **kwargs):
        raise RuntimeError("disk full (simulated)")

    monkeypatch.setattr(ShardedWriter, "write", fail)  # fails after the header of the weights is written
    with pytest.raises(RuntimeError, match="simulated"):
        convert(tiny["llama"], dst, kv_heads=4, force=True)
    assert digest(tmp_path) == before  # no temporary folder, DST as it was (absent, or the user's files)
    assert sorted(p.name for p in tmp_path.iterdir()) == (["out"] if existing else [])


# ---------------------------------------------------------------------------------------------------------------------
# Bad arguments


def test_bad_arguments(tiny, tmp_path):
    src, dst = tiny["llama"], tmp_path / "out"  # 8 query heads, 2 KV heads
    with pytest.raises(ValueError, match=r"kv_heads \(3\) must divide the number of query heads num_heads \(8\)"):
        convert(src, dst, kv_heads=3)
    with pytest.raises(ValueError, match="kv_heads must be a positive int, got 0"):
        convert(src, dst, kv_heads=0)
    with pytest.raises(ValueError, match="unknown method 'median'; known methods: ") as err:
        convert(src, dst, kv_heads=1, method="median")
    assert {"first", "mean"} <= set(str(err.value).split(": ", 1)[1].split(", "))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        convert(tmp_path / "nope", dst, kv_heads=1)
    with pytest.raises(TypeError, match="destination"):
        convert(src, kv_heads=1)
    odd = tiny_dir(tmp_path / "odd", heads=12, kv=4)
    with pytest.raises(ValueError, match=r"kv_heads \(6\) must be a multiple of the model's num_kv_heads \(4\)"):
        convert(odd, dst, kv_heads=6)
    with pytest.raises(ValueError, match=r"kv_heads \(3\) must divide the model's num_kv_heads \(4\)"):
        convert(odd, dst, kv_heads=3)
    assert not dst.exists()


def test_cli(tiny, tmp_path, capsys):
    dst = tmp_path / "out"
    assert cli(["convert", str(tiny["qwen2"]), str(dst), "--kv-heads", "1", "--method", "mean"]) == 0
    out = capsys.readouterr().out
    assert "KV heads 4 -> 1 (merged with method 'mean')" in out
    # 2 layers x 4 KV heads x 4 dims x 2 (K, V) x 4 bytes = 256 bytes per token, 64 after
    assert "KV cache     0.2 KiB -> 0.1 KiB per token in fp32 (0.25x)" in out
    assert f"wrote        {dst.resolve()}" in out
    assert cli(["convert", str(tiny["qwen2"]), str(dst), "--kv-heads", "8"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert cli(["convert", str(tiny["qwen2"]), str(dst), "--kv-heads", "8", "--force", "--method", "first"]) == 0
    assert "KV heads 4 -> 8 (expanded exactly)" in capsys.readouterr().out
    assert cli(["convert", str(tmp_path / "missing"), str(dst), "--kv-heads", "8"]) == 2
    assert "does not exist" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------------
# SmolLM2 (9 query heads, 3 KV heads): 3 -> 9 is exact, and 9 -> 3 with mean gives back the original weights


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    """The embedded SmolLM2 (config, weights and our model on them) and its conversions 3 -> 9 ("wide") and back to
    3 with ``mean`` ("back"); the ~540 MB folders are deleted afterwards."""
    from gqa.models import CausalLM

    root = tmp_path_factory.mktemp("smol")
    cfg, state = read_model(None)
    model = CausalLM(cfg).eval()
    model.load_state_dict(state | {"lm_head.weight": state["model.embed_tokens.weight"]}, assign=True)
    wide = convert(None, root / "wide", kv_heads=9)
    back = convert(wide, root / "back", kv_heads=3, method="mean")
    yield {"state": state, "model": model, "wide": wide, "back": back}
    shutil.rmtree(root, ignore_errors=True)


def test_smollm2_expansion_is_exact_in_gqa_and_transformers(smol):
    wide = gqa.load_model(smol["wide"], dtype=torch.float32)
    assert wide.config.num_kv_heads == 9 and wide.tokenizer.apply_chat("hi")  # tokenizer and chat template came along
    ids = torch.tensor([wide.tokenizer.encode("Grouped-query attention shares keys and values between heads.")])
    with torch.inference_mode():
        before, after = smol["model"](ids), wide(ids)
    del wide
    # same weights; only the float32 summation order of the attention kernels differs (logits are ~10-30)
    torch.testing.assert_close(after, before, atol=2e-4, rtol=1e-5)
    torch.testing.assert_close(logits_hf(smol["wide"], ids), after, atol=1e-4, rtol=1e-5)


def test_smollm2_expand_then_mean_recovers_the_weights(smol):
    cfg, back = read_model(smol["back"])
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.tie_word_embeddings) == (9, 3, True)
    original = smol["state"]
    assert original.keys() == back.keys()
    assert all(torch.equal(original[k], back[k]) for k in original)
