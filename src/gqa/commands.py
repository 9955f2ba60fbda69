"""``gqa generate`` and ``gqa info``: the model commands of the CLI."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from . import kernels
from .cache import kv_cache_bytes
from .cli_dtypes import DTYPES, add_dtype_argument

EMBEDDED_MODEL = "embedded SmolLM2-135M-Instruct"


def model_label(path: str | None) -> str:
    """How messages name a model: the path as given, or the embedded SmolLM2."""
    return EMBEDDED_MODEL if path is None else path


@contextmanager
def loading(what: str, *, timed: bool = True) -> Iterator[None]:
    """``Loading {what} ...`` on stderr (stdout stays the command's output) before the slow part this wraps; when
    ``timed``, the line ends with the seconds it took (or just ends, if it fails)."""
    print(f"Loading {what} ...", end="" if timed else "\n", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        yield
    except BaseException:
        if timed:
            print(file=sys.stderr, flush=True)
        raise
    if timed:
        print(f" {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


def add_model_arguments(parser: argparse.ArgumentParser, dtype_help: str = "weight dtype") -> None:
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: embedded SmolLM2-135M)")
    add_dtype_argument(parser, "--dtype", default="fp32", help=dtype_help)


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt (a user message, or plain text with --raw)")
    add_model_arguments(parser)
    parser.add_argument("--raw", action="store_true", help="plain continuation, no chat template")
    parser.add_argument("--system", default=None, help="system message for the chat template (default: none)")
    parser.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="stop after N new tokens")
    parser.add_argument(
        "--temperature", type=float, default=0.0, metavar="T", help="sampling temperature; 0 is greedy decoding"
    )
    parser.add_argument(
        "--top-k", type=int, default=None, metavar="K", help="with T > 0: sample from the K most likely tokens "
        "(default: off)"
    )  # fmt: skip
    parser.add_argument(
        "--top-p", type=float, default=None, metavar="P",
        help="with T > 0: sample from the most likely tokens that make up probability P (default: off)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=None, help="with T > 0: random seed (default: unseeded)")
    parser.add_argument("--stats", action="store_true", help="print prefill/decode tokens per second to stderr")


def warn_ignored_sampling(ns: argparse.Namespace) -> None:
    """Greedy decoding (``--temperature 0``) ignores ``--top-k``, ``--top-p`` and ``--seed``: say so on stderr."""
    ignored = [flag for flag, value in (("--top-k", ns.top_k), ("--top-p", ns.top_p), ("--seed", ns.seed)) if
               value is not None]  # fmt: skip
    if ns.temperature == 0 and ignored:
        print(
            f"gqa generate: warning: {' and '.join(ignored)} {'has' if len(ignored) == 1 else 'have'} no effect at "
            "--temperature 0 (greedy decoding); give a temperature > 0 to sample",
            file=sys.stderr,
        )


def run_generate(ns: argparse.Namespace) -> int:
    from .api import load_model
    from .generation import check_sampling, generate_stream

    check_sampling(ns.temperature, ns.top_k, ns.top_p)  # before the model is loaded
    if ns.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {ns.max_new_tokens}")
    warn_ignored_sampling(ns)
    with loading(f"{model_label(ns.model)} as {ns.dtype}"):
        model = load_model(ns.model, dtype=DTYPES[ns.dtype])
    tok = model.tokenizer
    if ns.raw:
        prompt_ids = tok.encode(ns.prompt)
    else:
        messages = ([{"role": "system", "content": ns.system}] if ns.system else []) + [
            {"role": "user", "content": ns.prompt}
        ]
        prompt_ids = tok.apply_chat(messages)
    generated: list[int] = []
    printed = ""
    start = time.perf_counter()
    first = None
    for token in generate_stream(
        model,
        [prompt_ids],
        max_new_tokens=ns.max_new_tokens,
        temperature=ns.temperature,
        top_k=ns.top_k,
        top_p=ns.top_p,
        seed=ns.seed,
        eos_token_ids=tok.eos_token_ids,
    ):
        first = first or time.perf_counter()
        t = int(token[0])
        if t in tok.eos_token_ids:
            break
        generated.append(t)
        text = tok.decode(generated)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            sys.stdout.write(text[len(printed) :])
            sys.stdout.flush()
            printed = text
    sys.stdout.write(tok.decode(generated)[len(printed) :] + "\n")
    end = time.perf_counter()
    if ns.stats and first is not None:
        decode_s = end - first
        print(
            f"[prompt {len(prompt_ids)} tokens, prefill {len(prompt_ids) / (first - start):.0f} tok/s; "
            f"{len(generated)} new tokens, decode {max(len(generated) - 1, 0) / max(decode_s, 1e-9):.1f} tok/s]",
            file=sys.stderr,
        )
    return 0


def kv_cache_table(num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> str:
    """Markdown table: KV-cache bytes per token and for 4096 tokens as MHA, this model's head count, and MQA."""
    rows = [("MHA", num_heads), (f"this model (GQA, {num_kv_heads} KV heads)", num_kv_heads), ("MQA", 1)]
    seen, lines = set(), []
    name = str(dtype).removeprefix("torch.")
    lines.append(f"| variant | KV heads | KV cache per token ({name}) | for 4096 tokens |")
    lines.append("|---|---:|---:|---:|")
    for label, heads in rows:
        if heads in seen:
            continue
        seen.add(heads)
        per_token = kv_cache_bytes(num_layers, heads, head_dim, 1, dtype=dtype)
        lines.append(f"| {label} | {heads} | {per_token / 1024:.1f} KiB | {per_token * 4096 / 2**20:.1f} MiB |")
    return "\n".join(lines)


def run_info(ns: argparse.Namespace) -> int:
    from .loaders import read_model

    with loading(model_label(ns.model)):
        cfg, state = read_model(ns.model)
    params = sum(t.numel() for k, t in state.items() if not (cfg.tie_word_embeddings and k == "lm_head.weight"))
    print(f"architecture     {cfg.arch}")
    print(f"parameters       {params / 1e6:.1f} M")
    print(f"layers           {cfg.num_layers}")
    print(f"hidden size      {cfg.hidden_size}")
    print(f"query heads      {cfg.num_heads}")
    print(f"KV heads         {cfg.num_kv_heads}  (group size {cfg.num_heads // cfg.num_kv_heads})")
    print(f"head dim         {cfg.head_dim}")
    print(f"context          {cfg.max_position_embeddings}")
    print(f"vocab            {cfg.vocab_size}")
    print(f"RoPE theta       {cfg.rope_theta:g}")
    native = f"built: {kernels.library_path()}" if kernels.available() else "not built (python -m gqa.kernels)"
    if kernels.available():
        simd = {16: "AVX-512", 8: "AVX2"}.get(kernels.simd_width())
        native += f" ({simd})" if simd else " (no AVX2/AVX-512 here: scalar, so used for bf16 decode attention only)"
    print(f"native kernels   {native}")
    print()
    print(kv_cache_table(cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, DTYPES[ns.dtype]))
    return 0
