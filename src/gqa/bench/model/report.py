"""Table and PNG plot of a ``gqa bench model`` run, both drawn from its JSON payload.

The plot (matplotlib, Agg): the KV-cache size against context for each KV head count (left), and decode tokens/s
against context, a panel per dtype and KV cache type, a colour per KV head count and a line style per engine. Each row
carries its KV cache type (``kv_dtype``: what the cache stores, e.g. ``bf16`` for ``--kv-cache-dtypes auto``), and
``kv_cache_dtype`` the flag's value it ran with; payloads written before those existed read as ``auto``.
"""

from __future__ import annotations

from pathlib import Path

from ...cache.kv_dtypes import KV_DTYPES
from ..attention.plots import _pyplot, _save, check_plotting

__all__ = [
    "agreement",
    "ceiling_share",
    "check_plotting",
    "kind",
    "plot_model",
    "plot_throughput",
    "table",
    "throughput_table",
]

QUANTIZED_KV = tuple(name for name, kind in KV_DTYPES.items() if kind.quantized)  # --kv-cache-dtypes' block types
_STYLE = {"gqa": "-", "gqa-compile": ":", "hf": "--", "llama.cpp": "-."}
ENGINE_ORDER = ("gqa", "gqa-compile", "hf", "llama.cpp")


def kind(kv_heads: int, num_heads: int) -> str:
    """``MHA``, ``MQA`` or ``GQA`` for ``kv_heads`` KV heads under ``num_heads`` query heads."""
    return "MHA" if kv_heads == num_heads else "MQA" if kv_heads == 1 else "GQA"


def _label(kv_heads: int, payload: dict) -> str:
    return f"{kind(kv_heads, payload['config']['num_heads'])} ({kv_heads} KV)"


def _kv(r: dict) -> str:
    """The ``--kv-cache-dtypes`` value a result ran with."""
    return r.get("kv_cache_dtype", "auto")


def _float_kv(r: dict) -> bool:
    return _kv(r) not in QUANTIZED_KV


def ceiling_share(row: dict, read_gbps: float | None) -> float | None:
    """A gqa row's decode as a share of the bandwidth ceiling: the bytes one token reads (weights + KV cache) times
    tokens/s, over the measured read bandwidth; ``None`` where either is unknown."""
    if not read_gbps or "weight_bytes" not in row:
        return None
    return (row["weight_bytes"] + row["kv_bytes"]) * row["decode_tok_s"] / 1e9 / read_gbps


