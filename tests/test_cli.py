"""The gqa command line: generate and info on the embedded SmolLM2, errors as messages, not tracebacks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ENV = os.environ | {"HF_HUB_OFFLINE": "1"}


def gqa(*args: str, timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gqa", *args], capture_output=True, text=True, env=ENV, timeout=timeout
    )


def test_generate_chat_greedy():
    res = gqa("generate", "What is the capital of France? Answer in one word.", "--max-new-tokens", "12", "--stats")
    assert res.returncode == 0, res.stderr
    assert "Paris" in res.stdout
    assert "decode" in res.stderr and "tok/s" in res.stderr


def test_generate_raw_is_deterministic_and_respects_the_limit():
    a = gqa("generate", "--raw", "The three primary colours are", "--max-new-tokens", "6")
    b = gqa("generate", "--raw", "The three primary colours are", "--max-new-tokens", "6", "--temperature", "0")
    assert a.returncode == 0 and a.stdout == b.stdout and a.stdout.strip()
    assert len(a.stdout.split()) <= 8


def test_info_compares_kv_cache_with_mha_and_mqa():
    res = gqa("info")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "KV heads         3  (group size 3)" in out
    # SmolLM2: 30 layers x 3 KV heads x 64 x 2 (K, V) x 4 bytes (fp32) = 46,080 bytes = 45.0 KiB per token
    assert "| this model (GQA, 3 KV heads) | 3 | 45.0 KiB | 180.0 MiB |" in out
    assert "| MHA | 9 | 135.0 KiB | 540.0 MiB |" in out
    assert "| MQA | 1 | 15.0 KiB | 60.0 MiB |" in out
    from gqa import kernels  # the same process state as the subprocess: this venv, this CPU

    scalar = "(no AVX2/AVX-512 here: scalar, so used for bf16 decode attention only)"
    assert (scalar in out) == (kernels.available() and not kernels.vectorized()), out
    simd = {16: "(AVX-512)", 8: "(AVX2)"}.get(kernels.simd_width())
    assert simd is None or simd in out, out


@pytest.mark.parametrize(
    "args,message",
    [
        (("info", "--model", "/nonexistent/model.gguf"), "no such file or folder"),
        (("generate", "hi", "--top-p", "2"), "top_p must be in"),
        (("generate", "hi", "--max-new-tokens", "9000"), "exceeds the model's context"),
    ],
)
def test_errors_are_messages(args, message):
    res = gqa(*args)
    assert res.returncode == 2
    assert message in res.stderr and "Traceback" not in res.stderr
