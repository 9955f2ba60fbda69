"""The attention benchmark's outputs: the machine description, per-row rates, and the markdown report.

Everything here works on the JSON payload (plain dicts), so a saved run re-renders without measuring anything
(``gqa bench attention --from-json RUN.json --markdown RUN.md --plots DIR``).
"""

from __future__ import annotations

import os
import platform
from collections import defaultdict
from collections.abc import Sequence

import torch

import gqa

COUNTING = {
    "decode_bytes": "K and V once (2*B*H_kv*S*D elements) + q read + output written (2*B*H_q*L*D), in the input dtype",
    "prefill_flops": "4*D per visible (query, key) pair per query head: B*H_q*(L*(S-L) + L*(L+1)/2) pairs for the "
    "bottom-right causal mask (L*S unmasked); the softmax is not counted and full-square work is not credited",
    "decode_fraction": "achieved GB/s over the read bandwidth measured in the same run",
    "prefill_fraction": "achieved GFLOP/s over the matmul rate of the same dtype measured in the same run",
}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_description(device: torch.device) -> dict:
    """What the numbers were measured on."""
    info = {
        "torch": torch.__version__,
        "gqa": gqa.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "device": str(device),
    }
    if hasattr(os, "getloadavg"):
        info["loadavg_at_start"] = os.getloadavg()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= {
            "gpu": torch.cuda.get_device_name(device),
            "gpu_memory_bytes": props.total_memory,
            "gpu_multiprocessors": props.multi_processor_count,
            "gpu_l2_bytes": getattr(props, "L2_cache_size", None),
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),
            "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        }
    return info


def describe_machine(machine: dict) -> str:
    where = machine.get("gpu") or f"{machine['cpu_model']}, {machine['torch_threads']} threads"
    return f"{where}; torch {machine['torch']}"


# ----------------------------------------------------------------------------------------------------------------
# Rates


def annotate(row: dict, limits: dict) -> dict:
    """Add each timed implementation's rate (GB/s for decode, GFLOP/s for prefill) and fraction of the limit."""
    if row.get("status") != "ran":
        return row
    decode = row["kind"] == "decode"
    limit = limits["read_gbps"] if decode else limits["gemm_gflops"].get(row["dtype"])
    work = row["min_bytes"] if decode else row["flops"]
    row["metric"] = "GB/s" if decode else "GFLOP/s"
    row["limit"] = limit
    row["floor_ms"] = work / limit / 1e6 if limit else None  # the time at the limit
    row["rate"], row["fraction_of_limit"] = {}, {}
    for name, ms in row["median_ms"].items():
        if ms:
            rate = work / ms / 1e6  # bytes/ms / 1e6 = GB/s; FLOP/ms / 1e6 = GFLOP/s
            row["rate"][name] = rate
            row["fraction_of_limit"][name] = rate / limit if limit else None
    return row


# ----------------------------------------------------------------------------------------------------------------
# Markdown


def fmt_ms(ms: float | None) -> str:
    if ms is None:
        return "n/a"
    if ms < 1:
        return f"{ms:.3f}"
    return f"{ms:.2f}" if ms < 100 else f"{ms:.1f}"


def _fmt_rate(x: float | None) -> str:
    return "" if x is None else (f"{x:.1f}" if x < 1000 else f"{x:,.0f}")


def _fmt_pct(x: float | None) -> str:
    return "" if x is None else f"{100 * x:.0f}%"


def _cell(row: dict, name: str, best: float | None) -> str:
    if name in row.get("mismatches", []):
        return f"**{fmt_ms(row['median_ms'].get(name))} MISMATCH**"
    if name in row.get("errors", {}):
        return "error"
    if name in row.get("not_timed", []):
        return f"({fmt_ms(row['first_call_ms'][name])})"  # one checked call, not timed
    if name in row.get("skipped", {}):
        return "—"
    ms = row["median_ms"].get(name)
    text = fmt_ms(ms)
    return f"**{text}**" if ms is not None and ms == best else text


def _columns(rows: Sequence[dict], implementations: Sequence[str]) -> list[str]:
    """Implementations that ran on at least one of ``rows``, in the payload's order."""
    ran = {name for r in rows for name, ms in r.get("median_ms", {}).items() if ms is not None}
    ran |= {name for r in rows for name in r.get("not_timed", [])}
    return [name for name in implementations if name in ran]


def _row_label(row: dict) -> str:
    dtype = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(row["dtype"], row["dtype"])
    if row["kind"] == "decode":
        return f"decode {dtype} B={row['B']} H_kv={row['H_kv']} S={row['S']}"
    return f"prefill {dtype} H_kv={row['H_kv']} L=S={row['L']} {row['mask']}"


def _short_dtype(name: str) -> str:
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(name, name)


