"""The prepared GPU check: correctness, attention and whole-model decode on CUDA, in one run that fits a short loan.

    python benchmarks/gpu_check.py --out DIR            # on a GPU machine (about 4.5 minutes on an H200)
    python benchmarks/gpu_check.py --dry --out DIR      # on CPU: the same steps on tiny shapes (tests run this)

The GPU machine has no gguf, starlette or uvicorn and cannot reach the embedded model: a dry run here writes
SmolLM2's tokenizer to ``.gpu/``; carry it, and those packages as wheels in ``.whl/`` (the device tool's README).

Steps, each under its own time budget, each writing what it measured before the next starts:

1. ``machine``: GPU, torch/triton versions, and the device-to-device copy bandwidth (the ceiling decode is judged by);
2. ``tests``: ``pytest -m cuda`` (the CUDA-parametrised tests against float64 references and HF transformers);
3. ``kernel``: per-call host overhead of each path (CPU µs, no synchronisation), and the split-KV kernel's own GPU
   time in every tile configuration against SDPA (the kernel torch picks), both replayed from CUDA graphs (no
   launch overhead): GB/s and % of the copy bandwidth;
4. ``decode``: ``gqa bench attention`` decode, bf16, D=128, H_q=32 over H_kv in {32, 8, 4, 1}, B in {1, 8, 64},
   S in {1k, 4k, 16k, 64k}: gqa ``auto`` and each backend, SDPA as torch picks and held to each kernel, HF
   ``repeat_kv`` + SDPA, compiled FlexAttention; CUDA-event medians with the L2 flushed before every call;
5. ``fp32``: decode in float32, where SDPA falls to its math path;
6. ``prefill``: the same at L = S = 4k, causal; ``flex``: compiled FlexAttention on a few decode shapes;
7. ``model``: whole-model greedy decode, gqa ``generate`` (CUDA graphs + split-KV kernel) vs HF ``generate`` on the
   same random weights: SmolLM2-135M's shapes and a Llama-3-8B-like config with fewer layers; logits compared.

Outputs under ``--out``: ``gpu_check.json`` (everything, rewritten after each step), ``gpu_check.md`` (the tables),
``attention_decode.json`` / ``attention_prefill.json`` (the benchmark's own raw rows).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SDPA_NAMES = ("torch-sdpa", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa-math")
STEPS = ("machine", "tests", "kernel", "decode", "model", "serve", "backward", "fp32", "prefill", "variants", "kv",
         "flex", "sweep")  # fmt: skip
DEFAULT_STEPS = STEPS[:-2]  # flex, sweep: measured in run 3
TOKENIZER = ROOT / ".gpu" / "smollm2-tokenizer"  # SmolLM2's tokenizer files (carried: the GGUF cannot travel)

# Whole-model configs (HF Llama config keys). SmolLM2-135M's shapes; a Llama-3-8B-like one with fewer layers.


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-check")), help="output folder")
    p.add_argument("--dry", action="store_true", help="CPU, tiny shapes: check the plumbing, measure nothing real")
    p.add_argument(
        "--steps",
        nargs="+",
        choices=STEPS,
        default=list(DEFAULT_STEPS),
        help="which steps (default: all but flex and sweep)",
    )
    p.add_argument("--budget-s", type=float, default=560.0, help="whole run's time budget in seconds (default 560)")
    p.add_argument("--device", default="cuda", help="CUDA device (default: cuda)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.budget_s <= 0:
        parser.error(f"--budget-s must be > 0, got {args.budget_s}")
    if not args.dry:
        if not torch.cuda.is_available():
            parser.error("no CUDA device: run on a GPU machine, or pass --dry for the CPU plumbing check")
        try:
            device = torch.device(args.device)
        except RuntimeError:
            parser.error(f"--device {args.device!r} is not a torch device")
        if device.type != "cuda":
            parser.error(f"--device must be a CUDA device, got {args.device!r}")
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out} exists and is not a folder")
    return args


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def machine(device: torch.device, dry: bool) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "device": str(device)}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= {"gpu": props.name, "capability": list(torch.cuda.get_device_capability(device)),
                 "memory_gib": round(props.total_memory / 2**30, 1), "sms": props.multi_processor_count,
                 "cuda": torch.version.cuda}  # fmt: skip
    from gqa.bench.model.cuda import copy_gbs

    info["copy_gbs"] = copy_gbs(device, 2**22 if dry else 2**31)
    return info


def run_tests(dry: bool, budget_s: float, out: Path) -> dict:
    """``pytest -m cuda`` in a subprocess, its output kept in ``out/tests.log`` (also when it runs out of time); on
    --dry only collects them (no CUDA here)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "tests/decoding/test_gpu.py"]
    if dry:
        cmd.append("--collect-only")
    log = out / "tests.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, text=True)
        try:
            code = proc.wait(timeout=budget_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            code = None
    tail = log.read_text()[-6000:]
    if code is None:
        tail += f"\n[gpu_check] timed out after {budget_s:.0f} s"
    return {"command": " ".join(cmd[1:]), "returncode": code, "tail": tail}


def attention(kind: str, out: Path, dry: bool, device: torch.device, budget_s: float) -> dict:
    """One ``gqa bench attention`` run (decode or prefill) in this process; its rows summarised per case."""
    from gqa.bench.attention.benchmark import main as bench_main

    path = out / f"attention_{kind}.json"
    impls = ["auto", "triton", "torch-sdpa", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient"]
    if dry and kind in ("flex", "fp32"):
        return {"argv": [], "returncode": 0, "rows": [], "limits": None}  # compiled flex on CPU: too slow to check
    if dry:
        argv = ["--device", "cpu", "--quick", "--dtypes", "fp32", "--q-heads", "4", "--head-dim", "16",
                "--kv-heads", "4", "1", "--impls", "auto", "grouped", "torch-sdpa", "hf-repeat_kv"]  # fmt: skip
        argv += ["--kinds", "decode", "--batches", "1", "--contexts", "64"] if kind == "decode" else \
            ["--kinds", "prefill", "--prefill-lens", "32", "--masks", "causal"]  # fmt: skip
    elif kind == "fp32":  # SDPA has no natively grouped float32 kernel: torch falls to math
        argv = ["--device", str(device), "--quick", "--dtypes", "fp32", "--q-heads", "32", "--head-dim", "128",
                "--kv-heads", "8", "1", "--impls", "auto", "triton", "torch-sdpa", "sdpa-efficient", "sdpa-math",
                "--kinds", "decode", "--batches", "1", "64", "--contexts", "4k"]  # fmt: skip
    elif kind == "flex":  # compiled once per shape (seconds each): a few decode shapes, apart from the main grid
        argv = ["--device", str(device), "--quick", "--dtypes", "bf16", "--q-heads", "32", "--head-dim", "128",
                "--kv-heads", "8", "4", "--impls", "auto", "torch-sdpa", "flex", "--kinds", "decode",
                "--batches", "8", "--contexts", "4k", "16k"]  # fmt: skip
    else:
        argv = ["--device", str(device), "--quick", "--dtypes", "bf16", "--q-heads", "32", "--head-dim", "128",
                "--kv-heads", "32", "8", "4", "1", "--impls", *impls]  # fmt: skip
        argv += ["--kinds", "decode", "--batches", "1", "8", "64", "--contexts", "1k", "4k", "16k", "64k"] \
            if kind == "decode" else ["--kinds", "prefill", "--prefill-lens", "4k", "--masks", "causal"]  # fmt: skip
    argv += ["--json", str(path), "--max-seconds", f"{budget_s:.0f}", "--no-progress"]
    code = bench_main(argv)
    payload = json.loads(path.read_text())
    return {"argv": argv, "returncode": code, "rows": [summarise(row) for row in payload["rows"]],
            "limits": payload.get("limits")}  # fmt: skip


def summarise(row: dict) -> dict:
    """A benchmark row as the check's table needs it: times of ours and the peers, the best SDPA kernel."""
    out = {k: row.get(k) for k in ("kind", "dtype", "B", "H_q", "H_kv", "L", "S", "D", "mask", "min_bytes", "status")}
    if row.get("status") != "ran":
        return out | {"skip_reason": row.get("skip_reason")}
    med = row["median_ms"]
    sdpa = {n: med.get(n) for n in SDPA_NAMES if med.get(n)}
    best = min(sdpa, key=sdpa.get) if sdpa else None
    return out | {
        "median_ms": med,
        "auto_backend": row.get("auto_backend"),
        "best_sdpa": best,
        "best_sdpa_ms": sdpa.get(best) if best else None,
        "math_ms": med.get("sdpa-math"),
        "skipped": row.get("skipped", {}),
        "mismatches": row.get("mismatches", []),
        "errors": row.get("errors", {}),
    }


def graph_ms(fn, device: torch.device, replays: int = 20) -> float:
    """Milliseconds per call of ``fn`` captured in a CUDA graph and replayed (launch overhead excluded)."""
    fn()
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def host_us(fn, device: torch.device, calls: int = 200) -> float:
    """CPU microseconds per call of ``fn`` issued back to back without synchronising (small inputs)."""
    for _ in range(5):
        fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    spent = time.perf_counter() - start
    _sync(device)
    return spent / calls * 1e6


def _decode_inputs(B: int, H_kv: int, S: int, device: torch.device, dtype=torch.bfloat16, L: int = 1):
    g = torch.Generator(device=device).manual_seed(B + H_kv + S)
    q = torch.randn(B, 32, L, 128, device=device, dtype=dtype, generator=g)
    k = torch.randn(B, H_kv, S, 128, device=device, dtype=dtype, generator=g)
    v = torch.randn(B, H_kv, S, 128, device=device, dtype=dtype, generator=g)
    return q, k, v


def _host_times(device: torch.device) -> dict[str, float | str]:
    """Host µs per call of each eager path next to the SDPA call it stands for (the same tensors)."""
    import torch.nn.functional as F

    import gqa
    from gqa.kernels.triton.split_kv import split_kv_attention

    calls = {}
    for label, H_kv in (("GQA 32/8", 8), ("MHA 32/32", 32), ("MQA 32/1", 1)):
        q, k, v = _decode_inputs(1, H_kv, 1024, device)
        grouped = H_kv != 32
        calls[f"F.sdpa decode {label}"] = lambda q=q, k=k, v=v, g=grouped: F.scaled_dot_product_attention(
            q, k, v, enable_gqa=g
        )
        calls[f"gqa auto decode {label}"] = lambda q=q, k=k, v=v: gqa.grouped_attention(q, k, v)
    q, k, v = _decode_inputs(1, 8, 1024, device)
    mask = torch.rand(1, 1, 1, 1024, device=device) > 0.1
    calls["F.sdpa decode bool mask"] = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    calls["gqa auto decode bool mask"] = lambda: gqa.grouped_attention(q, k, v, attn_mask=mask)
    calls["gqa triton decode"] = lambda: gqa.grouped_attention(q, k, v, backend="triton")
    calls["split_kv_attention"] = lambda: split_kv_attention(q, k, v)
    q32, k32, v32 = _decode_inputs(1, 8, 1024, device, dtype=torch.float32)
    calls["F.sdpa decode fp32"] = lambda: F.scaled_dot_product_attention(q32, k32, v32, enable_gqa=True)
    calls["gqa auto decode fp32"] = lambda: gqa.grouped_attention(q32, k32, v32)
    qp, kp, vp = _decode_inputs(1, 8, 1024, device, L=1024)
    calls["F.sdpa prefill causal"] = lambda: F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
    calls["gqa auto prefill causal"] = lambda: gqa.grouped_attention(qp, kp, vp, is_causal=True)
    qc = qp[:, :, :16]
    calls["F.sdpa chunk lower-right"] = lambda: F.scaled_dot_product_attention(
        qc, kp, vp, attn_mask=_lower_right(16, 1024), enable_gqa=True
    )
    calls["gqa auto chunk causal"] = lambda: gqa.grouped_attention(qc, kp, vp, is_causal=True)
    times: dict[str, float | str] = {}
    for name, fn in calls.items():
        try:
            times[name] = host_us(fn, device)
            if name.startswith("gqa auto"):
                times[name.replace("gqa auto", "auto runs")] = gqa.attention.last_backend()
        except Exception as err:  # one path failing must not lose the others
            times[name] = f"{type(err).__name__}: {str(err)[:120]}"
    for name, (a, b, c, causal) in {"decode": (q, k, v, False), "prefill causal": (qp, kp, vp, True)}.items():
        choice = torch._fused_sdp_choice(a, b, c, None, 0.0, causal, enable_gqa=True)
        times[f"torch picks for {name}"] = torch.nn.attention.SDPBackend(choice).name
    return times


def _lower_right(L: int, S: int):
    from torch.nn.attention.bias import causal_lower_right

    return causal_lower_right(L, S)


def _sweep_row(B: int, H_kv: int, S: int, device: torch.device) -> dict:
    import torch.nn.functional as F

    from gqa.attention.checks import check_qkv
    from gqa.kernels.triton.split_kv import CONFIGS, launch

    q, k, v = _decode_inputs(B, H_kv, S, device)
    shape = check_qkv(q, k, v)
    row = {"B": B, "H_kv": H_kv, "S": S, "bytes": 2 * k.nbytes + 2 * q.nbytes,
           "sdpa_ms": graph_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), device)}  # fmt: skip
    for config in CONFIGS:
        try:
            row[f"triton {config}"] = graph_ms(
                lambda c=config: launch(q, k, v, shape, 128**-0.5, False, None, None, None, None, c), device
            )
        except Exception as err:  # a configuration that does not compile (shared memory): recorded
            row[f"triton {config}"] = f"{type(err).__name__}: {str(err)[:200]}"
    return row


