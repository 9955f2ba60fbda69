"""Sampling arguments that are not numbers are refused up front, naming the argument: NaN or infinite temperature,
NaN top_p — before the prompt runs (not inside ``torch.multinomial`` at the first sampled token) and, on the command
line, with exit code 2 before the model loads."""

from __future__ import annotations

import math

import pytest
import torch

from gqa.cli import main
from gqa.decoding.generate import generate
from gqa.decoding.sampling import check_sampling
from gqa.models import CausalLM
from gqa.models.config import ModelConfig

BAD = [
    (math.nan, None, None, "temperature must be a finite number >= 0, got nan"),
    (math.inf, None, None, "temperature must be a finite number >= 0, got inf"),
    (-0.5, None, None, "temperature must be a finite number >= 0, got -0.5"),
    (0.7, math.nan, None, r"top_p must be in \(0, 1\], got nan"),
    (0.7, 1.5, None, r"top_p must be in \(0, 1\], got 1.5"),
    (0.7, None, math.nan, r"min_p must be in \[0, 1\], got nan"),
    (0.7, None, -0.1, r"min_p must be in \[0, 1\], got -0.1"),
    (0.7, None, 1.5, r"min_p must be in \[0, 1\], got 1.5"),
]


@pytest.mark.parametrize("temperature, top_p, min_p, message", BAD)
def test_check_sampling_refuses(temperature, top_p, min_p, message):
    with pytest.raises(ValueError, match=message):
        check_sampling(temperature, None, top_p, min_p)


@pytest.mark.parametrize("temperature, top_p, min_p, message", BAD)
def test_generate_refuses_before_running_the_model(temperature, top_p, min_p, message, monkeypatch):
    cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                      head_dim=8, eos_token_id=[1])  # fmt: skip
    model = CausalLM(cfg).eval()

    def ran(*args, **kwargs):
        raise AssertionError("the model ran before the sampling arguments were checked")

    monkeypatch.setattr(model, "forward", ran)
    with pytest.raises(ValueError, match=message):
        generate(model, [3, 4, 5], max_new_tokens=2, temperature=temperature, top_p=top_p, min_p=min_p)


@pytest.mark.parametrize("flags", [["--temperature", "nan"], ["--temperature", "inf"], ["--temperature", "0.5",
                                   "--top-p", "nan"], ["--temperature", "0.5", "--min-p", "2"]])  # fmt: skip
def test_cli_exits_2_naming_the_argument(flags, capsys):
    assert main(["generate", "Hi", *flags]) == 2
    err = capsys.readouterr().err
    assert "gqa generate: error:" in err and any(name in err for name in ("temperature", "top_p", "min_p"))
    assert "Traceback" not in err


def test_finite_temperatures_still_sample():
    from gqa.decoding.sampling import sample_next

    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample_next(logits), logits.argmax(-1))
    drawn = sample_next(logits, temperature=0.7, top_k=5, top_p=0.9, generator=torch.Generator().manual_seed(1))
    assert drawn.shape == (2,) and bool(((drawn >= 0) & (drawn < 10)).all())
