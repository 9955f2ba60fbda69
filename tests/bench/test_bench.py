"""The attention benchmark: tiny sizes through the whole pipeline, every peer adapter against the reference, the
skip paths, flag parsing and errors. CPU only and fast."""

from __future__ import annotations

import json
import math
import shlex

import pytest
import torch

import gqa.attention.backends
from gqa.bench.attention import benchmark as bench
from gqa.bench.attention.cases import CPU_QUICK, Case, build_cases, make_inputs
from gqa.bench.attention.implementations import (
    SDPA_KERNELS,
    Impl,
    _sdpa_kernel,
    flex_prepare,
    gqa_pytorch_available,
    implementations_for,
    repeat_kv,
)
from gqa.bench.attention.plots import PLOT_FILES
from gqa.bench.attention.report import fmt_ms, summary_table
from gqa.bench.attention.timing import TOLERANCE, check_calls, reference_output

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TINY = ["--quick", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "16", "--batches", "2", "--contexts", "24"]
TINY += ["--prefill-lens", "12", "--repeats", "2", "--warmup", "0", "--no-progress"]
PEERS = ("torch-sdpa", "hf-repeat_kv", "repeat_interleave", "gqa-pytorch")


def _tiny_cases() -> list[Case]:
    """Odd sizes, every kind, mask form and dtype: H_q=6, H_kv=2 (G=3), D=8, decode S=9 at B=2, prefill L=S=7."""
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        cases.append(Case("decode", dtype, 2, 6, 2, 1, 9, 8))
        cases += [Case("prefill", dtype, 2, 6, 2, 7, 7, 8, mask) for mask in ("causal", "bool", "additive")]
    return cases


def _check(case: Case, impls: dict) -> tuple:
    """Prepare and check ``{name: prepare}`` on fresh inputs, as the benchmark does."""
    inputs = make_inputs(case, torch.device("cpu"), seed=1)
    calls, refused = bench.prepare_calls([Impl(n, "test", "", p) for n, p in impls.items()], case, inputs)
    check = check_calls(calls, reference_output(inputs), *TOLERANCE[case.dtype])
    check.skipped.update(refused)
    return check, inputs


# ----------------------------------------------------------------------------------------------------------------
# The whole pipeline