def table(payload: dict) -> str:
    """Markdown: a row per (dtype, KV cache type, KV heads, context, engine) with the KV cache's MiB as it stores
    them; decode compared with HF at the same head count, dtype and cache type, or where there is no HF row with
    llama.cpp; a block-type cache's decode compared with the same engine's float cache (``vs float KV``); for gqa rows
    the fraction of the bandwidth ceiling (weights + KV cache read per token, times tokens/s, over the measured read
    bandwidth); then the greedy-token agreement, if measured, and the combinations not run."""
    lines = [
        "| dtype | KV cache | KV heads | context | KV cache MiB | engine | prefill tok/s | decode tok/s "
        "| decode vs baseline | vs float KV | of ceiling | peak RSS MiB |",
        "|---|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    read_gbps = payload.get("read_gbps")
    results = payload["results"]
    by = {(r["kv_heads"], r["engine"], r["dtype"], _kv(r)): r for r in results}
    floats = {(r["kv_heads"], r["engine"], r["dtype"]): r for r in reversed(results) if _float_kv(r)}  # the first
    for dtype in dict.fromkeys(r["dtype"] for r in results):
        for kv in dict.fromkeys(_kv(r) for r in results):
            for n in dict.fromkeys(r["kv_heads"] for r in results):
                for i, context in enumerate(payload["args"]["contexts"]):
                    base_name = next((e for e in ("hf", "llama.cpp") if (n, e, dtype, kv) in by), None)
                    base = by[(n, base_name, dtype, kv)]["rows"][i]["decode_tok_s"] if base_name else None
                    for engine in ENGINE_ORDER:
                        r = by.get((n, engine, dtype, kv))
                        if r is None:
                            continue
                        row = r["rows"][i]
                        ratio = f"{row['decode_tok_s'] / base:.2f}x vs {base_name}" if base else "-"
                        plain = floats.get((n, engine, dtype)) if not _float_kv(r) else None
                        vs_float = f"{row['decode_tok_s'] / plain['rows'][i]['decode_tok_s']:.2f}x" if plain else "-"
                        cache = r["kv_bytes_per_token"] * context / 2**20
                        share = ceiling_share(row, read_gbps)
                        ceiling = "-" if share is None else f"{share:.0%}"
                        lines.append(
                            f"| {dtype} | {r.get('kv_dtype', kv)} | {_label(n, payload)} | {context} | {cache:.1f} | "
                            f"{engine} | {row['prefill_tok_s']:.0f} | {row['decode_tok_s']:.1f} | {ratio} | "
                            f"{vs_float} | {ceiling} | {r['peak_rss_mib']:.0f} |"
                        )
    parts = ["\n".join(lines), agreement(results), skipped_note(payload)]
    return "\n\n".join(p for p in parts if p)


def skipped_note(payload: dict) -> str:
    """The combinations the run left out, and why (``payload["skipped"]``), one line each."""
    return "\n".join(f"Not run: {text}." for text in payload.get("skipped", []))


def agreement(results: list[dict]) -> str:
    """How often gqa's greedy tokens equal llama.cpp's on the same file and KV cache type (rows that recorded
    ``greedy``)."""
    theirs = {(r["dtype"], _kv(r)): r for r in results if r["engine"] == "llama.cpp" and r.get("greedy")}
    lines = []
    for r in results:
        peer = theirs.get((r["dtype"], _kv(r)))
        if r["engine"] == "llama.cpp" or not r.get("greedy") or peer is None:
            continue
        pairs = list(zip(r["greedy"], peer["greedy"], strict=True))
        same = sum(a == b for a, b in pairs)
        prefix = [_common_prefix(a, b) for a, b in pairs]
        cache = f", {_kv(r)} KV cache" if _kv(r) != "auto" else ""
        lines.append(
            f"Greedy tokens, {r['engine']} {r['dtype']}{cache} vs llama.cpp on the same file: {same} of {len(pairs)} "
            f"chat prompts identical (up to 32 tokens); matching prefix {sum(prefix) / len(prefix):.1f} tokens on "
            "average."
        )
    return "\n".join(lines)


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def throughput_table(payload: dict) -> str:
    """Markdown: decode tokens/s per (dtype, KV cache type, KV heads, context, batch), the KV cache it holds, and the
    batch that fits the budget marked."""
    budget = payload["args"].get("kv_budget_gib")
    lines = [
        "| dtype | KV cache | KV heads | context | batch | KV cache MiB | step ms | decode tok/s | vs batch 1 |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in payload["results"]:
        single = next((row["decode_tok_s"] for row in r["rows"] if row["batch"] == 1), None)
        for row in r["rows"]:
            mark = f" (largest in {budget:g} GiB)" if row.get("fits_budget") else ""
            ratio = f"{row['decode_tok_s'] / single:.2f}x" if single else "-"
            lines.append(
                f"| {r['dtype']} | {r.get('kv_dtype', _kv(r))} | {_label(r['kv_heads'], payload)} | {row['context']} | "
                f"{row['batch']}{mark} | "
                f"{row['kv_cache_bytes'] / 2**20:.0f} | {row['step_s'] * 1e3:.1f} | {row['decode_tok_s']:.1f} | "
                f"{ratio} |"
            )
    if budget:
        best = {}
        for r in payload["results"]:
            for row in r["rows"]:
                if row.get("fits_budget"):
                    best[(r["dtype"], r.get("kv_dtype", _kv(r)), row["context"], r["kv_heads"])] = row["decode_tok_s"]
        for (dtype, kv, context, n), tok_s in best.items():
            mha = best.get((dtype, kv, context, payload["config"]["num_heads"]))
            if mha and n != payload["config"]["num_heads"]:
                lines += ["", f"{dtype}, {kv} KV cache, context {context}, within {budget:g} GiB: "
                          f"{_label(n, payload)} {tok_s:.0f} tok/s = {tok_s / mha:.1f}x MHA's {mha:.0f}"]  # fmt: skip
    note = skipped_note(payload)
    return "\n".join(lines) + ("\n\n" + note if note else "")


def plot_throughput(payload: dict, path: Path) -> None:
    """Decode tokens/s against batch size, a panel per context, a colour per KV head count; budget batches starred."""
    plt = _pyplot()
    results = payload["results"]
    contexts = payload["args"]["contexts"]
    counts = list(dict.fromkeys(r["kv_heads"] for r in results))
    colour = {n: plt.get_cmap("tab10")(i) for i, n in enumerate(counts)}
    fig, axes = plt.subplots(1, len(contexts), figsize=(5.0 * len(contexts), 4.2), squeeze=False)
    for ax, context in zip(axes[0], contexts, strict=True):
        for r in results:
            rows = [row for row in r["rows"] if row["context"] == context]
            if not rows:
                continue
            style = "o-" if r["dtype"] == results[0]["dtype"] else "s--"
            label = f"{_label(r['kv_heads'], payload)} {r['dtype']}, {r.get('kv_dtype', _kv(r))} KV"
            ax.plot([row["batch"] for row in rows], [row["decode_tok_s"] for row in rows], style, ms=3,
                    color=colour[r["kv_heads"]], label=label)  # fmt: skip
            for row in rows:
                if row.get("fits_budget"):
                    ax.plot(row["batch"], row["decode_tok_s"], "*", ms=12, color=colour[r["kv_heads"]])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch (sequences decoded together)")
        ax.set_ylabel("tokens/s")
        budget = payload["args"].get("kv_budget_gib")
        note = f"; *: largest batch in {budget:g} GiB of KV cache" if budget else ""
        ax.set_title(f"decode throughput, context {context}{note}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{payload['model']}: MHA vs GQA vs MQA at batch — {payload['machine']['cpu_model']}", fontsize=11)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def plot_model(payload: dict, path: Path) -> None:
    """Write the PNG to ``path`` atomically."""
    plt = _pyplot()
    results = payload["results"]
    dtypes = list(dict.fromkeys((r["dtype"], _kv(r)) for r in results))  # a panel per (dtype, KV cache type)
    counts = list(dict.fromkeys(r["kv_heads"] for r in results))
    contexts = payload["args"]["contexts"]
    colour = {n: plt.get_cmap("tab10")(i) for i, n in enumerate(counts)}
    fig, axes = plt.subplots(1, 1 + len(dtypes), figsize=(4.6 * (1 + len(dtypes)), 4.2), squeeze=False)
    left, panels = axes[0][0], axes[0][1:]
    seen = set()
    for r in results:  # the KV cache: one line per (head count, bytes a token)
        if (r["kv_heads"], r["kv_bytes_per_token"]) in seen:
            continue
        seen.add((r["kv_heads"], r["kv_bytes_per_token"]))
        mib = [r["kv_bytes_per_token"] * c / 2**20 for c in contexts]
        left.plot(contexts, mib, "o-" if (r["dtype"], _kv(r)) == dtypes[0] else "s--", color=colour[r["kv_heads"]],
                  label=f"{_label(r['kv_heads'], payload)} {r['dtype']}, {r.get('kv_dtype', _kv(r))} KV")  # fmt: skip
    left.set_yscale("log", base=2)
    left.set_title("KV cache (all layers, batch 1)", fontsize=10)
    left.set_ylabel("MiB")
    for ax, (dtype, kv) in zip(panels, dtypes, strict=True):
        for r in (r for r in results if r["dtype"] == dtype and _kv(r) == kv):
            tok_s = [row["decode_tok_s"] for row in r["rows"]]
            label = f"{_label(r['kv_heads'], payload)} {r['engine']}"
            ax.plot(contexts, tok_s, _STYLE.get(r["engine"], "-."), marker="o", ms=3, color=colour[r["kv_heads"]],
                    label=label)  # fmt: skip
        ax.set_title(f"decode, {dtype}, {kv} KV cache (line style: engine)", fontsize=10)
        ax.set_ylabel("tokens/s")
        ax.set_ylim(bottom=0)
    for ax in axes[0]:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (prompt tokens)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{payload['model']}: MHA vs GQA vs MQA; gqa, HF, llama.cpp — {payload['machine']['cpu_model']}",
                 fontsize=11)  # fmt: skip
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
