"""Table and PNG plot of a ``gqa bench model`` run, both drawn from its JSON payload.

The plot (matplotlib, Agg): the KV-cache size against context for each KV head count (left), and decode tokens/s
against context, a panel per dtype, a colour per KV head count and a line style per engine.
"""

from __future__ import annotations

from pathlib import Path

from .plots import _pyplot, _save, check_plotting

__all__ = ["check_plotting", "kind", "plot_model", "table"]

_STYLE = {"gqa": "-", "gqa-eager": ":", "hf": "--"}


def kind(kv_heads: int, num_heads: int) -> str:
    """``MHA``, ``MQA`` or ``GQA`` for ``kv_heads`` KV heads under ``num_heads`` query heads."""
    return "MHA" if kv_heads == num_heads else "MQA" if kv_heads == 1 else "GQA"


def _label(kv_heads: int, payload: dict) -> str:
    return f"{kind(kv_heads, payload['config']['num_heads'])} ({kv_heads} KV)"


def table(payload: dict) -> str:
    """Markdown: a row per (dtype, KV heads, context, engine); decode compared with HF at the same head count."""
    lines = [
        "| dtype | KV heads | context | KV cache MiB | engine | prefill tok/s | decode tok/s | decode vs hf "
        "| peak RSS MiB |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    results = payload["results"]
    by = {(r["kv_heads"], r["engine"], r["dtype"]): r for r in results}
    for dtype in dict.fromkeys(r["dtype"] for r in results):
        for n in dict.fromkeys(r["kv_heads"] for r in results):
            for i, context in enumerate(payload["args"]["contexts"]):
                hf = by.get((n, "hf", dtype))
                hf_decode = hf["rows"][i]["decode_tok_s"] if hf else None
                for engine in ("gqa", "gqa-eager", "hf"):
                    r = by.get((n, engine, dtype))
                    if r is None:
                        continue
                    row = r["rows"][i]
                    ratio = f"{row['decode_tok_s'] / hf_decode:.2f}x" if hf_decode else "-"
                    cache = r["kv_bytes_per_token"] * context / 2**20
                    lines.append(
                        f"| {dtype} | {_label(n, payload)} | {context} | {cache:.1f} | {engine} | "
                        f"{row['prefill_tok_s']:.0f} | {row['decode_tok_s']:.1f} | {ratio} | {r['peak_rss_mib']:.0f} |"
                    )
    return "\n".join(lines)


def plot_model(payload: dict, path: Path) -> None:
    """Write the PNG to ``path`` atomically."""
    plt = _pyplot()
    results = payload["results"]
    dtypes = list(dict.fromkeys(r["dtype"] for r in results))
    counts = list(dict.fromkeys(r["kv_heads"] for r in results))
    contexts = payload["args"]["contexts"]
    colour = {n: plt.get_cmap("tab10")(i) for i, n in enumerate(counts)}
    fig, axes = plt.subplots(1, 1 + len(dtypes), figsize=(4.6 * (1 + len(dtypes)), 4.2), squeeze=False)
    left, panels = axes[0][0], axes[0][1:]
    seen = set()
    for r in results:  # the KV cache: one line per (head count, dtype)
        if (r["kv_heads"], r["dtype"]) in seen:
            continue
        seen.add((r["kv_heads"], r["dtype"]))
        mib = [r["kv_bytes_per_token"] * c / 2**20 for c in contexts]
        left.plot(contexts, mib, "o-" if r["dtype"] == dtypes[0] else "s--", color=colour[r["kv_heads"]],
                  label=f"{_label(r['kv_heads'], payload)} {r['dtype']}")  # fmt: skip
    left.set_yscale("log", base=2)
    left.set_title("KV cache (all layers, batch 1)", fontsize=10)
    left.set_ylabel("MiB")
    for ax, dtype in zip(panels, dtypes, strict=True):
        for r in (r for r in results if r["dtype"] == dtype):
            tok_s = [row["decode_tok_s"] for row in r["rows"]]
            label = f"{_label(r['kv_heads'], payload)} {r['engine']}"
            ax.plot(contexts, tok_s, _STYLE.get(r["engine"], "-."), marker="o", ms=3, color=colour[r["kv_heads"]],
                    label=label)  # fmt: skip
        ax.set_title(f"decode, {dtype} (line style: engine)", fontsize=10)
        ax.set_ylabel("tokens/s")
        ax.set_ylim(bottom=0)
    for ax in axes[0]:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (prompt tokens)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{payload['model']}: MHA vs GQA vs MQA, gqa vs HF transformers — {payload['machine']['cpu_model']}",
                 fontsize=11)  # fmt: skip
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