@torch.inference_mode()
def kernel_step(device: torch.device, dry: bool, copy_gbs: float | None) -> dict:
    """Host µs per call of every eager path (the route cache's effect: ``gqa.attention.routes``)."""
    if dry:
        return {"host_us": {}}
    return {"host_us": _host_times(device), "copy_gbs": copy_gbs}


@torch.inference_mode()
def sweep_step(device: torch.device, dry: bool) -> dict:
    """Graph-replayed kernel time per tile configuration vs SDPA (torch's pick): run 3's table."""
    if dry:
        return {"sweep": []}
    sweep = []
    for B, H_kv, S in ((8, 8, 16384), (64, 8, 16384), (1, 8, 65536), (64, 1, 16384)):
        sweep.append(_sweep_row(B, H_kv, S, device))
        torch.cuda.empty_cache()
    return {"sweep": sweep}


def backward_step(device: torch.device, dry: bool) -> list[dict]:
    """``gqa bench attention --backward``'s rows: forward + backward of causal prefill (bf16, D=128, B=1), GQA 32/8
    and MQA at 4k-16k, gqa ``auto`` vs SDPA as torch picks and held to each kernel, gradients checked."""
    from gqa.bench.attention.backward import backward_row

    if dry:
        return [backward_row(4, 1, 32, 16, torch.float32, device, repeats=1)]
    shapes = ((8, 4096), (8, 8192), (8, 16384), (1, 4096), (1, 16384))
    return [backward_row(32, h, L, 128, torch.bfloat16, device, repeats=10) for h, L in shapes]