def test_tiny_run_writes_json_markdown_and_pngs(tmp_path, capsys):
    out_json, out_md, plots = tmp_path / "run.json", tmp_path / "md" / "run.md", tmp_path / "plots"
    rc = bench.main([*TINY, "--json", out_json, "--markdown", out_md, "--plots", plots])
    stdout, _err = capsys.readouterr()
    assert rc == 0, stdout

    payload = json.loads(out_json.read_text())
    for key in ("machine", "limits", "grid", "rows", "implementations", "counting", "tolerance", "settings"):
        assert key in payload
    assert payload["complete"] is True
    for key in ("torch", "torch_threads", "cpu_model", "platform", "device"):
        assert payload["machine"][key]
    limits = payload["limits"]
    assert limits["read_gbps"] > 0 and set(limits["gemm_gflops"]) == {"float32", "bfloat16"}
    assert all(v > 0 for v in limits["gemm_gflops"].values())

    names = [impl["name"] for impl in payload["implementations"]]
    assert names[: len(gqa.attention.backends.BACKENDS) + 1] == [*gqa.attention.backends.BACKENDS, "auto"]
    assert set(PEERS) <= set(names) and not set(SDPA_KERNELS) & set(names)  # the CUDA-only ones stay off on CPU
    rows = payload["rows"]
    # decode (B=2, S=24) + prefill (L=S=12) x 3 mask forms, for fp32 and bf16
    assert [(r["kind"], r["dtype"], r["mask"]) for r in rows] == [
        (kind, dtype, mask)
        for kind, masks in (("decode", ["none"]), ("prefill", ["causal", "bool", "additive"]))
        for dtype in ("float32", "bfloat16")
        for mask in masks
    ]
    for r in rows:
        assert r["status"] == "ran" and r["mismatches"] == [] and r["errors"] == {}
        assert (r["B"], r["H_q"], r["H_kv"], r["D"]) == ((2, 4, 2, 16) if r["kind"] == "decode" else (1, 4, 2, 16))
        ran = {name for name, ms in r["median_ms"].items() if ms is not None}
        expected_skips = {"gqa-pytorch"} if r["mask"] == "additive" else set()
        assert set(r["skipped"]) == expected_skips | (set(names) - ran - expected_skips)
        assert {"reference", "grouped", "auto", "torch-sdpa", "hf-repeat_kv", "repeat_interleave"} <= ran
        assert ("gqa-pytorch" in ran) == (r["mask"] != "additive" and gqa_pytorch_available())
        for name in ran:
            assert len(r["times_ms"][name]) == 2 and r["median_ms"][name] > 0
            assert r["error_over_tolerance"][name] <= 1.0
            assert r["rate"][name] > 0 and r["fraction_of_limit"][name] > 0
        assert r["metric"] == ("GB/s" if r["kind"] == "decode" else "GFLOP/s")
        assert r["limit"] == (limits["read_gbps"] if r["kind"] == "decode" else limits["gemm_gflops"][r["dtype"]])
    if gqa_pytorch_available():
        additive = next(r for r in rows if r["mask"] == "additive")
        assert "bool masks only" in additive["skipped"]["gqa-pytorch"]

    markdown = out_md.read_text()
    assert markdown == stdout  # the same report on stdout and in the file
    for heading in ("### Decode (L=1), median ms", "### Causal prefill (L=S), median ms", "### Not run, and why"):
        assert heading in markdown
    assert "GB/s" in markdown and "GFLOP/s" in markdown
    decode_rows = [line for line in markdown.splitlines() if line.startswith("| fp32 | 2 | 2 | 24 |")]
    assert len(decode_rows) == 1

    for name in PLOT_FILES:
        data = (plots / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000
        from PIL import Image

        with Image.open(plots / name) as image:
            image.verify()
    leftovers = [p.name for p in tmp_path.rglob(".*")]
    assert leftovers == []  # every temporary file was renamed into place

    # --from-json re-renders the same report without measuring
    again = tmp_path / "again.md"
    assert bench.main(["--from-json", out_json, "--markdown", again]) == 0
    assert again.read_text() == markdown


def test_cli_entry_runs_the_attention_benchmark(capsys, tmp_path):
    from gqa.cli import main as cli

    flags = [*TINY, "--kinds", "decode", "--dtypes", "Float32", "--json", str(tmp_path / "run.json")]
    assert cli(["bench", "attention", *flags]) == 0
    assert "### Decode (L=1), median ms" in capsys.readouterr().out
    payload = json.loads((tmp_path / "run.json").read_text())
    assert payload["command"] == "gqa bench attention " + shlex.join(flags) and payload["dtypes"] == ["float32"]


# ----------------------------------------------------------------------------------------------------------------
# Implementations against the reference


@pytest.mark.parametrize("case", _tiny_cases(), ids=lambda c: c.label)
def test_every_implementation_agrees_with_the_reference(case):
    impls = {impl.name: impl.prepare for impl in implementations_for(torch.device("cpu"))}
    # The CUDA-only adapters, run on CPU here: SDPA held to its math and CPU flash kernels, and eager FlexAttention.
    impls["sdpa-math"] = _sdpa_kernel(SDPA_KERNELS["sdpa-math"])
    impls["sdpa-flash"] = _sdpa_kernel(SDPA_KERNELS["sdpa-flash"])
    impls["flex"] = lambda c, i: flex_prepare(c, i, compile=False)
    with torch.inference_mode():
        check, _ = _check(case, impls)
    assert check.errors == {}
    assert check.mismatches == [], {n: check.error_ratio.get(n) for n in check.mismatches}
    allowed = {"gqa-pytorch"} if case.mask == "additive" or not gqa_pytorch_available() else set()
    allowed |= {"sdpa", "sdpa-flash"}  # may refuse (torch's math path / flash limits) depending on the case
    assert set(check.skipped) <= allowed | (set(gqa.attention.backends.BACKENDS) - {"reference", "grouped", "sdpa"})
    assert {"reference", "grouped", "auto", "sdpa-math", "flex", *PEERS} - set(allowed) <= set(check.error_ratio)


def _wrong_package_scale(case, inputs):
    from grouped_query_attention_pytorch.attention import scaled_dot_product_gqa

    q, k, v = (t.transpose(1, 2) for t in (inputs.q, inputs.k, inputs.v))  # (B, L, H, D)
    causal = True if inputs.is_causal else None
    # The mistake the adapter must not make: passing the multiplying scale to a function that divides by it.
    return lambda: scaled_dot_product_gqa(q, k, v, scale=case.head_dim**-0.5, is_causal=causal)[0].transpose(1, 2)


def _wrong_head_mapping(case, inputs):
    k, v = (t.repeat(1, case.group, 1, 1) for t in (inputs.k, inputs.v))  # tiles heads: query head i -> i % H_kv
    return lambda: torch.nn.functional.scaled_dot_product_attention(inputs.q, k, v, is_causal=inputs.is_causal)


def _top_left_causal(case, inputs):
    return lambda: torch.nn.functional.scaled_dot_product_attention(
        inputs.q, inputs.k, inputs.v, is_causal=True, enable_gqa=True
    )


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_the_check_catches_wrong_adapters(kind):
    case = next(c for c in _tiny_cases() if c.kind == kind and c.mask in ("none", "causal"))
    wrong = {"head-mapping": _wrong_head_mapping}
    if gqa_pytorch_available():
        wrong["package-scale"] = _wrong_package_scale
    if kind == "decode":
        wrong["top-left-causal"] = _top_left_causal  # L=1: torch's is_causal would hide all keys but the first
    with torch.inference_mode():
        check, _ = _check(case, wrong)
    assert sorted(check.mismatches) == sorted(wrong)


def test_hf_repeat_kv_is_transformers_repeat_kv():
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    kv = torch.randn(2, 3, 5, 4)
    for n_rep in (1, 4):
        assert torch.equal(repeat_kv(kv, n_rep), llama.repeat_kv(kv, n_rep))


# ----------------------------------------------------------------------------------------------------------------
# What does not run is recorded, never a crash


def test_refusals_and_errors_are_recorded():
    case = _tiny_cases()[0]

    def raising(exc):
        def prepare(case, inputs):
            def call():
                raise exc

            return call

        return prepare

    impls = {
        "ok": lambda c, i: lambda: torch.nn.functional.scaled_dot_product_attention(i.q, i.k, i.v, enable_gqa=True),
        "value": raising(ValueError("not this shape")),
        "notimpl": raising(NotImplementedError("no kernel")),
        "runtime": raising(RuntimeError("No available kernel")),
        "bug": raising(TypeError("adapter bug")),
    }
    check, _ = _check(case, impls)
    assert check.skipped == {
        "value": "ValueError: not this shape",
        "notimpl": "NotImplementedError: no kernel",
        "runtime": "RuntimeError: No available kernel",
    }
    assert check.errors == {"bug": "TypeError: adapter bug"} and check.mismatches == []
    assert check.error_ratio["ok"] <= 1.0


def test_a_backend_added_to_BACKENDS_is_benchmarked_and_its_refusals_recorded(monkeypatch, tmp_path, capsys):
    reference = gqa.attention.backends.BACKENDS["reference"]

    def fused(query, key, value, *, shape, attn_mask, is_causal, **kwargs):
        if shape.L > 1:
            raise NotImplementedError("fused: decode only")
        if query.dtype != torch.float32:
            raise RuntimeError("fused: float32 only")
        return reference(query, key, value, shape=shape, attn_mask=attn_mask, is_causal=is_causal, **kwargs)

    monkeypatch.setitem(gqa.attention.backends.BACKENDS, "fused", fused)
    out_json = tmp_path / "run.json"
    assert bench.main([*TINY, "--masks", "causal", "--json", out_json]) == 0
    rows = {(r["kind"], r["dtype"]): r for r in json.loads(out_json.read_text())["rows"]}
    assert rows["decode", "float32"]["median_ms"]["fused"] > 0
    assert rows["decode", "bfloat16"]["skipped"]["fused"] == "RuntimeError: fused: float32 only"
    assert rows["prefill", "float32"]["skipped"]["fused"] == "NotImplementedError: fused: decode only"
    out = capsys.readouterr().out
    assert "- **fused** (2 cases: prefill fp32 H_kv=2 L=S=12 causal; prefill bf16 H_kv=2 L=S=12 causal): " in out
    assert "- **fused** (1 case: decode bf16 B=2 H_kv=2 S=24): RuntimeError: fused: float32 only" in out


def test_memory_and_time_limits_skip_with_a_reason():
    case = Case("prefill", torch.float32, 1, 4, 2, 12, 12, 16, "causal")
    impls = [i for i in implementations_for(torch.device("cpu")) if i.name in ("grouped", "torch-sdpa")]
    big = Impl("hungry", "peer", "needs a lot", lambda c, i: lambda: i.q, lambda c, i: 2**50)
    settings = bench.CPU_SETTINGS["quick"]
    row = bench.run_case(case, [*impls, big], device=torch.device("cpu"), settings=settings, repeats=2,
                         budget=2**30, seed=0)  # fmt: skip
    assert "memory budget" in row["skipped"]["hungry"] and row["median_ms"]["hungry"] is None
    assert row["median_ms"]["grouped"] > 0

    slow = bench.Settings(**{**settings.__dict__, "max_call_s": 1e-9})
    row = bench.run_case(case, impls, device=torch.device("cpu"), settings=slow, repeats=2, budget=2**30, seed=0)
    assert all("checked, not timed" in row["skipped"][i.name] for i in impls)
    assert row["not_timed"] == ["grouped", "torch-sdpa"] and row["median_ms"]["grouped"] is None
    table = summary_table([row], ["grouped", "torch-sdpa"], "prefill")
    assert f"({fmt_ms(row['first_call_ms']['grouped'])})" in table  # the one checked call, marked as such
    assert all(row["error_over_tolerance"][i.name] <= 1.0 for i in impls)  # still checked


def test_a_case_over_the_memory_budget_is_skipped(tmp_path, capsys):
    out_json = tmp_path / "run.json"
    assert (
        bench.main([*TINY, "--kinds", "decode", "--dtypes", "fp32", "--mem-budget-gb", "1e-9", "--json", out_json]) == 0
    )
    (row,) = json.loads(out_json.read_text())["rows"]
    assert row["status"] == "skipped" and "memory budget" in row["skip_reason"]
    assert "**whole case**" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------------------------
# Sizes, counting and flags


def test_counting():
    decode = Case("decode", torch.bfloat16, 8, 32, 8, 1, 4096, 128)
    assert decode.kv_bytes == 2 * 8 * 8 * 4096 * 128 * 2
    assert decode.min_bytes == decode.kv_bytes + 2 * 8 * 32 * 1 * 128 * 2  # + q read + out written
    assert decode.flops == 4 * 128 * 8 * 32 * 4096
    prefill = Case("prefill", torch.float32, 1, 32, 8, 4, 4, 128, "bool")
    assert prefill.visible_pairs == 1 + 2 + 3 + 4  # the causal triangle, diagonal included
    assert prefill.flops == 4 * 128 * 32 * 10
    assert Case("prefill", torch.float32, 1, 2, 1, 2, 5, 4, "causal").visible_pairs == 4 + 5  # bottom-right, L < S


def test_quick_and_size_flags_resolve():
    parser = bench.build_parser()
    cpu = torch.device("cpu")
    assert bench.resolve_grid(parser.parse_args(["--quick"]), cpu) == CPU_QUICK
    grid = bench.resolve_grid(parser.parse_args(["--quick", "--contexts", "1k", "4K", "1024"]), cpu)
    assert grid.decode == ((8, 1024), (8, 4096))
    grid = bench.resolve_grid(parser.parse_args(["--batches", "1", "32", "--prefill-lens", "2k"]), cpu)
    assert grid.decode == tuple((b, s) for b in (1, 32) for s in (1024, 2048, 4096, 8192, 16384))
    assert grid.prefill == (2048,)
    cases = build_cases(CPU_QUICK, ["decode", "prefill"], [torch.float32, torch.bfloat16], [32, 8, 4, 1])
    assert len(cases) == 2 * 4 * (len(CPU_QUICK.decode) + 3 * len(CPU_QUICK.prefill))
    assert max(c.kv_len for c in cases if c.kind == "decode") <= 2048  # --quick stays small
    assert {c.batch for c in cases if c.kind == "decode"} == {1, 8, 32}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--kv-heads", "3"], "must divide H_q=32"),
        (["--dtypes", "int8"], "unknown dtype 'int8'"),
        (["--contexts", "4q"], "expected a size like 4096 or 4k"),
        (["--batches", "0"], "must be >= 1"),
        (["--impls", "nope"], "--impls: unknown ['nope']"),
        (["--kinds", "train"], "invalid choice: 'train'"),
        (["--device", "tpu"], "only cpu and cuda"),
        (["--max-call-s", "-1"], "must be > 0"),
        (["--warmup", "-1", "--kinds", "decode"], "--warmup must be >= 0"),
    ],
)
def test_bad_flags_give_clear_errors(flags, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(flags)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_output_paths_give_clear_errors(tmp_path, capsys):
    a_file = tmp_path / "file.png"
    a_file.write_bytes(b"keep me")
    cases = [
        (["--json", tmp_path], "is a directory"),
        (["--json", tmp_path / "x", "--markdown", tmp_path / "x"], "point at the same file"),
        (["--plots", a_file], "exists and is not a directory"),
        (["--from-json", a_file], "--from-json"),
    ]
    for flags, message in cases:
        with pytest.raises(SystemExit):
            bench.main(flags)
        assert message in capsys.readouterr().err
    assert a_file.read_bytes() == b"keep me"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_cuda_on_a_cpu_only_machine_is_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--device", "cuda"])
    assert "CUDA is not available" in capsys.readouterr().err


def test_tolerances_are_meaningful():
    for dtype, (atol, rtol) in TOLERANCE.items():
        assert 0 < atol < 0.05 and 0 < rtol < 0.05, dtype
    assert math.isclose(TOLERANCE[torch.bfloat16][1], 2 * 2**-7)


def test_backward_times_forward_and_backward_with_gradients_checked(tmp_path, capsys):
    out = tmp_path / "bwd.json"
    flags = ["--backward", "--q-heads", "6", "--head-dim", "16", "--kv-heads", "6", "2", "1", "--dtypes", "fp32",
             "bf16", "--prefill-lens", "48", "--repeats", "1", "--json", str(out)]  # fmt: skip
    assert bench.main(flags) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["dtype"], r["H_kv"]) for r in rows] == [(d, h) for d in ("float32", "bfloat16") for h in (6, 2, 1)]
    for r in rows:
        assert not r["errors"] and r["ms"]["gqa auto"] > 0 and r["tflops"]["gqa auto"] > 0
        assert r["grad_rel_err"]["gqa auto"] < (1e-5 if r["dtype"] == "float32" else 4e-2)
    assert "auto vs best SDPA" in capsys.readouterr().out


