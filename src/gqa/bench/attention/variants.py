"""``gqa bench attention --variants``: decode with a sliding window, soft-capping and sinks beside plain attention.

One row per (dtype, ``H_kv``, context ``S``), ``B`` from ``--batches`` (first value), ``H_q``/``D`` from the flags;
``gqa.grouped_attention`` (``auto``) with one new token against ``S`` cached keys:

* ``plain``: no option;
* ``window``: a ``W``-key window (``--window``, default 4096, 512 with ``--quick``: each query sees itself and the
  ``W - 1`` keys before it),
  which reads only the window's keys — its GB/s counts those bytes, and its speed-up is over ``plain``;
* ``band mask``: the same window given as a boolean ``(1, S)`` mask, as a caller without ``window=`` would write it;
* ``softcap`` (50, Gemma 2's) and ``sinks`` (a logit per query head, gpt-oss's): their cost over ``plain``.

On CUDA each row also times the peers a caller could reach for, side by side: the window and the soft-cap through
compiled FlexAttention (``backend="flex"``), and the band mask through SDPA (``backend="sdpa"``, where torch runs it
natively; a refusal is noted, not an error). ``auto`` runs the split-KV kernel for every variant there.

Before timing, each variant's output is checked: the window against ``plain`` on the window's keys alone, softcap and
sinks against the float64 ``reference`` backend.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import gqa

from .. import print_and_save
from .limits import time_ms

SOFTCAP = 50.0
PEER_COLUMNS = ("window", "window · flex", "band mask · sdpa", "softcap", "softcap · flex")
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}  # max abs error (outputs are O(1))


def variant_row(B: int, H_q: int, H_kv: int, S: int, D: int, W: int, dtype: torch.dtype, device: torch.device,
                repeats: int) -> dict:  # fmt: skip
    """Time ``plain``, ``window``, ``band mask``, ``softcap`` and ``sinks`` for one decode shape."""
    g = torch.Generator(device=device).manual_seed(S + H_kv)
    q = torch.randn(B, H_q, 1, D, device=device, dtype=dtype, generator=g)
    k, v = (torch.randn(B, H_kv, S, D, device=device, dtype=dtype, generator=g) for _ in range(2))
    sinks = torch.randn(H_q, device=device, dtype=dtype, generator=g)
    band = torch.zeros(1, S, dtype=torch.bool, device=device)
    band[:, max(0, S - W) :] = True
    calls = {
        "plain": lambda: gqa.grouped_attention(q, k, v),
        "window": lambda: gqa.grouped_attention(q, k, v, window=W - 1),
        "band mask": lambda: gqa.grouped_attention(q, k, v, band),
        "softcap": lambda: gqa.grouped_attention(q, k, v, softcap=SOFTCAP),
        "sinks": lambda: gqa.grouped_attention(q, k, v, sinks=sinks),
    }
    peers = {}
    if device.type == "cuda":
        peers = {
            "window · flex": lambda: gqa.grouped_attention(q, k, v, window=W - 1, backend="flex"),
            "softcap · flex": lambda: gqa.grouped_attention(q, k, v, softcap=SOFTCAP, backend="flex"),
            "band mask · sdpa": lambda: gqa.grouped_attention(q, k, v, band, backend="sdpa"),
        }
    window_only = lambda: gqa.grouped_attention(q, k[..., -W:, :], v[..., -W:, :])  # noqa: E731
    capped = lambda: gqa.grouped_attention(q, k, v, softcap=SOFTCAP, backend="reference")  # noqa: E731
    expected = {
        "window": window_only,
        "band mask": window_only,
        "softcap": capped,
        "sinks": lambda: gqa.grouped_attention(q, k, v, sinks=sinks, backend="reference"),
        "window · flex": window_only,
        "softcap · flex": capped,
        "band mask · sdpa": window_only,
    }
    row = {"dtype": str(dtype).removeprefix("torch."), "B": B, "H_q": H_q, "H_kv": H_kv, "S": S, "D": D, "W": W,
           "ms": {}, "backend": {}, "errors": {}, "refused": {}}  # fmt: skip
    for name, call in {**calls, **peers}.items():
        try:
            out = call()
            row["backend"][name] = gqa.attention.last_backend()
            if name in expected:
                err = (out.float() - expected[name]().float()).abs().max().item()
                if not err <= TOLERANCE[dtype]:  # NaN too
                    row["errors"][name] = f"differs from its reference by {err:.1e}"
                    continue
            row["ms"][name] = statistics.median(time_ms(call, device, repeats, warmup=2))
        except Exception as err:  # a backend that refuses the variant
            where = row["refused"] if name in peers else row["errors"]
            where[name] = f"{type(err).__name__}: {str(err)[:160]}"
    item = torch.empty((), dtype=dtype).element_size()
    kv_bytes = {"plain": 2 * B * H_kv * S * D * item, "window": 2 * B * H_kv * min(W, S) * D * item}
    row["gbs"] = {n: kv_bytes[n] / (row["ms"][n] * 1e-3) / 1e9 for n in kv_bytes if n in row["ms"]}
    return row


def _cell(ms: dict[str, float], name: str, how: str) -> str:
    """``name``'s ms with its speed-up over ``plain`` (``how="speed-up"``) or its cost over it (``"cost"``)."""
    if name not in ms:
        return "—"
    plain = ms.get("plain")
    if plain is None:
        return f"{ms[name]:.3f}"
    if how == "speed-up":
        return f"{ms[name]:.3f} ({plain / ms[name]:.1f}x)"
    return f"{ms[name]:.3f} ({100 * (ms[name] / plain - 1):+.0f}%)"