def smollm2_tokenizer() -> Path:
    """SmolLM2's tokenizer as HF files under ``.gpu/`` (ignored by git, carried to the GPU machine, where the embedded
    GGUF cannot travel): made from the embedded model where it is installed, else it must have been carried."""
    if not TOKENIZER.is_dir():
        from gqa.loaders import default_model_path, load_tokenizer

        try:
            path = default_model_path()
        except Exception as err:
            raise FileNotFoundError(f"{TOKENIZER} is missing: run this on the CPU machine first ({err})") from err
        tmp = TOKENIZER.with_name(TOKENIZER.name + ".tmp")
        load_tokenizer(path).hf.save_pretrained(tmp)
        tmp.replace(TOKENIZER)
    return TOKENIZER


def variants_step(out: Path, device: torch.device, dry: bool) -> list[dict]:
    """``gqa bench attention --variants``: decode at 32k with a 4k window, as a band mask, soft-capped and with sinks,
    beside plain attention (bf16, 32/8 and 32/1 heads, D=128), each checked first."""
    from gqa.bench.attention.benchmark import main as bench_main

    path = out / "attention_variants.json"
    argv = ["--variants", "--device", str(device), "--json", str(path)]
    size = ["--q-heads", "4", "--head-dim", "16", "--kv-heads", "1"] if dry else \
        ["--q-heads", "32", "--head-dim", "128", "--kv-heads", "8", "1", "--batches", "8"]  # fmt: skip
    argv += ["--quick", "--dtypes", "fp32", *size] if dry else ["--dtypes", "bf16", *size]
    bench_main(argv)
    return json.loads(path.read_text())["rows"]


