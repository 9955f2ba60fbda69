"""The gqa command line: generate and info on the embedded SmolLM2, errors as messages, not tracebacks; the flags,
--help texts and the messages before a model loads."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from gqa import __version__, convert, kernels
from gqa.bench.model import benchmark as bench_model
from gqa.cli import build_parser
from gqa.cli import main as cli
from gqa.decoding import generate as generation
from gqa.evaluation import perplexity as eval_scoring
from gqa.hardware import auto_dtype
from gqa.loaders import lazy
from gqa.loaders import model as api

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
    from gqa import kernels

    if kernels.vectorized():  # the default: the GGUF's own Q4_1/Q8_0 blocks, decoded by the native step
        assert "[decode: native step; activations " in res.stderr and "weights q4_1 63.3 MiB + q8_0" in res.stderr


def test_generate_float_dtype_dequantizes_and_quantize_flag():
    res = gqa("generate", "--raw", "The capital of France is", "--max-new-tokens", "4", "--dtype", "fp32", "--stats")
    assert res.returncode == 0, res.stderr
    assert "weights float32 513.1 MiB" in res.stderr  # 135M parameters, tied embeddings counted once
    res = gqa("generate", "--raw", "The capital of France is", "--max-new-tokens", "4", "--dtype", "fp32",
              "--quantize", "q8_0", "--stats")  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "as fp32, quantized to q8_0" in res.stderr and "weights q8_0 " in res.stderr and "Paris" in res.stdout


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
    # q8_0: 30 x 3 x (64 / 32 blocks x 34 bytes) x 2 = 12,240 bytes a token, 2**30 // 12,240 = 87,724 tokens in a GiB
    assert "| q8_0 | 8.5 | 35.86 KiB | 29,241 | 11.95 KiB | 87,724 | 3.98 KiB | 263,172 |" in out
    from gqa import kernels  # the same process state as the subprocess: this venv, this CPU

    scalar = "(no AVX2/AVX-512 here: scalar, so used for bf16 decode attention only)"
    assert (scalar in out) == (kernels.available() and not kernels.vectorized()), out
    simd = {16: "(AVX-512)", 8: "(AVX2)"}.get(kernels.simd_width())
    assert simd is None or simd in out, out


@pytest.mark.parametrize(
    "args,message",
    [
        (("info", "--model", "/nonexistent/model.gguf"), "no such file or folder"),
        (("info", "--kv-budget-gib", "0"), "--kv-budget-gib: must be a positive number of GiB"),
        (("info", "--tp", "0"), "--tp must be >= 1, got 0"),
        (("generate", "hi", "--top-p", "2"), "top_p must be in"),
        (("generate", "hi", "--max-new-tokens", "9000"), "exceeds the model's context"),
        (("serve", "--device", "tpu"), "--device must be cpu, cuda or cuda:N"),
        (("serve", "--device", "cuda:7"), "--device cuda:7: "),  # no CUDA here, or not that many devices
        (("serve", "--speculate", "17"), "--speculate must be in [0, 16]"),
        (("serve", "--header-timeout", "0"), "--header-timeout must be > 0"),
    ],
)
def test_errors_are_messages(args, message):
    res = gqa(*args)
    assert res.returncode == 2
    assert message in res.stderr and "Traceback" not in res.stderr


# ----------------------------------------------------------------------------------------------------------------
# First contact: flags, help, messages. In-process and without loading a model (each test is well under a second).


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    """``gqa ARGS`` in this process: ``(exit code, stdout, stderr)``; ``--help`` and argparse errors exit."""
    try:
        code = cli(list(args))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def stop(*args, **kwargs):
    raise ValueError("stopped before loading")


def test_version(capsys):
    code, out, _ = run_cli(capsys, "--version")
    assert code == 0 and out == f"gqa {__version__}\n"


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Every command's parser by its prog (``gqa bench attention``), recursively."""
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found[sub.prog] = sub
                found |= _subparsers(sub)
    return found


def test_help_shows_every_default_once():
    parsers = _subparsers(build_parser())
    assert {"gqa generate", "gqa info", "gqa eval", "gqa convert", "gqa bench attention", "gqa bench model"} <= set(
        parsers
    )
    for prog, parser in parsers.items():
        formatter = parser._get_formatter()
        for action in parser._actions:
            text = formatter._expand_help(action) if action.help else ""
            where = f"{prog} {'/'.join(action.option_strings) or action.dest}: {text!r}"
            assert text.count("(default") <= 1 and "(default " not in text, where  # one, always "(default: X)"
            has_default = action.default not in (None, False, argparse.SUPPRESS) and not isinstance(
                action, argparse._SubParsersAction
            )
            if has_default:
                assert "(default: " in text, where