def test_backward_catches_wrong_gradients(monkeypatch, capsys):
    real = gqa.grouped_attention
    monkeypatch.setattr(gqa, "grouped_attention", lambda *a, **kw: real(*a, **kw) * 1.01)
    flags = ["--backward", "--q-heads", "4", "--head-dim", "8", "--kv-heads", "1", "--dtypes", "fp32",
             "--prefill-lens", "32", "--repeats", "1"]  # fmt: skip
    assert bench.main(flags) == 1
    assert "gradients differ from SDPA's" in capsys.readouterr().out


def test_variants_time_window_softcap_and_sinks_each_checked(tmp_path, capsys):
    """``--variants``: one decode row per (dtype, H_kv) with plain, window, band mask, softcap and sinks timed; the
    window's bytes are the window's."""
    out = tmp_path / "variants.json"
    flags = ["--variants", "--q-heads", "6", "--head-dim", "16", "--kv-heads", "2", "1", "--dtypes", "fp32", "bf16",
             "--contexts", "640", "--window", "64", "--repeats", "1", "--json", str(out)]  # fmt: skip
    assert bench.main(flags) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["dtype"], r["H_kv"], r["S"], r["W"]) for r in rows] == [
        (d, h, 640, 64) for d in ("float32", "bfloat16") for h in (2, 1)
    ]
    for r in rows:
        assert not r["errors"] and set(r["ms"]) == {"plain", "window", "band mask", "softcap", "sinks"}
        item = 4 if r["dtype"] == "float32" else 2
        assert r["gbs"]["window"] == pytest.approx(2 * r["H_kv"] * 64 * 16 * item / (r["ms"]["window"] * 1e-3) / 1e9)
    assert "window GB/s" in capsys.readouterr().out


def test_variants_catch_a_wrong_window(monkeypatch, capsys):
    """A windowed call that attends to keys outside its window is an error of that variant, not a timing."""
    real = gqa.grouped_attention

    def leaky(*args, window=None, **kwargs):
        return real(*args, **kwargs)  # the window dropped

    monkeypatch.setattr(gqa, "grouped_attention", leaky)
    flags = ["--variants", "--q-heads", "4", "--head-dim", "8", "--kv-heads", "1", "--dtypes", "fp32",
             "--contexts", "256", "--window", "16", "--repeats", "1"]  # fmt: skip
    assert bench.main(flags) == 1
    assert "window: differs from its reference" in capsys.readouterr().out