def serve_model(folder: Path, dry: bool) -> Path:
    """Random SmolLM2-shaped weights (bf16) saved as an HF folder with SmolLM2's tokenizer, for ``gqa serve``."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = smollm2_tokenizer()
    from gqa.bench.model.cuda import SMOLLM2

    config = dict(SMOLLM2, num_hidden_layers=2) if dry else SMOLLM2
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config, bos_token_id=1, eos_token_id=2)).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    for f in tokenizer.iterdir():
        shutil.copy(f, folder / f.name)
    return folder


def bench_serve(out: Path, model: Path, device: str, extra: list[str], budget_s: float) -> dict:
    """``gqa bench serve`` on ``model`` in a subprocess; its results.json, or the failure's tail."""
    cmd = [sys.executable, "-m", "gqa", "bench", "serve", "--model", str(model), "--device", device, "--engines",
           "gqa", "--out", str(out), *extra]  # fmt: skip
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=budget_s)
    except subprocess.TimeoutExpired:
        return {"command": " ".join(cmd[1:]), "error": f"timed out after {budget_s:.0f} s"}
    results = out / "results.json"
    if proc.returncode != 0 or not results.is_file():
        return {"command": " ".join(cmd[1:]), "error": (proc.stdout + proc.stderr)[-3000:]}
    return {"command": " ".join(cmd[1:]), **json.loads(results.read_text())}