def _peer_cell(row: dict, name: str) -> str:
    if name in row["ms"]:
        return f"{row['ms'][name]:.3f}"
    return "refused" if name in row.get("refused", {}) else "—"


def table(rows: list[dict]) -> str:
    """The markdown table: ms per variant, the window's speed-up and GB/s, softcap's and sinks' cost, the backends."""
    lines = ["| dtype | B | H_q | H_kv | S | D | W | plain ms | window ms (x plain) | window GB/s | band mask ms "
             "| softcap ms (+%) | sinks ms (+%) | auto runs (plain / window / softcap) | errors |",
             "|" + "---|" * 15]  # fmt: skip
    for r in rows:
        ms = r["ms"]
        plain = f"{ms['plain']:.3f}" if "plain" in ms else "—"
        gbs = f"{r['gbs']['window']:.1f}" if "window" in r["gbs"] else "—"
        runs = " / ".join(r["backend"].get(n, "—") for n in ("plain", "window", "softcap"))
        errors = "; ".join(f"{n}: {e[:50]}" for n, e in r["errors"].items()) or "—"
        lines.append(
            f"| {r['dtype']} | {r['B']} | {r['H_q']} | {r['H_kv']} | {r['S']} | {r['D']} | {r['W']} | {plain} | "
            f"{_cell(ms, 'window', 'speed-up')} | {gbs} | {_cell(ms, 'band mask', 'speed-up')} | "
            f"{_cell(ms, 'softcap', 'cost')} | {_cell(ms, 'sinks', 'cost')} | {runs} | {errors} |"
        )
    peers = [r for r in rows if any(" · " in name for name in (*r["ms"], *r.get("refused", {})))]
    if peers:
        lines += ["", "Peers (ms; auto is gqa's own choice above):", "",
                  "| dtype | H_kv | S | W | window: auto | window: flex | band mask: sdpa | softcap: auto | "
                  "softcap: flex |", "|" + "---|" * 9]  # fmt: skip
        for r in peers:
            cells = [_peer_cell(r, n) for n in PEER_COLUMNS]
            lines.append(f"| {r['dtype']} | {r['H_kv']} | {r['S']} | {r['W']} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def run(parser: argparse.ArgumentParser, args: argparse.Namespace, device: torch.device) -> int:
    """The ``--variants`` run on the parsed flags: prints the table (``--json``, ``--markdown`` as for decode)."""
    cuda = device.type == "cuda"
    contexts = args.contexts or ([4096] if args.quick else [32768])
    H_q, D = args.q_heads or 32, args.head_dim or (128 if cuda else 64)
    window = args.window or (512 if args.quick else 4096)
    bad = [h for h in args.kv_heads if H_q % h]
    if bad:
        parser.error(f"--kv-heads {bad} must divide H_q={H_q}")
    B = args.batches[0] if args.batches else 1
    repeats = args.repeats or (20 if cuda else 7)
    rows = [variant_row(B, H_q, h, S, D, window, dtype, device, repeats) for dtype in args.dtypes
            for h in args.kv_heads for S in contexts]  # fmt: skip
    payload = {"benchmark": "attention-variants", "device": str(device), "rows": rows}
    print_and_save(table(rows), payload, args.json, args.markdown)
    return 1 if any(r["errors"] for r in rows) else 0
