"""``gqa bench shared``: each engine's decode speed alone and beside busy processes that the benchmark starts and
stops, the share of the alone speed, results written; bad flags are exit 2."""

from __future__ import annotations

import json
import os
import time

import pytest

from gqa.bench import shared_cpu
from gqa.cli import main


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_busy_processes_run_for_the_block_and_are_gone_after():
    with shared_cpu.Busy(2, "python") as busy:
        pids = [p.pid for p in busy.procs]
        assert len(pids) == 2 and all(p.poll() is None for p in busy.procs)
        before = [cpu_seconds(pid) for pid in pids]
        time.sleep(0.5)
        assert all(cpu_seconds(pid) - b > 0.1 for pid, b in zip(pids, before, strict=True))  # really busy
    assert all(p.poll() is not None for p in busy.procs)


def test_the_cli_runs_the_real_worker_beside_a_busy_loop(tmp_path, capsys):
    """The real gqa worker on the embedded model, alone and beside one busy process, one round."""
    code = main(["bench", "shared", "--engines", "gqa", "--beside", "0", "1", "--busy", "python", "--rounds", "1",
                 "--context", "8", "--new-tokens", "4", "--out", str(tmp_path)])  # fmt: skip
    assert code == 0
    result = json.loads((tmp_path / "results.json").read_text())
    (row,) = result["rows"]
    assert row["engine"] == "gqa" and set(row["tok_s"]) == {"0", "1"}  # JSON keys
    assert all(v > 0 for v in row["tok_s"].values())
    text = (tmp_path / "results.md").read_text()
    assert "| gqa (q4_1) |" in text and "beside 1 python loop" in text and "%)" in text
    assert text in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags", [["--rounds", "0"], ["--new-tokens", "1"], ["--beside", "-1"], ["--model", "/nonexistent.gguf"]]
)
def test_bad_flags_are_exit_2(flags, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "shared", *flags])
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err