def serve_step(out: Path, device: torch.device, dry: bool, budget_s: float) -> dict:
    """gqa serve on the device with random SmolLM2-shaped weights: 1, 16 and 64 streaming clients (output tok/s,
    TTFT, every response compared with the same request alone), with its CUDA-graph decode steps and again with
    --enforce-eager (every step eager), the responses compared."""
    model = serve_model(out / "serve-model", dry)
    # 64 prompts of 16 tokens: one client streams ~32 tok/s eagerly (H100 run 2), so ~35 s of the budget for that row
    extra = ["--clients", "1", "2", "--prompts", "2", "--max-tokens", "4"] if dry else \
        ["--clients", "1", "16", "64", "--prompts", "64", "--max-tokens", "16", "--kv-cache-mib", "4096",
         "--eager"]  # fmt: skip
    return bench_serve(out / "serve", model, "cpu" if dry else str(device), extra, budget_s)


def kv_step(out: Path, device: torch.device, dry: bool, budget_s: float) -> dict:
    """MHA, GQA and MQA (the random SmolLM2 shapes converted to 9, 3 and 1 KV heads) under one KV budget."""
    model = out / "serve-model"
    if not model.is_dir():
        serve_model(model, dry)
    extra = ["--clients", "2", "--prompts", "2", "--max-tokens", "4", "--kv-heads", "1"] if dry else \
        ["--clients", "64", "--prompts", "64", "--max-tokens", "64", "--kv-heads", "9", "3", "1", "--kv-budget-mib",
         "256", "--kv-context", "2048", "--kv-max-tokens", "64"]  # fmt: skip
    return bench_serve(out / "kv", model, "cpu" if dry else str(device), extra, budget_s)


