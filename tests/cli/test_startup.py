"""What ``import gqa`` and a first generation pull in: neither dynamo/inductor, transformers, triton nor gguf (they load
when first used), and the compiler marks that make this possible still mean what torch's own mean; ``gqa --help``
and ``gqa info``, which import no torch at all."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gqa
from gqa._compiler import assume_constant_result, disable
from gqa.cli import build_parser

HEAVY = ("torch._dynamo", "torch._inductor", "transformers", "triton", "gguf", "jinja2")


def loaded_after(code: str) -> set[str]:
    """Top-level heavy modules imported by ``code`` in a fresh interpreter (on top of ``import torch``)."""
    probe = f"import sys, torch; before = set(sys.modules); {code}; print(sorted(set(sys.modules) - before))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True)
    new = eval(out.stdout.strip().splitlines()[-1])
    return {h for h in HEAVY if any(m == h or m.startswith(h + ".") for m in new)}


def test_import_gqa_is_light():
    assert loaded_after("import gqa") == set()


@pytest.mark.parametrize("preset", [None, "ACTIVE"])
def test_import_gqa_first_makes_openmp_wait_passively_unless_set(preset):
    """``import gqa`` before torch sets ``OMP_WAIT_POLICY=PASSIVE`` (libgomp reads it when torch loads it); a value
    the user set is kept."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | (
        {"OMP_WAIT_POLICY": preset} if preset else {}
    )
    code = "import os, gqa, torch; print(os.environ['OMP_WAIT_POLICY'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == (preset or "PASSIVE")


def test_load_and_generate_stay_light():
    code = "import gqa; m = gqa.load_model(dtype='auto'); m.generate([m.tokenizer.apply_chat('Hi')], max_new_tokens=2)"
    assert loaded_after(code) == {"jinja2"}  # the chat template; nothing else


def test_assume_constant_result_is_torchs_mark():
    def f():
        return 1

    def g():
        return 1

    torch.compiler.assume_constant_result(f)
    assume_constant_result(g)
    assert {k: v for k, v in vars(g).items()} == {k: v for k, v in vars(f).items()} == {"_dynamo_marked_constant": True}


def test_disable_runs_eagerly_under_compile():
    calls = []

    @disable
    def side_effect(x):
        calls.append(torch.compiler.is_compiling())
        return x + 1

    counted = []

    def backend(gm, inputs):
        counted.append(gm)
        return gm.forward

    out = torch.compile(lambda x: side_effect(x * 2) * 3, backend=backend)(torch.ones(2))
    assert torch.equal(out, torch.full((2,), 9.0))
    assert calls == [False] and len(counted) == 2  # ran outside the graph, which broke in two around it


# ---------------------------------------------------------------------------------------------------------------------
# gqa --help and gqa info without torch (issue 34): each in a fresh interpreter, as a user runs them


def _commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command line under ``parser`` (``("bench", "attention")``, ...), recursively: a new one is checked too."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += [(*prefix, name), *_commands(sub, (*prefix, name))]
    return found


COMMANDS = _commands(build_parser())

# `gqa ARGS` as `python -m gqa` runs it; then a last line: whether torch and numpy were imported, and the exit code
_RUN_GQA = """
import json, runpy, sys
sys.argv = ["gqa", *ARGS]
code = None  # __main__ always exits
try:
    runpy.run_module("gqa", run_name="__main__", alter_sys=True)
except SystemExit as e:
    code = e.code
print("\\n" + json.dumps({"torch": "torch" in sys.modules, "numpy": "numpy" in sys.modules, "code": code}))
"""


def run_gqa(*args: str) -> tuple[dict, str]:
    """``gqa ARGS`` in a fresh interpreter: whether it imported torch and numpy and its exit code
    (``{"torch": bool, "numpy": bool, "code": int}``), and its stdout."""
    probe = _RUN_GQA.replace("ARGS", repr(list(args)))
    env = os.environ | {"HF_HUB_OFFLINE": "1", "COLUMNS": "120"}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    *lines, last = out.stdout.rstrip("\n").split("\n")
    return json.loads(last), "\n".join(lines)


@pytest.mark.parametrize("args", [("--help",), *((*c, "--help") for c in COMMANDS)], ids=" ".join)
def test_help_imports_neither_torch_nor_numpy(args):
    loaded, out = run_gqa(*args)
    assert loaded == {"torch": False, "numpy": False, "code": 0}, out
    assert out.startswith(f"usage: gqa {' '.join(args[:-1])}".rstrip()), out


