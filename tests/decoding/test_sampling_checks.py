"""Sampling arguments that are not numbers are refused up front, naming the argument: NaN or infinite temperature,
NaN top_p — before the prompt runs (not inside ``torch.multinomial`` at the first sampled token) and, on the command
line, with exit code 2 before the model loads."""

from __future__ import annotations

import math
import re

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


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"max_new_tokens": 2.0}, "max_new_tokens must be an int >= 1, got 2.0"),
     ({"eos_token_ids": "x"}, "eos_token_ids must be token ids (ints), got 'x'"),
     ({"temperature": 1.0, "top_k": 2.5}, "top_k must be an int >= 1, got 2.5"),
     ({"temperature": 1.0, "seed": 2**70}, "seed must be an int in [-2**63, 2**64), got 1180591620717411303424")],
)  # fmt: skip
def test_generate_names_a_bad_argument(kwargs, message):
    """Each was an error from deep inside (``max_len must be ...``, ``'str' object``, ``topk(): argument 'k'``,
    ``Overflow when unpacking long long``); a single int for ``eos_token_ids`` is one id."""
    cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                      head_dim=8, eos_token_id=[1])  # fmt: skip
    model = CausalLM(cfg).eval()
    with pytest.raises(ValueError, match=re.escape(message)):
        generate(model, [3, 4, 5], **{"max_new_tokens": 2, **kwargs})
    assert generate(model, [3, 4, 5], max_new_tokens=2, eos_token_ids=7) == generate(
        model, [3, 4, 5], max_new_tokens=2, eos_token_ids=[7]
    )
