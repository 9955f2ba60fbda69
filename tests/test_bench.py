"""Smoke test of the attention benchmark: tiny sizes, every implementation timed, checked and reported."""

from __future__ import annotations

import json

from gqa.bench.attention import (
    IMPLEMENTATIONS,
    QUICK,
    TOLERANCE,
    build_cases,
    check_outputs,
    main,
    make_implementations,
)

TINY = ["--decode-len", "64", "--prefill-len", "32", "--head-dim", "32", "--q-heads", "16"]
TINY += ["--repeats", "2", "--warmup", "0"]


def _table_rows(stdout: str) -> list[list[str]]:
    lines = [line for line in stdout.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


def test_quick_benchmark_reports_every_implementation(tmp_path, capsys):
    path = tmp_path / "b.json"
    rc = main(["--quick", "--dtypes", "float32", "--kv-heads", "8", "--json", path, *TINY])
    out, err = capsys.readouterr()

    assert rc == 0
    assert "MISMATCH" not in out + err
    header, _sep, *rows = _table_rows(out)
    for column in ("reference", "grouped", "sdpa", "auto", "torch SDPA", "auto / best-ours", "SDPA / auto"):
        assert column in header
    assert [row[:3] for row in rows] == [["decode", "fp32", "8"], ["prefill", "fp32", "8"]]
    for row in rows:
        assert "n/a" not in row  # float32 on CPU: every backend runs both cases
    assert err.count("\n[") + err.startswith("[") == 2  # one progress line per case

    payload = json.loads(path.read_text())
    machine = payload["machine"]
    for key in ("torch", "torch_threads", "cpu_model", "platform"):
        assert machine[key]
    assert [p.name for p in tmp_path.iterdir()] == ["b.json"]  # the temporary file was renamed, not left behind
    assert len(payload["rows"]) == 2
    for row in payload["rows"]:
        assert row["mismatches"] == []
        assert set(row["median_ms"]) == set(IMPLEMENTATIONS)
        assert all(row["median_ms"][name] > 0 for name in IMPLEMENTATIONS)
        assert all(len(times) == 2 for times in row["times_ms"].values())
        assert all(row["error_over_tolerance"][name] <= 1.0 for name in IMPLEMENTATIONS)


def test_check_outputs_flags_a_wrong_implementation():
    import torch

    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    impls = make_implementations(build_cases(QUICK, ["decode"], [torch.float32], [2])[0])
    impls["broken"] = lambda q, k, v: impls["grouped"](q, k, v) + 1e-2
    impls["refuses"] = lambda q, k, v: (_ for _ in ()).throw(ValueError("not for this case"))
    check = check_outputs(impls, (q, k, v), *TOLERANCE[torch.float32])
    assert check.mismatches == ["broken"]
    assert check.skipped == {"refuses": "not for this case"}
    assert check.error_ratio["grouped"] <= 1.0 < check.error_ratio["broken"]
