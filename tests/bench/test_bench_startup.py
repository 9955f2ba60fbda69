"""``gqa bench startup``: the case list runs, times are medians of fresh processes, results are written atomically,
and bad flags are exit 2."""

from __future__ import annotations

import json
import sys

import pytest

from gqa.bench import startup
from gqa.cli import main


def test_every_case_command_runs(monkeypatch):
    names = [c.name for c in startup.cases(None, "auto", llama_cpp=False)]
    assert names[:4] == [
        "python -c 'import torch'",
        "python -c 'import gqa'",
        "gqa info",
        "gqa generate --max-new-tokens 1 Hi",
    ]
    load = next(c for c in startup.cases(None, "fp32", llama_cpp=False) if c.inner == "warm")
    (warm,) = startup.measure(load, 1, env={"HF_HUB_OFFLINE": "1", "PATH": ""})
    assert 0 < warm < 60


def test_the_cli_writes_medians(monkeypatch, tmp_path, capsys):
    calls = []

    def cheap(model, dtype, llama_cpp):
        calls.append((model, dtype, llama_cpp))
        return [
            startup.Case("pass", [sys.executable, "-c", "pass"]),
            startup.Case("inner", [sys.executable, "-c", "print('{\"warm\": 0.25}')"], inner="warm"),
        ]

    monkeypatch.setattr(startup, "cases", cheap)
    code = main(["bench", "startup", "--runs", "3", "--no-llama-cpp", "--dtype", "fp32", "--out", str(tmp_path)])
    assert code == 0 and calls == [(None, "fp32", False)]
    result = json.loads((tmp_path / "results.json").read_text())
    assert [r["name"] for r in result["rows"]] == ["pass", "inner"]
    assert len(result["rows"][0]["seconds"]) == 3 and result["rows"][1]["seconds"] == [0.25] * 3
    assert "| inner | 0.25 s | 0.25 - 0.25 s | 3 |" in (tmp_path / "results.md").read_text()
    assert "| inner | 0.25 s |" in capsys.readouterr().out


def test_a_failing_case_says_which(tmp_path):
    case = startup.Case("broken", [sys.executable, "-c", "raise SystemExit('nope')"])
    with pytest.raises(RuntimeError, match=r"broken failed \(exit 1\): nope"):
        startup.measure(case, 1, env={})


@pytest.mark.parametrize(
    ("flags", "message"),
    [(["--runs", "0"], "--runs must be >= 1"), (["--model", "/nonexistent.gguf"], "no such file")],
)
def test_bad_flags_exit_2(capsys, flags, message):
    with pytest.raises(SystemExit) as e:
        main(["bench", "startup", *flags])
    assert e.value.code == 2 and message in capsys.readouterr().err
