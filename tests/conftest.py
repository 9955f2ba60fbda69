"""Fixtures shared across test files."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _fresh_attention_routes():
    """Every test starts with no remembered attention routes (``gqa.attention.routes``): a test that changes the
    ``auto`` policy (monkeypatch) must not meet a route an earlier test stored."""
    from gqa.attention.routes import clear_routes

    clear_routes()
    yield
    clear_routes()


@pytest.fixture(scope="session")
def hf_smollm2() -> torch.nn.Module:
    """transformers' own SmolLM2 from the embedded GGUF (its GGUF reader and dequantizer: an independent reference),
    float32, eval mode; loaded once per session (~25 s on 2 cores). Read-only: tests must not change it."""
    transformers = pytest.importorskip("transformers")
    from gqa.loaders import default_model_path

    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, torch_dtype=torch.float32
    )
    return model.eval()
