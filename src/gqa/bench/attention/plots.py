"""PNG plots of an attention benchmark run (matplotlib, Agg backend), drawn from the JSON payload.

* ``attention-decode.png``: decode time vs context length, one panel per ``H_kv`` (a row of panels per dtype), a
  line per implementation, and the bandwidth floor (the decode bytes at the measured read bandwidth); log axes.
* ``attention-kv-bytes.png``: KV-cache bytes per token (one layer) vs ``H_kv``, and the measured decode time per
  step at the longest context vs ``H_kv``: the time follows the bytes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from .. import atomic_path

PLOT_FILES = ("attention-decode.png", "attention-kv-bytes.png")
_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _pyplot():
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError("--plots needs matplotlib: pip install matplotlib") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def check_plotting() -> None:
    """Raise ``ImportError`` now, before a long run, when matplotlib is missing."""
    _pyplot()


def _decode_rows(payload: dict) -> tuple[int | None, list[dict]]:
    """The decode rows of the batch size with the most context lengths (the sweep)."""
    rows = [r for r in payload["rows"] if r["kind"] == "decode" and r.get("status") == "ran"]
    contexts: dict[int, set[int]] = defaultdict(set)
    for r in rows:
        contexts[r["B"]].add(r["S"])
    if not contexts:
        return None, []
    batch = max(contexts, key=lambda b: (len(contexts[b]), b == 8, b))
    return batch, [r for r in rows if r["B"] == batch]


def _save(fig, path: Path) -> None:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")


def plot_decode(payload: dict, path: Path) -> None:
    plt = _pyplot()
    batch, rows = _decode_rows(payload)
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows)) or ["float32"]
    kv_heads = sorted({r["H_kv"] for r in rows}, reverse=True) or [1]
    names = [impl["name"] for impl in payload["implementations"]]
    fig, axes = plt.subplots(len(dtypes), len(kv_heads), figsize=(4.2 * len(kv_heads), 3.6 * len(dtypes)),
                             squeeze=False, sharex=True)  # fmt: skip
    cmap = plt.get_cmap("tab20")
    for i, dtype in enumerate(dtypes):
        for j, h_kv in enumerate(kv_heads):
            ax = axes[i][j]
            panel = sorted((r for r in rows if r["dtype"] == dtype and r["H_kv"] == h_kv), key=lambda r: r["S"])
            for k, name in enumerate(names):
                pts = [(r["S"], r["median_ms"][name]) for r in panel if r["median_ms"].get(name) is not None]
                if pts:
                    style = "-" if name in ("auto", *payload.get("ours", [])) else "--"
                    ax.plot(*zip(*pts, strict=True), style, marker="o", ms=3, label=name, color=cmap(k % 20),
                            lw=2.5 if name == "auto" else 1.2)  # fmt: skip
            floor = [(r["S"], r["floor_ms"]) for r in panel if r.get("floor_ms")]
            if floor:
                ax.plot(*zip(*floor, strict=True), ":", color="black", lw=2, label="bandwidth floor")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{_SHORT.get(dtype, dtype)}, H_kv={h_kv}", fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            if i == len(dtypes) - 1:
                ax.set_xlabel("context S (keys)")
            if j == 0:
                ax.set_ylabel("decode step, ms")
    handles, labels = axes[0][0].get_legend_handles_labels()
    for ax in axes.flat:  # the union of all panels' lines
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            if label not in labels:
                handles.append(h)
                labels.append(label)
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), fontsize=8, bbox_to_anchor=(0.5, -0.02))
    grid = payload["grid"]
    fig.suptitle(f"Decode attention (L=1), B={batch}, H_q={grid['q_heads']}, D={grid['head_dim']} — "
                 f"{payload['machine'].get('gpu') or payload['machine']['cpu_model']}", fontsize=11)  # fmt: skip
    fig.tight_layout(rect=(0, 0.06, 1, 0.97))
    _save(fig, path)
    plt.close(fig)


def plot_kv_bytes(payload: dict, path: Path) -> None:
    plt = _pyplot()
    grid = payload["grid"]
    kv_heads = sorted(set(payload.get("kv_heads", [])) | {1, grid["q_heads"]})
    dtypes = list(dict.fromkeys(payload.get("dtypes", ["float32"])))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for dtype in dtypes:
        per_token = [2 * h * grid["head_dim"] * _BYTES.get(dtype, 4) for h in kv_heads]  # K and V, one layer
        left.plot(kv_heads, per_token, "o-", label=_SHORT.get(dtype, dtype))
        for h, b in zip(kv_heads, per_token, strict=True):
            left.annotate(f"{b / 1024:g} KiB", (h, b), textcoords="offset points", xytext=(4, -10), fontsize=7)
    left.set_xscale("log", base=2)
    left.set_yscale("log", base=2)
    left.set_xticks(kv_heads, [str(h) for h in kv_heads])
    left.set_xlabel(f"H_kv (H_q={grid['q_heads']}: MHA at {grid['q_heads']}, MQA at 1)")
    left.set_ylabel("KV-cache bytes per token, one layer")
    left.set_title(f"KV-cache bytes per token (2·H_kv·D, D={grid['head_dim']})", fontsize=10)
    left.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=8)

    batch, rows = _decode_rows(payload)
    if rows:
        longest = max(r["S"] for r in rows)
        for dtype in dtypes:
            sel = sorted((r for r in rows if r["dtype"] == dtype and r["S"] == longest), key=lambda r: r["H_kv"])
            for name, style in (("auto", "o-"), ("torch-sdpa", "s--")):
                pts = [(r["H_kv"], r["median_ms"][name]) for r in sel if r["median_ms"].get(name) is not None]
                if pts:
                    right.plot(*zip(*pts, strict=True), style, label=f"{name} {_SHORT.get(dtype, dtype)}")
            floor = [(r["H_kv"], r["floor_ms"]) for r in sel if r.get("floor_ms")]
            if floor:
                right.plot(
                    *zip(*floor, strict=True), ":", marker=".", color="gray", label=f"floor {_SHORT.get(dtype, dtype)}"
                )
        right.set_title(f"Measured decode step at S={longest}, B={batch}", fontsize=10)
        right.legend(fontsize=8)
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_xticks(kv_heads, [str(h) for h in kv_heads])
    right.set_xlabel("H_kv")
    right.set_ylabel("ms")
    right.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def write_plots(payload: dict, directory: Path) -> Sequence[Path]:
    """Write both PNGs into ``directory`` (created if needed), each atomically; returns their paths."""
    directory = Path(directory)
    decode, kv_bytes = (directory / name for name in PLOT_FILES)
    plot_decode(payload, decode)
    plot_kv_bytes(payload, kv_bytes)
    return [decode, kv_bytes]