def models(device: torch.device, dry: bool, deadline: float) -> list[dict]:
    """``gqa bench model --device cuda``'s rows (``gqa.bench.model.cuda``); --dry: a tiny model on CPU."""
    from gqa.bench.model.cuda import ENGINES, cuda_rows

    if dry:
        return cuda_rows(device, ["tiny"], [2], ("gqa", "hf"), prompt_len=8, new_tokens=4, dtype=torch.float32,
                         repeats=1)  # fmt: skip
    return cuda_rows(device, ["smollm2", "llama-1b"], [1, 64, 8], ENGINES, deadline=deadline)


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}"


def markdown(result: dict) -> str:
    """The check's tables (decode, prefill, models) in markdown."""
    m = result.get("machine", {})
    copy = m.get("copy_gbs")
    lines = [f"# gqa GPU check — {m.get('gpu', m.get('device'))}, torch {m.get('torch')}, triton {m.get('triton')}",
             "", f"Device-to-device copy: {copy:.0f} GB/s (read + write)." if copy else "", ""]  # fmt: skip
    for kind in ("decode", "fp32", "prefill", "flex"):
        step = result.get(kind)
        if not step:
            continue
        dtype = "fp32" if kind == "fp32" else "bf16"
        lines += [f"## Attention {kind} ({dtype}, D=128, H_q=32; ms, CUDA-event medians, L2 flushed)", "",
                  "| B | H_kv | L | S | auto | triton | best SDPA (kernel) | SDPA math | hf repeat_kv | flex | "
                  "auto GB/s | % of copy | auto vs best SDPA |", "|" + "---|" * 13]  # fmt: skip
        for r in step["rows"]:
            if r.get("status") != "ran":
                lines.append(f"| {r['B']} | {r['H_kv']} | {r['L']} | {r['S']} | skipped: {r.get('skip_reason')} |")
                continue
            med = r["median_ms"]
            auto = med.get("auto")
            gbs = r["min_bytes"] / (auto * 1e-3) / 1e9 if auto else None
            pct = f"{100 * gbs / copy:.0f}%" if gbs and copy else "—"
            ratio = f"{r['best_sdpa_ms'] / auto:.2f}x" if auto and r.get("best_sdpa_ms") else "—"
            lines.append(
                f"| {r['B']} | {r['H_kv']} | {r['L']} | {r['S']} | {_ms(auto)} ({r.get('auto_backend')}) | "
                f"{_ms(med.get('triton'))} | {_ms(r.get('best_sdpa_ms'))} ({r.get('best_sdpa')}) | "
                f"{_ms(r.get('math_ms'))} | {_ms(med.get('hf-repeat_kv'))} | {_ms(med.get('flex'))} | "
                f"{'—' if gbs is None else f'{gbs:.0f}'} | {pct} | {ratio} |"
            )
        lines.append("")
    kern = result.get("kernel") or {}
    if kern.get("host_us"):
        lines += ["## Host time per call (CPU µs, back-to-back, no synchronisation)", "", "| path | µs |", "|---|---|"]
        lines += [f"| {name} | {us if isinstance(us, str) else f'{us:.1f}'} |" for name, us in kern["host_us"].items()]
        lines.append("")
    sweep = (result.get("sweep") or {}).get("sweep")
    if sweep:
        configs = [key for key in sweep[0] if key.startswith("triton")]
        lines += ["## Decode kernels replayed from CUDA graphs (bf16, H_q=32, D=128; ms, GB/s = K/V + q + out bytes)",
                  "", "| B | H_kv | S | SDPA, torch's pick: ms (GB/s) | " + " | ".join(configs) + " |",
                  "|" + "---|" * (4 + len(configs))]  # fmt: skip
        for r in sweep:

            def cell(ms, nbytes=r["bytes"]):
                return f"{ms:.3f} ({nbytes / ms / 1e6:.0f})" if isinstance(ms, float) else "fails"

            lines.append(f"| {r['B']} | {r['H_kv']} | {r['S']} | {cell(r['sdpa_ms'])} | "
                         + " | ".join(cell(r[c]) for c in configs) + " |")  # fmt: skip
        lines.append("")
    if result.get("model"):
        from gqa.bench.model.cuda import table as model_table

        lines += model_table(result["model"], copy)
    for step, title in (
        ("serve", "gqa serve on the GPU, random SmolLM2-shaped bf16 weights, 64 greedy tokens"),
        ("kv", "MHA / GQA / MQA under one 256 MiB KV budget (2048-token contexts, 64 clients)"),
    ):
        got = result.get(step)
        if got:
            from gqa.bench.serve import table

            body = table(got["rows"]) if "rows" in got else f"failed:\n\n```\n{got.get('error', '')[-1500:]}\n```"
            lines += [f"## {title}", "", f"`{got.get('command', '')}`", "", body, ""]
    if result.get("variants"):
        from gqa.bench.attention.variants import table as variants_table

        lines += ["## Decode with a window, soft-capping and sinks (ms; each checked against its reference)", "",
                  variants_table(result["variants"]), ""]  # fmt: skip
    if result.get("backward"):
        from gqa.bench.attention.backward import table as backward_table

        lines += ["## Prefill forward + backward (causal, B=1; ms (TFLOPS), gradients checked against SDPA's)", "",
                  backward_table(result["backward"]), ""]  # fmt: skip
    return "\n".join(lines)


