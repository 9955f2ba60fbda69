"""The least-squares ``o_proj`` refit after a merge: the solve against ``torch.linalg.lstsq``, exact where the merge
is exact, wired into ``convert`` / ``gqa convert --refit``, and better than the plain merge on SmolLM2."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.checkpoints import by_hand, tensors, tiny_refit_model

from gqa.cli import main as cli
from gqa.convert import convert, convert_state, refit_convert_state
from gqa.convert.refit import refit_output
from gqa.models import CausalLM, ModelConfig


def test_refit_output_is_the_least_squares_solution():
    g = torch.Generator().manual_seed(0)
    heads, W_true = torch.randn(300, 18, generator=g), torch.randn(7, 18, generator=g)
    Y = heads @ W_true.T + 0.1 * torch.randn(300, 7, generator=g)
    W0 = torch.randn(7, 18, generator=g)
    want = torch.linalg.lstsq(heads.double(), Y.double()).solution.T  # independent: QR-based least squares
    torch.testing.assert_close(refit_output(heads, Y, W0, ridge=0.0).double(), want, atol=1e-5, rtol=1e-5)
    # the ridge pulls towards W0: a huge one returns it, a small one moves only a little away from lstsq
    torch.testing.assert_close(refit_output(heads, Y, W0, ridge=1e6), W0, atol=1e-4, rtol=1e-4)
    lam = 1e-2 * (heads.double() ** 2).sum(0).mean()  # ridge * mean(diag(H^T H))

    def objective(W: torch.Tensor) -> float:
        W = W.double()
        return (((heads.double() @ W.T - Y.double()) ** 2).sum() + lam * ((W - W0.double()) ** 2).sum()).item()

    got = objective(refit_output(heads, Y, W0, ridge=1e-2))
    for other in (want, W0, want + 1e-3 * torch.randn(want.shape, generator=g, dtype=want.dtype)):
        assert got <= objective(other) * (1 + 1e-6)  # it minimises the ridge objective
    # data the anchor already fits exactly: the anchor, whatever the ridge
    for ridge in (0.0, 1e-2, 10.0):
        torch.testing.assert_close(refit_output(heads, heads @ W0.T, W0, ridge=ridge), W0, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("shapes", "ridge", "message"),
    [
        (((10, 6), (10, 4), (4, 5)), 0.0, r"got heads \(10, 6\), Y \(10, 4\), W0 \(4, 5\)"),
        (((10, 6), (9, 4), (4, 6)), 0.0, r"got heads \(10, 6\), Y \(9, 4\)"),
        (((10, 6), (10, 4), (4, 6)), -1.0, "ridge must be >= 0"),
    ],
)
def test_refit_output_bad_input(shapes, ridge, message):
    with pytest.raises(ValueError, match=message):
        refit_output(*(torch.zeros(s) for s in shapes), ridge=ridge)


@pytest.mark.parametrize("bias", [False, True])
def test_refit_after_an_exact_merge_changes_nothing(bias):
    """1 KV head expanded to 3 copies, merged back with pca and the refit (window 16, so several windows): the
    function of the original model."""
    cfg1, state = tiny_refit_model(bias, 1)
    cfg3, state3 = convert_state(cfg1, state, 3)
    calib = torch.randint(0, 64, (70,)).tolist()
    cfg_back, back = refit_convert_state(cfg3, state3, 1, "pca", calib, window=16)  # values refit too (default)
    assert cfg_back.num_kv_heads == 1
    ids = torch.randint(0, 64, (2, 40))
    with torch.inference_mode():
        want = CausalLM.from_state(cfg1, state)(ids)
        # float32 activations in the Grams: at ridge 3e-3 the copies' rank-deficient solve carries ~1e-4 of noise
        # (logits up to ~2.3); a wrong merge is off by ~0.1 or more
        torch.testing.assert_close(CausalLM.from_state(cfg_back, back)(ids), want, atol=3e-4, rtol=1e-4)


def test_refit_lowers_each_layers_error_on_the_calibration_text():
    """Layer 0 sees the same inputs with or without the refit, so its attention output error on the calibration
    windows can only go down; here it must go down a lot (the merge 3 -> 1 is far from exact)."""
    cfg, state = tiny_refit_model(True, 3)
    calib = torch.randint(0, 64, (200,)).tolist()
    plain_cfg, plain = refit_convert_state(cfg, state, 1, "pca", calib, ridge=1e9, value_steps=0)  # no refit
    _, refit = refit_convert_state(cfg, state, 1, "pca", calib)
    name = "model.layers.0.self_attn.o_proj.weight"
    torch.testing.assert_close(plain[name], convert_state(cfg, state, 1, "pca", _acts(cfg, state, calib))[1][name])
    ids = torch.tensor([calib[:64]])

    def error(weights: dict) -> float:
        source, merged = CausalLM.from_state(cfg, state), CausalLM.from_state(plain_cfg, weights)
        x = source.model.layers[0].input_layernorm(source.model.embed_tokens(ids))
        cs = source.model.rope.cos_sin(torch.arange(ids.shape[1]))
        y = [m.model.layers[0].self_attn(x, attn_mask=None, is_causal=True, rope_cos_sin=cs, cache=None)
             for m in (source, merged)]  # fmt: skip
        return ((y[1] - y[0]) ** 2).sum().item() / (y[0] ** 2).sum().item()

    with torch.inference_mode():
        assert error(refit) < 0.7 * error(plain), (error(refit), error(plain))


@pytest.mark.parametrize("steps", [-1, 1.5, True, "2"])
def test_refit_value_steps_bad(steps):
    cfg, state = tiny_refit_model(False, 3)
    with pytest.raises(ValueError, match="value_steps must be an int >= 0"):
        refit_convert_state(cfg, state, 1, "pca", list(range(20)), value_steps=steps)


def _acts(cfg: ModelConfig, state: dict, calib: list[int]) -> list[torch.Tensor]:
    """Layer inputs of the source on ``calib`` in windows of 64 (layer 0's do not depend on the merge)."""
    model, acts = CausalLM.from_state(cfg, state), []
    hooks = [layer.self_attn.register_forward_pre_hook(lambda _m, a: acts.append(a[0].flatten(0, 1)))
             for layer in model.model.layers]  # fmt: skip
    with torch.inference_mode():
        for i in range(0, len(calib), 64):
            model(torch.tensor([calib[i : i + 64]]))
    for h in hooks:
        h.remove()
    n = cfg.num_layers
    return [torch.cat(acts[i::n]) for i in range(n)]


def test_convert_refit_flag(tmp_path, capsys):
    from helpers.checkpoints import tiny_dir

    src = tiny_dir(tmp_path / "src", "llama", 8, 4)
    text = "the cat sat on a mat and the mat sat on a cat " * 8
    on = convert(src, tmp_path / "on", kv_heads=1, calibration_text=text)  # pca: refit by default
    off = convert(src, tmp_path / "off", kv_heads=1, calibration_text=text, refit=False)
    mean = convert(src, tmp_path / "mean", kv_heads=1, method="mean", calibration_text=text, refit=True)
    a, b, c, before = tensors(on), tensors(off), tensors(mean), tensors(src)
    o = "model.layers.1.self_attn.o_proj.weight"
    assert not torch.allclose(a[o], b[o])  # the refit moved o_proj
    k = "model.layers.1.self_attn.k_proj.weight"
    torch.testing.assert_close(c[k], by_hand(before[k], 4, 1, "mean"), atol=1e-7, rtol=1e-6)  # the merge as before
    assert not torch.allclose(c[o], before[o])  # and o_proj refit
    with pytest.raises(TypeError, match="refit must be a bool or None, got str"):
        convert(src, tmp_path / "x", kv_heads=1, refit="yes")
    assert cli(["convert", str(src), str(tmp_path / "cli"), "--kv-heads", "2", "--method", "mean", "--refit"]) == 0
    assert "merged with method 'mean', v_proj and o_proj refit" in capsys.readouterr().out
    assert cli(["convert", str(src), str(tmp_path / "cli2"), "--kv-heads", "2", "--no-refit"]) == 0
    assert "merged with method 'pca')" in capsys.readouterr().out


def test_refit_beats_the_plain_merge_on_smollm2():
    """``pca`` < ``pca`` + ``o_proj`` refit < ``pca`` + ``v_proj``/``o_proj`` refit, in perplexity on a short text
    that calibration never reads. The joint refit runs 2 of the default 24 value solves (each costs ~10 s of float64
    conjugate gradients here; 2 already beat the ``o_proj`` refit by 9%, 6 by 14%)."""
    from gqa.convert import _calibration_activations
    from gqa.convert.calibration import module_docstrings
    from gqa.loaders import load_tokenizer, read_model

    cfg, state = read_model(None)
    tok = load_tokenizer(None)
    text = module_docstrings()  # ~4.8k tokens: the refit's own default adds 170k characters more (slower)
    calib = tok.encode(text)
    held_out = (__doc__ or "") + " Grouped-query attention shares key and value heads between groups of query heads."
    ids = torch.tensor([tok.encode(held_out)])

    def ppl(c: ModelConfig, s: dict) -> float:
        with torch.inference_mode():
            logits = CausalLM.from_state(c, s)(ids[:, :-1])
        return math.exp(torch.nn.functional.cross_entropy(logits[0], ids[0, 1:]).item())

    plain = ppl(*convert_state(cfg, state, 1, "pca", _calibration_activations(cfg, state, tok, text)))
    o_only = ppl(*refit_convert_state(cfg, state, 1, "pca", calib, value_steps=0))
    refit = ppl(*refit_convert_state(cfg, state, 1, "pca", calib, value_steps=2))
    assert o_only < 0.8 * plain, (o_only, plain)
    assert refit < 0.95 * o_only, (refit, o_only)
