"""Running a test file in a child process where Triton interprets its kernels on CPU tensors.

``TRITON_INTERPRET=1`` must be set before triton is first imported (``triton.jit`` decides at decoration time), and
``import gqa`` already imports it through ``torch._dynamo``: so kernel tests run in a process started with the
variable set, and a parent test in the normal suite starts that process and checks its summary.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def interpreting() -> bool:
    """Whether triton interprets kernels in this process (imports triton)."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return os.environ.get("TRITON_INTERPRET") == "1" and isinstance(tl.max, InterpretedFunction)


def run_interpreted(test_file: str, child_flag: str, min_passed: int) -> None:
    """Run ``test_file`` with ``TRITON_INTERPRET=1`` and ``child_flag=1`` set; assert it passed, with at least
    ``min_passed`` tests and none failed."""
    env = {**os.environ, "TRITON_INTERPRET": "1", child_flag: "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(test_file).resolve())]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    tail = (done.stdout + done.stderr)[-6000:]
    assert done.returncode == 0, tail
    counts = {w: int(n) for n, w in re.findall(r"(\d+) (passed|skipped|failed|error)", tail.strip().splitlines()[-1])}
    assert counts.get("passed", 0) >= min_passed and "failed" not in counts, tail
