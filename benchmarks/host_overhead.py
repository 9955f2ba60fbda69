"""Host time per eager attention call: ``gqa.grouped_attention`` (``auto`` and each backend) beside the
``F.scaled_dot_product_attention`` call it stands for, on tensors so small that the call is all overhead.

    python benchmarks/host_overhead.py                 # CPU, one thread
    python benchmarks/host_overhead.py --device cuda   # on a GPU: no synchronisation between calls

Median over ``--rounds`` rounds of ``--calls`` back-to-back calls, microseconds per call. The route cache
(``gqa.attention.routes``) makes every call after the first of a signature skip the checks and the backend choice;
``--no-routes`` clears it before every call, which is what each call cost before it existed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import gqa
from gqa.attention.routes import clear_routes

CASES = {  # name: (H_q, H_kv, L, S, is_causal)
    "decode GQA": (4, 2, 1, 16, False),
    "prefill causal": (4, 2, 16, 16, True),
    "chunk causal": (4, 2, 4, 16, True),
}


def per_call_us(fn, calls: int, rounds: int, device: torch.device) -> float:
    for _ in range(20):
        fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return statistics.median(times)


def row_of(name: str, case: tuple, args: argparse.Namespace, device: torch.device) -> str:
    H_q, H_kv, L, S, causal = case
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, n, 8, generator=g).to(device) for h, n in ((H_q, L), (H_kv, S), (H_kv, S)))

    def ours(backend: str):
        def call():
            if args.no_routes:
                clear_routes()
            return gqa.grouped_attention(q, k, v, is_causal=causal, backend=backend)

        return call

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal and L == S, enable_gqa=True)

    us = {"F.sdpa": per_call_us(sdpa, args.calls, args.rounds, device)}
    runs = None
    for backend in ("auto", "sdpa", "grouped"):
        us[backend] = per_call_us(ours(backend), args.calls, args.rounds, device)
        if backend == "auto":
            runs = gqa.attention.last_backend()
    return (f"| {name} | {us['F.sdpa']:.1f} | {us['auto']:.1f} ({runs}) | {us['sdpa']:.1f} | "
            f"{us['grouped']:.1f} |")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-routes", action="store_true", help="clear the route cache before every call")
    args = p.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(1)
    print("| case | F.sdpa | gqa auto (runs) | gqa backend='sdpa' | gqa backend='grouped' |")
    print("|---|---:|---:|---:|---:|")
    for name, case in CASES.items():
        print(row_of(name, case, args, device))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