def test_info_reads_metadata_only(tmp_path):
    loaded, out = run_gqa("info")
    assert loaded == {"torch": False, "numpy": True, "code": 0}, out  # numpy: the GGUF header's arrays
    assert "parameters       134.5 M" in out and "native kernels   " in out
    assert "weights          q4_1 63.3 MiB + q8_0 28.7 MiB + f32 137.2 KiB\n" in out  # the file's bytes by type
    loaded, out = run_gqa("info", "--model", str(hf_folder(tmp_path)), "--dtype", "bf16")
    assert loaded["torch"] is False and loaded["code"] == 0, out
    assert "| variant | KV heads | KV cache per token (bfloat16) | for 4096 tokens |" in out
    loaded, out = run_gqa("info", "--tp", "3")  # the per-rank table may import torch: the probe sees it
    assert loaded == {"torch": True, "numpy": True, "code": 0} and "tensor parallel over 3 ranks" in out, out


def hf_folder(tmp_path: Path) -> Path:
    """A small untied Qwen2 checkpoint (q/k/v biases) stored in bfloat16, random weights."""
    from safetensors.torch import save_file

    from gqa.loaders.expected import expected_shapes
    from gqa.models import ModelConfig

    cfg = ModelConfig(arch="qwen2", vocab_size=96, hidden_size=64, intermediate_size=80, num_layers=3, num_heads=8,
                      num_kv_heads=2, head_dim=8, attention_bias=True, tie_word_embeddings=False)  # fmt: skip
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg.to_hf()))
    save_file(
        {n: torch.randn(s, dtype=torch.bfloat16) for n, s in expected_shapes(cfg).items()}, folder / "model.safetensors"
    )
    return folder


@pytest.mark.parametrize("model", ["embedded", "hf"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_info_agrees_with_the_loaded_model(capsys, tmp_path, model, dtype):
    """What gqa info computes without torch, against the same from torch: the parameters of the loaded model, the
    KV cache of kv_cache_bytes in the dtype, the kernels as gqa.kernels reports them once loaded."""
    from gqa import kernels, load_model
    from gqa.cli import main as cli
    from gqa.options.dtypes import torch_dtype

    path = None if model == "embedded" else str(hf_folder(tmp_path))
    assert cli(["info", "--dtype", dtype] + ([] if path is None else ["--model", path])) == 0
    out = capsys.readouterr().out
    m = load_model(path, dtype=torch.float32, tokenizer=False)
    cfg = m.config
    assert f"parameters       {sum(p.numel() for p in m.parameters()) / 1e6:.1f} M\n" in out  # a tied head once
    per_token = gqa.kv_cache_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 1, dtype=torch_dtype(dtype))
    row = f"| this model (GQA, {cfg.num_kv_heads} KV heads) | {cfg.num_kv_heads} | {per_token / 1024:.1f} KiB | "
    assert row + f"{per_token * 4096 / 2**20:.1f} MiB |" in out, out
    assert f"KV cache per token ({torch_dtype(dtype)})".replace("torch.", "") in out
    if kernels.available():
        simd = {16: " (AVX-512)", 8: " (AVX2)"}.get(kernels.simd_width(), " (no AVX2/AVX-512 here")
        assert f"native kernels   built: {kernels.library_path()}{simd}" in out
    else:
        assert "native kernels   not built (python -m gqa.kernels)" in out


def test_kernels_probe_agrees_with_the_loaded_kernels():
    from gqa import kernels
    from gqa.kernels import probe

    assert probe.built_library() == (kernels.library_path() if kernels.available() else None)
    if kernels.available():
        assert probe.simd_width() == kernels.simd_width()
    code = "import sys; from gqa import kernels; print(kernels.library_path(), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split() == [str(kernels.library_path()), "False"]  # torch's version read without torch


def test_what_help_shows_is_what_the_torch_modules_use():
    """The choices and defaults defined without torch for --help are those of the modules that use them."""
    from gqa.bench.model import benchmark as bench_model
    from gqa.bench.model.arguments import DESCRIPTION
    from gqa.cache.sizes import ITEMSIZE
    from gqa.convert import METHODS
    from gqa.models import quantized
    from gqa.options import defaults as _options
    from gqa.options.dtypes import DTYPES, NAMES

    assert quantized.QUANTIZABLE == _options.QUANT_FORMATS
    assert sorted(_options.BUILTIN_METHODS) == sorted(METHODS)
    assert " ".join(bench_model.__doc__.split("\n\n")[0].split()) == DESCRIPTION
    assert {short: getattr(torch, name) for short, name in NAMES.items()} == DTYPES
    assert {name: getattr(torch, name).itemsize for name in ITEMSIZE} == ITEMSIZE