@pytest.mark.parametrize(
    ("args", "shown"),
    [
        (
            ("generate", "--help"),
            [
                "stop after N new tokens (default: 128)",
                "--dtype {auto,fp32,bf16,fp16}",
                "--quantize {q4_0,q4_1,q5_0,q5_1,q8_0}",
            ],
        ),
        (("eval", "--help"), ["tokens per forward pass (default: 512)", "--dtype {auto,fp32,bf16}", "--decode"]),
        (("convert", "--help"), ["(default: pca)", "(default: 0, no healing)", "{auto,bf16,fp32}"]),
        (("bench", "model", "--help"), ["(default: 128 1024 4096; with --tp: 512)", "(default: fp32 bf16 q4_1)"]),
    ],
)
def test_help_texts(capsys, args, shown):
    code, out, _ = run_cli(capsys, *args)
    assert code == 0
    out = " ".join(out.split())  # argparse wraps to the terminal width
    for text in shown:
        assert text in out, text


def test_bench_is_a_group_of_benchmarks(capsys):
    code, out, _ = run_cli(capsys, "bench", "--help")
    assert code == 0 and out.startswith("usage: gqa bench [-h] {attention,model,startup,shared,serve} ...")
    lines = " ".join(out.split())
    assert "attention time gqa's attention backends" in lines and "model KV-cache size, prefill and decode" in lines
    assert "startup process wall time of import gqa" in lines and "shared decode tok/s alone and beside busy" in lines
    assert "what" not in out and "args" not in out and "REMAINDER" not in out
    for name, flag in (("attention", "--kv-heads H_KV"), ("model", "--engines"), ("shared", "--beside")):
        code, out, _ = run_cli(capsys, "bench", name, "--help")
        assert code == 0 and out.startswith(f"usage: gqa bench {name} [-h]") and flag in out
        assert "attention.py" not in out
    code, _, err = run_cli(capsys, "bench")
    assert code == 2 and "required: benchmark" in err
    code, _, err = run_cli(capsys, "bench", "attention", "--dtypes", "int8")
    assert code == 2 and "gqa bench attention: error: argument --dtypes: unknown dtype 'int8'" in err


@pytest.mark.parametrize(
    ("args", "dest", "value"),
    [
        (("generate", "hi", "--dtype", "float16"), "dtype", "fp16"),
        (("generate", "hi", "--dtype", "BF16"), "dtype", "bf16"),
        (("info", "--dtype", "bfloat16"), "dtype", "bf16"),
        (("info", "--dtype", "Float32"), "dtype", "fp32"),
        (("eval", "--dtype", "bfloat16"), "dtype", "bf16"),
        (("convert", "d", "--kv-heads", "1", "--heal-precision", "float32"), "heal_precision", "fp32"),
        (("convert", "d", "--kv-heads", "1", "--heal-precision", "BFloat16"), "heal_precision", "bf16"),
        (("convert", "d", "--kv-heads", "1", "--heal-precision", "Auto"), "heal_precision", "auto"),
        (("bench", "model", "--dtypes", "float32", "BF16"), "dtypes", ["fp32", "bf16"]),
        (("bench", "attention", "--dtypes", "FP16", "bfloat16"), "dtypes", [torch.float16, torch.bfloat16]),
    ],
)
def test_every_command_takes_the_same_dtype_spellings(args, dest, value):
    assert getattr(build_parser().parse_args(list(args)), dest) == value


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("generate", "hi", "--dtype", "half"), "argument --dtype: unknown dtype 'half'; choose from fp32, bf16, fp16"),
        (
            ("eval", "--dtype", "float16"),
            "--dtype: dtype 'float16' is not supported here; choose from auto, fp32, bf16",
        ),
        (("convert", "d", "--kv-heads", "1", "--heal-precision", "fp16"), "choose from auto, bf16, fp32"),
        (("bench", "model", "--dtypes", "fp16"), "choose from q8_0, q4_0, q4_1, q5_0, q5_1, gguf, fp32, bf16"),
    ],
)
def test_unknown_or_unsupported_dtypes_are_errors(capsys, args, message):
    code, _, err = run_cli(capsys, *args)
    assert code == 2 and message in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--prefix-cache-gib", "0"), "--prefix-cache-gib must be > 0, got 0.0"),
        (("--prefix-cache-gib", "nan"), "--prefix-cache-gib must be > 0, got nan"),
        (("--prefix-cache-dir", "/dev/null"), "--prefix-cache-dir /dev/null: not a directory"),
    ],
)
def test_prefix_cache_flags_name_themselves_in_errors(capsys, args, message):
    code, _, err = run_cli(capsys, "serve", *args)  # refused before a model is loaded
    assert code == 2 and message in err


