"""``gqa convert [SRC] DST --kv-heads N``: change a model's KV head count and write an HF checkpoint folder."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from .cache import kv_cache_bytes
from .models.config import ModelConfig


def add_convert_arguments(parser: argparse.ArgumentParser) -> None:
    from .convert import DEFAULT_METHOD, METHODS

    src_help = "GGUF file or HF folder (default: embedded SmolLM2-135M-Instruct); never modified"
    parser.add_argument("src", nargs="?", default=None, metavar="SRC", help=src_help)
    parser.add_argument("dst", metavar="DST", help="the HF checkpoint folder to write")
    parser.add_argument("--kv-heads", type=int, required=True, metavar="N", help="new number of KV heads")
    method_help = f"how to merge KV heads when N is smaller (default: {DEFAULT_METHOD}); expanding is always exact"
    parser.add_argument("--method", choices=sorted(METHODS), default=DEFAULT_METHOD, help=method_help)
    parser.add_argument(
        "--calibration-text", type=Path, default=None, metavar="FILE",
        help="text for calibrated methods (default: standard-library docstrings)",
    )  # fmt: skip
    parser.add_argument("--force", action="store_true", help="replace DST if it exists")


def _source_config(src: str | None) -> ModelConfig:
    """The source's config, read from ``config.json`` or GGUF metadata without loading any weights."""
    from .loaders import resolve_model_path
    from .loaders.gguf_file import gguf_config, open_gguf
    from .loaders.hf_dir import hf_config

    path = resolve_model_path(src)
    return hf_config(path) if path.is_dir() else gguf_config(open_gguf(path), path)


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB"


def run_convert(ns: argparse.Namespace) -> int:
    from .convert import convert

    src, dst = ns.src, ns.dst
    if src is not None and not Path(src).expanduser().exists():
        raise FileNotFoundError(f"source model {src} does not exist")
    cfg = _source_config(src)
    text = None if ns.calibration_text is None else ns.calibration_text.read_text(encoding="utf-8")
    out = convert(src, dst, kv_heads=ns.kv_heads, method=ns.method, force=ns.force, calibration_text=text)
    n, h_kv = ns.kv_heads, cfg.num_kv_heads
    how = "copied" if n == h_kv else "expanded exactly" if n > h_kv else f"merged with method {ns.method!r}"
    before, after = (kv_cache_bytes(cfg.num_layers, h, cfg.head_dim, 1, dtype=torch.float32) for h in (h_kv, n))
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"source       {src or 'embedded SmolLM2-135M-Instruct'} ({cfg.arch}, {cfg.num_layers} layers)")
    print(f"heads        {cfg.num_heads} query heads; KV heads {h_kv} -> {n} ({how})")
    print(f"group size   {cfg.num_heads // h_kv} -> {cfg.num_heads // n} query heads per KV head")
    print(f"KV cache     {_kib(before)} -> {_kib(after)} per token in fp32 ({after / before:.2f}x)")
    print(f"wrote        {out}  ({', '.join(sorted(f.name for f in out.iterdir()))}; {size / 1e6:.1f} MB)")
    if n < h_kv:
        print("note         merged K/V heads usually change the model's outputs; the GQA paper uptrains after merging")
    return 0
