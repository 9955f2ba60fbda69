"""No backend materialises K/V repeated per query head: peak memory of a large MQA call, measured in a subprocess.

H_q=64 query heads share one KV head of S=16384 x D=128 (fp32: 8 MiB each for K and V). A per-head copy of K and V
would add 2 x 64 x 8 MiB = 1 GiB; the measured growth of the peak RSS must stay far below that.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import resource, sys, torch, gqa
    backend, L, causal = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
    torch.manual_seed(0)
    q = torch.randn(1, 64, L, 128)
    k = torch.randn(1, 1, 16384, 128)
    v = torch.randn(1, 1, 16384, 128)
    gqa.grouped_attention(q[..., :1, :], k[..., :8, :], v[..., :8, :], backend=backend)  # warm up lazy init
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with torch.inference_mode():
        out = gqa.grouped_attention(q, k, v, is_causal=causal, backend=backend)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    print(grown // 1024)  # MiB
    """
)


@pytest.mark.parametrize(
    "backend,L,causal",
    [("reference", 1, False), ("grouped", 1, False), ("grouped", 8, True), ("sdpa", 1, False), ("sdpa", 64, True),
     ("auto", 1, False), ("auto", 64, True)],
)  # fmt: skip
def test_peak_memory_far_below_a_copy(backend, L, causal):
    res = subprocess.run([sys.executable, "-c", SCRIPT, backend, str(L), str(int(causal))],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stderr
    grown_mib = int(res.stdout.split()[-1])
    scores_mib = 64 * L * 16384 * 4 / 2**20  # what the fp32 score matrix itself may take
    copy_mib = 2 * 64 * 16384 * 128 * 4 / 2**20  # 1024 MiB
    assert grown_mib < scores_mib * 2 + 64, f"{backend}: peak RSS grew {grown_mib} MiB; a K/V copy is {copy_mib:.0f}"
