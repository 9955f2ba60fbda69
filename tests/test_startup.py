"""What ``import gqa`` and a first generation pull in: neither dynamo/inductor, transformers, triton nor gguf (they load
when first used), and the compiler marks that make this possible still mean what torch's own mean."""

from __future__ import annotations

import subprocess
import sys

import torch

from gqa._compiler import assume_constant_result, disable

HEAVY = ("torch._dynamo", "torch._inductor", "transformers", "triton", "gguf", "jinja2")


def loaded_after(code: str) -> set[str]:
    """Top-level heavy modules imported by ``code`` in a fresh interpreter (on top of ``import torch``)."""
    probe = f"import sys, torch; before = set(sys.modules); {code}; print(sorted(set(sys.modules) - before))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True)
    new = eval(out.stdout.strip().splitlines()[-1])
    return {h for h in HEAVY if any(m == h or m.startswith(h + ".") for m in new)}


def test_import_gqa_is_light():
    assert loaded_after("import gqa") == set()


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