@pytest.mark.parametrize(
    ("flags", "warning"),
    [
        (["--top-k", "5"], "--top-k has no effect at --temperature 0 (greedy decoding)"),
        (["--seed", "1", "--top-p", "0.9"], "--top-p and --seed have no effect at --temperature 0"),
        (["--temperature", "0", "--top-k", "5", "--top-p", "0.9", "--seed", "1"], "--top-k and --top-p and --seed"),
        (["--temperature", "0.7", "--top-k", "5", "--seed", "1"], None),
        ([], None),
    ],
)
def test_sampling_flags_under_greedy_decoding_warn(capsys, monkeypatch, flags, warning):
    monkeypatch.setattr(api, "load_model", stop)
    code, out, err = run_cli(capsys, "generate", "hi", *flags)
    assert code == 2 and "stopped before loading" in err and out == ""
    assert ("warning" in err) == (warning is not None), err
    if warning is not None:
        assert f"gqa generate: warning: {warning}" in err
        assert err.index("warning") < err.index("Loading")


class FakeTokenizer:
    eos_token_ids = (0,)

    def apply_chat(self, messages: list[dict]) -> list[int]:
        return [5, 6]

    def decode(self, ids: list[int]) -> str:
        return "".join("ab"[i % 2] for i in ids)


def test_generate_says_what_it_loads_on_stderr_and_keeps_stdout_for_the_text(capsys, monkeypatch):
    loaded = []

    def load_model(path, dtype, tensor_parallel=False, quantize=None, kv_dtype="auto", device="cpu"):
        loaded.append((path, dtype))
        return SimpleNamespace(tokenizer=FakeTokenizer())

    monkeypatch.setattr(api, "load_model", load_model)
    monkeypatch.setattr(generation, "generate_stream", lambda *a, **k: iter([[1], [2], [0]]))
    code, out, err = run_cli(capsys, "generate", "hi", "--dtype", "bfloat16")
    assert code == 0 and loaded == [(None, torch.bfloat16)]
    assert out == "ba\n"
    assert re.fullmatch(r"Loading embedded SmolLM2-135M-Instruct as bf16 \.\.\. \d+\.\d s\n", err), err


@pytest.mark.parametrize(
    ("args", "patch", "line"),
    [
        (("generate", "hi", "--model", "m.gguf", "--dtype", "fp32"), (api, "load_model"), "Loading m.gguf as fp32 ..."),
        (("info",), (lazy, "open_lazy"), "Loading embedded SmolLM2-135M-Instruct ..."),
        (
            ("generate", "hi"),
            (api, "load_model"),
            f"Loading embedded SmolLM2-135M-Instruct as {'bf16' if auto_dtype() == torch.bfloat16 else 'fp32'} (auto)",
        ),
        (
            ("eval", "--dtype", "bf16", "--reference", "r.gguf"),
            (eval_scoring, "evaluate"),
            "Loading embedded SmolLM2-135M-Instruct as bf16 and reference r.gguf as fp32, then scoring",
        ),
        (
            ("convert", "out", "--kv-heads", "1"),
            (convert, "run_conversion"),
            "Loading embedded SmolLM2-135M-Instruct layer by layer and converting it to 1 KV heads ...",
        ),
        (
            ("bench", "model"),
            (bench_model, "_variants"),
            "[bench model] embedded SmolLM2-135M-Instruct (9 query heads, 3 KV heads) as 9 3 1 KV heads",
        ),
    ],
)
def test_every_command_that_loads_a_model_says_so_first(capsys, monkeypatch, tmp_path, args, patch, line):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(*patch, stop)
    code, out, err = run_cli(capsys, *args)
    assert code == 2 and out == ""
    assert err.startswith(line), err
    assert err.splitlines()[-1].endswith(": error: stopped before loading")  # on a line of its own