def summary_table(rows: Sequence[dict], implementations: Sequence[str], kind: str) -> str:
    """Cases x implementations, median ms, the best of each row in bold; plus ``auto``'s choice and its fraction."""
    rows = [r for r in rows if r["kind"] == kind and r.get("status") == "ran"]
    if not rows:
        return ""
    names = _columns(rows, implementations)
    if kind == "decode":
        head = ["dtype", "B", "H_kv", "S", "KV MiB", "floor ms"]
    else:
        head = ["dtype", "B", "H_kv", "L=S", "mask", "GFLOP", "floor ms"]
    head += [*names, "auto uses", "auto % of limit"]
    align = ["---:"] * len(head)
    align[0] = align[-2] = "---"  # dtype, auto uses
    if kind == "prefill":
        align[4] = "---"  # mask
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
    for r in rows:
        medians = [ms for name, ms in r["median_ms"].items() if ms is not None and name not in r.get("mismatches", [])]
        best = min(medians, default=None)
        if kind == "decode":
            cells = [_short_dtype(r["dtype"]), str(r["B"]), str(r["H_kv"]), str(r["S"]), f"{r['kv_cache_mib']:.1f}"]
        else:
            cells = [_short_dtype(r["dtype"]), str(r["B"]), str(r["H_kv"]), str(r["L"]), r["mask"],
                     f"{r['flops'] / 1e9:.1f}"]  # fmt: skip
        cells.append(fmt_ms(r.get("floor_ms")))
        cells += [_cell(r, name, best) for name in names]
        cells += [r.get("auto_backend", "?"), _fmt_pct(r.get("fraction_of_limit", {}).get("auto"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def detail_table(rows: Sequence[dict], implementations: Sequence[str]) -> str:
    """One line per (case, implementation): median ms, achieved rate, fraction of the limit, time over the best."""
    lines = ["| case | implementation | median ms | rate | % of limit | × best |", "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        if r.get("status") != "ran":
            continue
        timed = {n: ms for n, ms in r["median_ms"].items() if ms is not None and n not in r.get("mismatches", [])}
        best = min(timed.values(), default=None)
        for name in implementations:
            ms = r["median_ms"].get(name)
            if ms is None:
                continue
            rate = r.get("rate", {}).get(name)
            flag = " MISMATCH" if name in r.get("mismatches", []) else ""
            lines.append(
                f"| {_row_label(r)} | {name}{flag} | {fmt_ms(ms)} | {_fmt_rate(rate)} {r.get('metric', '')} | "
                f"{_fmt_pct(r.get('fraction_of_limit', {}).get(name))} | {ms / best:.2f} |"
                if best
                else f"| {_row_label(r)} | {name}{flag} | {fmt_ms(ms)} | | | |"
            )
    return "\n".join(lines)


def skipped_list(rows: Sequence[dict]) -> str:
    """Why implementations (or whole cases) did not run, one line per distinct reason with the cases it covers."""
    reasons: dict[tuple[str, str], list[str]] = defaultdict(list)
    for r in rows:
        if r.get("status") != "ran":
            reasons[("whole case", r.get("skip_reason", "not run"))].append(_row_label(r))
            continue
        for name, why in {**r.get("skipped", {}), **r.get("errors", {})}.items():
            reasons[(name, why)].append(_row_label(r))
    lines = []
    for (name, why), labels in reasons.items():
        shown = "; ".join(labels[:3]) + (f"; and {len(labels) - 3} more" if len(labels) > 3 else "")
        why = why if len(why) < 400 else why[:400] + " …"
        lines.append(f"- **{name}** ({len(labels)} case{'s' * (len(labels) != 1)}: {shown}): {why}")
    return "\n".join(lines)


def format_markdown(payload: dict) -> str:
    """The whole report: machine, limits, counting, a summary table per kind, every rate, and what was skipped."""
    machine, limits, rows = payload["machine"], payload["limits"], payload["rows"]
    names = [impl["name"] for impl in payload["implementations"]]
    gemm = ", ".join(f"{_short_dtype(k)} {_fmt_rate(v)} GFLOP/s" for k, v in limits["gemm_gflops"].items())
    copy = f"; device copy {_fmt_rate(limits['copy_gbps'])} GB/s (read + write)" if limits.get("copy_gbps") else ""
    grid = payload["grid"]
    parts = [
        f"## Attention benchmark — {describe_machine(machine)}",
        "",
        f"{payload['date']}; device `{machine['device']}`; H_q={grid['q_heads']}, D={grid['head_dim']}; "
        f"{'--quick; ' if payload.get('quick') else ''}command: `{payload.get('command', '')}`"
        + ("" if payload.get("complete", True) else f"; **incomplete run: {payload.get('stopped', 'stopped')}**"),
        "",
        f"Limits measured in this run ({'best of its start and end' if 'limits_end' in payload else 'at its start'}"
        f"): read bandwidth "
        f"**{_fmt_rate(limits['read_gbps'])} GB/s** (sum over {limits['read_buffer_bytes'] / 2**30:.2f} GiB "
        f"float32){copy}; matmul ({limits['gemm_n']}³) **{gemm}**.",
        "",
        f"Counting: decode bytes = {COUNTING['decode_bytes']}. Prefill FLOPs = {COUNTING['prefill_flops']}. "
        "floor ms = that work at the limit. Times are the median of round-robin repetitions "
        + ("(CUDA events, L2 flushed before each call)" if machine["device"].startswith("cuda") else "(wall clock)")
        + "; every implementation's output was checked against the reference backend first (bold = fastest; "
        "— = did not run, see the list at the end; (ms) = one checked call only, slower than --max-call-s, not "
        "timed).",
    ]
    for kind, title in (("decode", "Decode (L=1), median ms"), ("prefill", "Causal prefill (L=S), median ms")):
        table = summary_table(rows, names, kind)
        if table:
            parts += ["", f"### {title}", "", table]
    parts += ["", "### Every implementation: achieved rate and fraction of the limit", "", detail_table(rows, names)]
    skipped = skipped_list(rows)
    if skipped:
        parts += ["", "### Not run, and why", "", skipped]
    parts += ["", "### Implementations", ""]
    parts += [f"- `{impl['name']}`: {impl['description']}" for impl in payload["implementations"]]
    return "\n".join(parts) + "\n"
