"""``benchmarks/gpu_check.py``, the prepared GPU check: its flags and errors, and its CPU dry mode end to end (every
step on tiny shapes, the JSON and markdown it writes). What it measures on a GPU is in docs/performance.md."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.scripts import load_benchmark


@pytest.fixture(scope="module")
def gpu_check():
    return load_benchmark("gpu_check")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dry", "--budget-s", "0"], "--budget-s must be > 0"),
        (["--dry", "--steps", "nope"], "invalid choice: 'nope'"),
        (["--dry", "--budget-s", "soon"], "invalid float value"),
    ],
)
def test_bad_flags_exit_2(gpu_check, argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        gpu_check.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_out_must_be_a_folder(gpu_check, tmp_path, capsys):
    target = tmp_path / "file.txt"
    target.write_text("mine")
    with pytest.raises(SystemExit) as exc:
        gpu_check.parse_args(["--dry", "--out", str(target)])
    assert exc.value.code == 2
    assert "is not a folder" in capsys.readouterr().err
    assert target.read_text() == "mine"  # untouched


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_a_gpu_it_says_so(gpu_check, capsys):
    with pytest.raises(SystemExit) as exc:
        gpu_check.parse_args(["--out", "x"])
    assert exc.value.code == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_dry_run_writes_every_step(gpu_check, tmp_path):
    out = tmp_path / "check"
    steps = ["machine", "tests", "kernel", "decode", "model", "backward", "variants"]
    code = gpu_check.main(["--dry", "--out", str(out), "--steps", *steps])
    assert code == 0
    result = json.loads((out / "gpu_check.json").read_text())
    assert set(result["steps"]) == set(steps)
    assert all(step["ok"] for step in result["steps"].values()), result["steps"]
    assert result["machine"]["copy_gbs"] > 0
    assert result["tests"]["returncode"] == 0 and "collected" in result["tests"]["tail"]  # pytest -m cuda, collected
    rows = result["decode"]["rows"]
    assert rows and all(r["status"] == "ran" and not r["mismatches"] for r in rows)
    (model,) = result["model"]
    assert model["logits_rel_err_fp32"] < 1e-5  # gqa and HF transformers on the same random weights
    (variants,) = result["variants"]
    assert not variants["errors"] and set(variants["ms"]) == {"plain", "window", "band mask", "softcap", "sinks"}
    assert model["agreement_hf"] == 1.0 and not model["errors"]
    assert model["tokens_per_s"]["gqa"] > 0 and model["tokens_per_s"]["hf"] > 0 and model["decode_gbs"] > 0
    (backward,) = result["backward"]
    assert not backward["errors"] and backward["tflops"]["gqa auto"] > 0 and backward["auto_vs_best_sdpa"] > 0
    text = (out / "gpu_check.md").read_text()
    assert "## Attention decode" in text and "## Whole-model greedy decode" in text
    assert "## Prefill forward + backward" in text
    assert not list(out.glob(".*.tmp"))  # written atomically


def test_markdown_marks_failed_and_skipped_rows(gpu_check):
    result = {
        "machine": {"device": "cuda", "copy_gbs": 4000.0},
        "decode": {"rows": [{"B": 1, "H_kv": 8, "L": 1, "S": 1024, "status": "skipped", "skip_reason": "memory"}]},
        "model": [{"name": "m", "B": 1, "error": "RuntimeError: boom"}],
    }
    text = gpu_check.markdown(result)
    assert "skipped: memory" in text and "failed: RuntimeError: boom" in text


def test_dry_serve_and_kv_steps_serve_the_random_model(gpu_check, tmp_path):
    """The serving steps' plumbing on CPU: random SmolLM2-shaped weights (2 layers) with SmolLM2's tokenizer behind
    ``gqa bench serve``; MQA (converted) beside it."""
    from gqa import kernels

    if not kernels.vectorized():
        pytest.skip("gqa serve on CPU needs the native SIMD kernels")
    out = tmp_path / "check"
    assert gpu_check.main(["--dry", "--out", str(out), "--steps", "serve", "kv"]) == 0
    result = json.loads((out / "gpu_check.json").read_text())
    (served,) = result["serve"]["rows"]
    assert [load["clients"] for load in served["loads"]] == [1, 2]
    assert all(not load["errors"] and load["tokens"] > 0 for load in served["loads"])
    assert served["loads"][1]["differ_from_alone"] == 0
    assert len(result["kv"]["rows"]) == 2  # the model as it is, and converted to 1 KV head
    assert "## gqa serve on the GPU" in (out / "gpu_check.md").read_text()