def _write(out: Path, result: dict) -> None:
    for name, text in (
        ("gpu_check.json", json.dumps(result, indent=1, default=str)),
        ("gpu_check.md", markdown(result)),
    ):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(out / name)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu" if args.dry else args.device)
    start = time.perf_counter()
    # shares of the budget per step; the model step runs until a deadline that leaves the later steps theirs
    # serve and kv start servers (~12 s to load on the GPU each, H100 run 1 gave them too little: 64 and 42 s); serve
    # runs twice (CUDA graphs, then --enforce-eager), kv with graphs only
    shares = {"tests": 0.11, "decode": 0.11, "serve": 0.25, "backward": 0.04, "fp32": 0.02, "prefill": 0.02,
              "variants": 0.03, "kv": 0.15, "flex": 0.08}  # fmt: skip
    result: dict = {"argv": sys.argv[1:] if argv is None else argv, "dry": args.dry, "steps": {}}
    for step in STEPS:
        if step not in args.steps:
            continue
        left = args.budget_s - (time.perf_counter() - start)
        t0 = time.perf_counter()
        print(f"[gpu_check] {step} ({left:.0f} s left)", file=sys.stderr, flush=True)
        try:
            if step == "machine":
                result["machine"] = machine(device, args.dry)
            elif step == "tests":
                result["tests"] = run_tests(args.dry, max(45.0, shares["tests"] * args.budget_s), args.out)
            elif step == "kernel":
                result["kernel"] = kernel_step(device, args.dry, result.get("machine", {}).get("copy_gbs"))
            elif step == "sweep":
                result["sweep"] = sweep_step(device, args.dry)
            elif step in ("decode", "fp32", "prefill", "flex"):
                result[step] = attention(step, args.out, args.dry, device, max(10.0, shares[step] * args.budget_s))
            elif step in ("serve", "kv"):
                fn = serve_step if step == "serve" else kv_step
                result[step] = fn(args.out, device, args.dry, max(30.0, shares[step] * args.budget_s))
            elif step == "backward":
                result["backward"] = backward_step(device, args.dry)
            elif step == "variants":
                result["variants"] = variants_step(args.out, device, args.dry)
            elif step == "model":
                later = sum(shares.get(s, 0.0) for s in STEPS[STEPS.index("model") + 1 :] if s in args.steps)
                deadline = start + args.budget_s * (1.0 - later)
                result["model"] = models(device, args.dry, deadline)
            result["steps"][step] = {"ok": True, "seconds": time.perf_counter() - t0}
        except Exception as err:  # one failing step must not lose the others' numbers
            result["steps"][step] = {"ok": False, "seconds": time.perf_counter() - t0,
                                     "error": f"{type(err).__name__}: {err}"}  # fmt: skip
            print(f"[gpu_check] {step} failed: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        _write(args.out, result)
    print(markdown(result))
    return 0 if all(s["ok"] for s in result["steps"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
