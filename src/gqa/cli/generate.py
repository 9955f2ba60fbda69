"""``gqa generate``: text from a model, streamed to stdout."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

from ..options.common import (
    add_kv_dtype_arguments,
    add_model_arguments,
    add_tp_argument,
    kv_dtype_choice,
    kv_flag_errors,
    loading,
    model_label,
    torch_device,
)
from ..options.defaults import QUANT_FORMATS

if TYPE_CHECKING:
    import torch

HELP = "generate text with a model (default: embedded SmolLM2)"
DESCRIPTION = HELP


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``gqa generate`` on ``parser``."""
    parser.add_argument("prompt", help="the prompt (a user message, or plain text with --raw)")
    add_model_arguments(
        parser,
        "weight dtype; auto: bf16 where the CPU multiplies bf16 natively (AVX512-BF16/AMX), else fp32, and a GGUF's "
        "quantized weights (q4_k/q5_k/q6_k, q8_0, q4_0/q4_1, q5_0/q5_1) stay quantized; a float dtype dequantizes them",
        auto=True,
    )
    add_kv_dtype_arguments(parser)
    parser.add_argument(
        "--quantize", choices=sorted(QUANT_FORMATS), default=None,
        help="quantize the layers' weights to this block format after loading (embeddings and output: q8_0)",
    )  # fmt: skip
    parser.add_argument(
        "--compile", action="store_true",
        help="decode through torch.compile (compiled once per cache size, kept on disk; ~10 s per process even when "
        "cached). Off by default: the native CPU decode step is as fast without the wait",
    )  # fmt: skip
    parser.add_argument(
        "--device", default="cpu", metavar="DEV",
        help="cpu (the native kernels) or cuda / cuda:N (the model in device memory, each token a CUDA graph replay "
        "where triton is installed; auto dtype is bf16 there, quantized weights are dequantized)",
    )  # fmt: skip
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
    parser.add_argument(
        "--min-p", type=float, default=None, metavar="P",
        help="with T > 0: keep only tokens at least P times as likely as the likeliest (llama.cpp's and vLLM's "
        "min-p, after the temperature; default: off)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=None, help="with T > 0: random seed (default: unseeded)")
    parser.add_argument(
        "--stats", action="store_true",
        help="print prefill/decode tokens per second, and what ran (decode path, dtype, weights), to stderr",
    )  # fmt: skip
    add_tp_argument(parser)


def warn_ignored_sampling(ns: argparse.Namespace) -> None:
    """Greedy decoding (``--temperature 0``) ignores ``--top-k``, ``--top-p``, ``--min-p`` and ``--seed``: say so on
    stderr."""
    given = (("--top-k", ns.top_k), ("--top-p", ns.top_p), ("--min-p", ns.min_p), ("--seed", ns.seed))
    ignored = [flag for flag, value in given if value is not None]
    if ns.temperature == 0 and ignored:
        print(
            f"gqa generate: warning: {' and '.join(ignored)} {'has' if len(ignored) == 1 else 'have'} no effect at "
            "--temperature 0 (greedy decoding); give a temperature > 0 to sample",
            file=sys.stderr,
        )


def run(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> int:
    from ..decoding.sampling import SEED_RANGE, check_sampling
    from .parallel import run_on_ranks

    check_sampling(ns.temperature, ns.top_k, ns.top_p, ns.min_p)  # before the model is loaded
    if ns.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {ns.max_new_tokens}")
    if ns.seed is not None and not SEED_RANGE[0] <= ns.seed < SEED_RANGE[1]:
        raise ValueError(f"--seed must be in [-2**63, 2**64), got {ns.seed}")
    if ns.raw and ns.system is not None:
        raise ValueError("--system is a chat template's system message: it has no effect with --raw")
    if torch_device(ns.device).type != "cpu" and getattr(ns, "tp", 1) > 1:
        raise ValueError(f"--tp runs on CPU processes (gloo): it does not take --device {ns.device}")
    warn_ignored_sampling(ns)
    return run_on_ranks(ns, generate_text)


def generate_text(ns: argparse.Namespace) -> int:
    """Load the model (this rank's shard under tensor parallelism) and stream its answer; only the lead rank
    prints."""
    from ..decoding.generate import generate_stream
    from ..hardware import auto_dtype
    from ..loaders.model import load_model
    from ..options.dtypes import DTYPES
    from .parallel import is_lead

    lead = is_lead()
    dtype = ns.dtype if ns.dtype == "auto" else DTYPES[ns.dtype]
    device = torch_device(getattr(ns, "device", "cpu"))
    quantize = getattr(ns, "quantize", None)
    shown = ns.dtype
    if ns.dtype == "auto":  # say what auto means here; quantized GGUF blocks show in --stats
        shown = {v: k for k, v in DTYPES.items()}[auto_dtype(device)] + " (auto)"
    what = f"{model_label(ns.model)} as {shown}" + (f", quantized to {quantize}" if quantize else "")
    what += "" if device.type == "cpu" else f" on {device}"
    with kv_flag_errors(ns), loading(what, quiet=not lead):
        model = load_model(ns.model, dtype=dtype, tensor_parallel=getattr(ns, "sharded", False), quantize=quantize,
                           kv_dtype=kv_dtype_choice(ns), device=device)  # fmt: skip
    chosen: list = []  # the decode step select_step picked (--stats)
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
        min_p=ns.min_p,
        seed=ns.seed,
        eos_token_ids=tok.eos_token_ids,
        compile=getattr(ns, "compile", False),
        on_step=chosen.append,
    ):
        first = first or time.perf_counter()
        t = int(token[0])
        if t in tok.eos_token_ids:
            break
        generated.append(t)
        text = tok.decode(generated)
        if lead and not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            sys.stdout.write(text[len(printed) :])
            sys.stdout.flush()
            printed = text
    if lead:
        sys.stdout.write(tok.decode(generated)[len(printed) :] + "\n")
        sys.stdout.flush()
    end = time.perf_counter()
    if ns.stats and lead and first is not None:
        decode_s = end - first
        print(
            f"[prompt {len(prompt_ids)} tokens, prefill {len(prompt_ids) / (first - start):.0f} tok/s; "
            f"{len(generated)} new tokens, decode {max(len(generated) - 1, 0) / max(decode_s, 1e-9):.1f} tok/s]",
            file=sys.stderr,
        )
        path = chosen[0].name if chosen else "none (one token)"
        print(f"[decode: {path} step; activations {str(model.dtype).removeprefix('torch.')}; weights "
              f"{describe_weights(model)}]", file=sys.stderr)  # fmt: skip
    return 0


def describe_weights(model: torch.nn.Module) -> str:
    """``"q4_1 63.3 MiB + q8_0 28.7 MiB + bfloat16 0.1 MiB"``: the resident bytes of the weights by storage format."""
    from ..models.quantized import weight_bytes

    parts = sorted(weight_bytes(model).items(), key=lambda kv: -kv[1])
    return " + ".join(f"{name} {size / 2**20:.1f} MiB" for name, size in parts)