def test_the_api_key_comes_from_the_flag_or_the_environment(monkeypatch):
    from gqa.cli.serve import api_key_of

    monkeypatch.delenv("GQA_API_KEY", raising=False)
    assert api_key_of(argparse.Namespace(api_key=None)) is None
    monkeypatch.setenv("GQA_API_KEY", "from-env")
    assert api_key_of(argparse.Namespace(api_key=None)) == "from-env"
    assert api_key_of(argparse.Namespace(api_key="flag")) == "flag"  # the flag wins
    monkeypatch.setenv("GQA_API_KEY", " ")
    with pytest.raises(ValueError, match="must not be empty"):
        api_key_of(argparse.Namespace(api_key=None))


@pytest.mark.parametrize("command", [("generate", "hi"), ("serve",)])
def test_kv_cache_dtype_flags_name_themselves_in_errors(capsys, command):
    code, _, err = run_cli(capsys, *command, "--kv-cache-dtype", "q5_1")
    assert code == 2 and "argument --kv-cache-dtype: invalid choice: 'q5_1'" in err
    code, _, err = run_cli(capsys, *command, "--kv-cache-dtype-v", "int8")
    assert code == 2 and "argument --kv-cache-dtype-v: invalid choice: 'int8'" in err


@pytest.mark.skipif(not kernels.available(), reason="native kernels not built on this machine")
def test_generate_with_a_quantized_kv_cache_and_a_float_one_of_another_dtype(capsys):
    code, out, _ = run_cli(capsys, "generate", "Hi", "--kv-cache-dtype-k", "q8_0", "--kv-cache-dtype-v", "q4_0",
                           "--max-new-tokens", "4")  # fmt: skip
    assert code == 0 and out.strip()
    code, _, err = run_cli(capsys, "generate", "Hi", "--dtype", "fp32", "--kv-cache-dtype", "bf16")
    assert code == 2 and "--kv-cache-dtype bf16 differs from the model's dtype fp32" in err


@pytest.mark.skipif(not kernels.available(), reason="native kernels not built on this machine")
def test_a_refused_kv_cache_dtype_is_named_by_the_flag_that_asked_for_it(capsys):
    """fp8 is refused on CPU; the error names the per-side flag the user gave (both, when both asked), else the
    common one."""
    expected = {
        ("--kv-cache-dtype-k", "fp8"): "--kv-cache-dtype-k fp8_e4m3 is read by the CUDA kernels only",
        ("--kv-cache-dtype-v", "fp8_e4m3"): "--kv-cache-dtype-v fp8_e4m3 is read by the CUDA kernels only",
        ("--kv-cache-dtype", "fp8"): "--kv-cache-dtype fp8_e4m3 is read by the CUDA kernels only",
        ("--kv-cache-dtype-k", "fp8", "--kv-cache-dtype-v", "fp8"): "--kv-cache-dtype-k / --kv-cache-dtype-v fp8_e4m3",
    }
    for flags, message in expected.items():
        code, _, err = run_cli(capsys, "generate", "Hi", "--max-new-tokens", "2", *flags)
        assert code == 2 and message in err, (flags, err)
    code, _, err = run_cli(capsys, "generate", "Hi", "--kv-cache-dtype-k", "q8_0", "--kv-cache-dtype-v", "fp8")
    assert code == 2 and "--kv-cache-dtype-v fp8_e4m3" in err and "--kv-cache-dtype-k" not in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--temperature", "1", "--seed", str(2**64)), "--seed must be in [-2**63, 2**64), got 18446744073709551616"),
        (("--raw", "--system", "You are a pirate"), "--system is a chat template's system message: it has no effect"),
        (("--device", "tpu"), "--device must be cpu, cuda or cuda:N, got 'tpu'"),
        (("--device", "cuda:7"), "--device cuda:7: "),  # no CUDA here, or not that many devices
        (("--temperature", "1", "--min-p", "-0.5"), "min_p must be in [0, 1], got -0.5"),
    ],
)
def test_generate_refuses_flags_it_cannot_honour_before_loading(capsys, flags, message):
    """Each exits 2 naming the flag, before any model is loaded (was: an overflow message without the flag, and
    --system silently dropped by --raw)."""
    code, _, err = run_cli(capsys, "generate", "Hi", *flags)
    assert code == 2 and message in err and "Loading" not in err, err
