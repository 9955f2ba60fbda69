"""``gqa bench attention --backward``: forward + backward of causal prefill (training), gqa ``auto`` against SDPA
as torch picks its kernel and, on CUDA, held to each fused kernel (flash, cuDNN, memory-efficient).

Every implementation's gradients are compared with torch SDPA's (the reference: its math path in float32 on CPU)
before it is timed; TFLOPS count 3.5 times the causal forward's ``4 * B * H_q * L^2 / 2 * D`` (backward: 2.5x the
forward's work). One row per (dtype, H_kv, L), ``B = 1``, ``H_q`` and ``D`` from ``--q-heads`` / ``--head-dim``.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

import gqa

from .. import print_and_save
from .limits import time_ms

KERNELS = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")  # held on CUDA, by SDPBackend name
TOLERANCE = {torch.float32: 2e-4, torch.float16: 2e-2, torch.bfloat16: 4e-2}  # gradients' rel. error vs SDPA's


def _median_ms(fn, device: torch.device, repeats: int) -> float:
    """Median ms of ``fn()`` after two warm-up calls (kernels chosen and compiled, workspaces allocated)."""
    return statistics.median(time_ms(fn, device, repeats, warmup=2))


def _calls(q, k, v, device: torch.device) -> dict:
    """``name -> attend()`` for every implementation on this device."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])

    calls = {"gqa auto": lambda: gqa.grouped_attention(q, k, v, is_causal=True), "torch-sdpa": sdpa}
    if device.type == "cuda":
        for name in KERNELS:
            kernel = getattr(SDPBackend, name)

            def held(kernel=kernel):
                with sdpa_kernel(kernel):
                    return sdpa()

            calls["sdpa-" + name.split("_")[0].lower()] = held
    return calls


def backward_row(H_q: int, H_kv: int, L: int, D: int, dtype: torch.dtype, device: torch.device, repeats: int) -> dict:
    """One shape: each implementation's gradients checked against torch SDPA's, then its forward + backward timed."""
    g = torch.Generator(device=device).manual_seed(L + H_kv)
    q, k, v = (torch.randn(1, h, L, D, device=device, dtype=dtype, generator=g).requires_grad_()
               for h in (H_q, H_kv, H_kv))  # fmt: skip
    grad = torch.randn(1, H_q, L, D, device=device, dtype=dtype, generator=g)
    calls = _calls(q, k, v, device)

    def grads(attend) -> list[torch.Tensor]:
        for t in (q, k, v):
            t.grad = None
        attend().backward(grad)
        return [t.grad.float() for t in (q, k, v)]

    reference = grads(calls["torch-sdpa"])
    flops = 3.5 * 4 * H_q * L * L / 2 * D
    row = {"dtype": str(dtype).removeprefix("torch."), "H_q": H_q, "H_kv": H_kv, "L": L, "D": D, "ms": {},
           "tflops": {}, "grad_rel_err": {}, "errors": {}}  # fmt: skip
    for name, attend in calls.items():
        try:
            got = grads(attend)
            err = max(((a - b).norm() / b.norm()).item() for a, b in zip(got, reference, strict=True))
            row["grad_rel_err"][name] = err
            if not err <= TOLERANCE[dtype]:  # NaN too
                row["errors"][name] = f"gradients differ from SDPA's: rel. err {err:.1e}"
                continue
            ms = _median_ms(lambda attend=attend: grads(attend), device, repeats)
            row["ms"][name], row["tflops"][name] = ms, flops / (ms * 1e-3) / 1e12
        except Exception as err:  # a kernel that does not take the shape
            row["errors"][name] = f"{type(err).__name__}: {str(err)[:160]}"
    row["auto_backend"] = gqa.attention.last_backend()
    sdpa = [ms for name, ms in row["ms"].items() if name != "gqa auto"]
    if sdpa and "gqa auto" in row["ms"]:
        row["auto_vs_best_sdpa"] = min(sdpa) / row["ms"]["gqa auto"]
    return row


def table(rows: list[dict]) -> str:
    names = list(dict.fromkeys(n for r in rows for n in [*r["ms"], *r["errors"]]))
    lines = ["| dtype | H_q | H_kv | L | D | " + " | ".join(f"{n} ms (TFLOPS)" for n in names)
             + " | auto runs | auto vs best SDPA |", "|" + "---|" * (7 + len(names))]  # fmt: skip
    for r in rows:
        cells = [f"{r['ms'][n]:.3f} ({r['tflops'][n]:.1f})" if n in r["ms"] else r["errors"].get(n, "—")[:60]
                 for n in names]  # fmt: skip
        ratio = f"{r['auto_vs_best_sdpa']:.2f}x" if "auto_vs_best_sdpa" in r else "—"
        lines.append(f"| {r['dtype']} | {r['H_q']} | {r['H_kv']} | {r['L']} | {r['D']} | " + " | ".join(cells)
                     + f" | {r['auto_backend']} | {ratio} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def run(parser: argparse.ArgumentParser, args: argparse.Namespace, device: torch.device) -> int:
    """The ``--backward`` run on the parsed flags: prints the table (``--json``, ``--markdown`` as for decode)."""
    cuda = device.type == "cuda"
    lens = args.prefill_lens or ([4096, 8192, 16384] if cuda and not args.quick else [128] if args.quick else [512])
    H_q, D = args.q_heads or 32, args.head_dim or (128 if cuda else 64)
    bad = [h for h in args.kv_heads if H_q % h]
    if bad:
        parser.error(f"--kv-heads {bad} must divide H_q={H_q}")
    repeats = args.repeats or (10 if cuda else 3)
    rows = [backward_row(H_q, h, L, D, dtype, device, repeats) for dtype in args.dtypes for h in args.kv_heads
            for L in lens]  # fmt: skip
    payload = {"benchmark": "attention-backward", "device": str(device), "rows": rows}
    print_and_save(table(rows), payload, args.json, args.markdown)
    return 1 if any("gqa auto" in r["errors"] for r in rows) else 0
