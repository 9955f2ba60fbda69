"""The flags of ``gqa bench model``, without torch (``gqa bench model --help``); ``model`` runs the benchmark and
``model_worker`` each engine."""

from __future__ import annotations

import argparse
from pathlib import Path

from ...options.common import KV_CACHE_DTYPES
from ...options.defaults import QUANT_FORMATS
from ...options.dtypes import dtype_type

__all__ = [
    "CPU_CONTEXTS",
    "CPU_ENGINES",
    "CUDA_SHAPES",
    "DESCRIPTION",
    "ENGINES",
    "FILE_BLOCKS",
    "FLOAT_DTYPES",
    "QUANTIZED",
    "SHAPES",
    "add_arguments",
]

RUN = "gqa.bench.model.benchmark"  # the module whose run(parser, args) runs the benchmark (it imports torch)
HELP = "KV-cache size, prefill and decode tokens/s of gqa vs HF transformers, the model as MHA, GQA and MQA"
DESCRIPTION = (  # the first paragraph of gqa.bench.model's docstring
    "Whole-model benchmark: KV-cache size, prefill and decode tokens/s of gqa vs HF transformers on the same weights, "
    "for the model as MHA, GQA and MQA."
)
FLOAT_DTYPES = ("fp32", "bf16")  # the float weights the benchmark runs (and HF transformers with it)
FILE_BLOCKS = "gguf"  # a GGUF file's own tensors as they are (a Q4_K_M file: Q4_K, Q6_K, Q5_0, Q8_0 together)
QUANTIZED = (*QUANT_FORMATS, FILE_BLOCKS)  # the block formats
ENGINES = ("gqa", "gqa-compile", "hf", "hf-static-compile", "llama.cpp")
CPU_ENGINES = ("gqa", "hf", "llama.cpp")  # --engines' default on CPU
SHAPES = ("smollm2", "llama-1b", "llama-3b", "llama-8b")  # the model shapes run with random weights
CUDA_SHAPES = ("smollm2", "llama-1b")  # --device cuda's default
CPU_CONTEXTS = (128, 512, 2048)  # --shapes on the CPU: the prompt lengths


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``gqa bench model`` on ``parser``."""
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: embedded SmolLM2-135M)")
    parser.add_argument("--kv-heads", type=int, nargs="+", default=None, metavar="N",
                        help="KV head counts to run (default: H_q, the model's own, 1; SmolLM2: 9 3 1)")  # fmt: skip
    parser.add_argument("--contexts", type=int, nargs="+", default=None, metavar="S",
                        help="prompt lengths in tokens (default: 128 1024 4096; with --tp: 512)")  # fmt: skip
    parser.add_argument(
        "--dtypes", nargs="+", type=dtype_type(FLOAT_DTYPES, QUANTIZED), default=["fp32", "bf16", "q4_1"],
        metavar="DTYPE",
        help="weights: fp32, bf16, a block format q8_0, q4_0, q4_1, q5_0, q5_1 (a GGUF's own blocks when the file "
        "is in that format, else quantized on load), or gguf: the GGUF file's tensors as they are, every block "
        "format kept (a Q4_K_M file's Q4_K/Q6_K/Q5_0/Q8_0; the model's own KV heads only); activations bf16 where "
        "the CPU has native bf16",
    )  # fmt: skip
    parser.add_argument(
        "--kv-cache-dtypes", nargs="+", choices=KV_CACHE_DTYPES, default=["auto"], metavar="KV",
        help="what the KV cache stores, each run side by side: auto (the activations' dtype), a float dtype equal to "
        "them, or llama.cpp's q8_0 / q4_0 blocks of 32 values (gqa serve's --kv-cache-dtype; llama.cpp runs with "
        "-ctk/-ctv the same and flash attention; hf and gqa-compile take float caches and are skipped for block "
        "types, with a note); the KV bytes reported are the caches'",
    )  # fmt: skip
    parser.add_argument(
        "--engines", nargs="+", choices=ENGINES, default=None,
        help="what runs the model: gqa (the default path of model.generate / gqa generate), gqa-compile "
        "(compile=True), hf (transformers; float dtypes), hf-static-compile (transformers' static cache, which it "
        "compiles; --device cuda), llama.cpp (llama-cpp-python on the GGUF file in its own format; skipped when not "
        "installed: make llama-cpp) (default: gqa hf llama.cpp; on CUDA every one but llama.cpp)",
    )  # fmt: skip
    parser.add_argument(
        "--device", default="cpu", metavar="DEV",
        help="cpu, or cuda / cuda:N: greedy decode of --shapes with random bf16 weights at --batch sizes (1 8 64 "
        "unless given), gqa (CUDA graphs; gqa-compile: the Inductor-compiled step) vs HF eager and static cache + "
        "compile, with the bytes per step read as GB/s",
    )  # fmt: skip
    parser.add_argument(
        "--shapes", nargs="+", choices=SHAPES, default=None,
        help="random models of these shapes (SmolLM2-135M's, Llama-3.2-1B/3B's, Llama-3.1-8B's). --device cuda: bf16 "
        "weights, gqa vs HF, smollm2 and llama-1b unless given. On the CPU (llama-*): Q4_K_M GGUF files made once in "
        "--model-dir (F16 written tensor by tensor, quantized by llama.cpp's llama-quantize) and run by gqa and by "
        "llama.cpp's llama-bench on the same file and threads: decode, prompt processing at --contexts (128 512 2048 "
        "unless given), load to first token with a cold and a warm page cache, peak RSS",
    )  # fmt: skip
    parser.add_argument("--model-dir", type=Path, default=None, metavar="DIR",
                        help="--shapes on the CPU: where the model files are made and kept (default: "
                        "GQA_CACHE_DIR/bench-models; 1.7 GiB for llama-3b, 4.6 GiB for llama-8b, and the F16 file "
                        "while it is quantized: 6 / 16 GB)")  # fmt: skip
    parser.add_argument("--llama-cpp", type=Path, default=None, metavar="DIR",
                        help="--shapes on the CPU: the folder of llama.cpp's llama-bench and llama-quantize (default: "
                        "found on PATH)")  # fmt: skip
    parser.add_argument(
        "--batch", type=int, nargs="+", default=None, metavar="B",
        help="instead: decode throughput of B sequences at once (gqa engine; caches filled to each context)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-budget", type=float, default=None, metavar="GIB",
        help="with --batch: also the largest batch whose KV cache fits GIB GiB at each context, and its throughput",
    )  # fmt: skip
    parser.add_argument(
        "--window-caches", action="store_true",
        help="instead: a Gemma-3-1B-like random model (26 layers, 5 of every 6 sliding with 512 keys) decoded with "
        "window-sized caches on its sliding layers vs full caches: KV memory held and decode tok/s at each context "
        "(--contexts 4096 16384 unless given; one float --dtypes, fp32 unless given)",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, default=1, metavar="N",
                        help="--window-caches: runs of each, the median reported; --shapes: prompt-processing runs "
                        "of each length after a warm-up (llama-bench -r)")  # fmt: skip
    parser.add_argument("--new-tokens", type=int, default=32, metavar="N", help="tokens generated per context")
    parser.add_argument("--quick", action="store_true", help="contexts 64 and 256, 8 new tokens, fp32, no compile")
    parser.add_argument(
        "--tp", type=int, nargs="+", default=None, metavar="N",
        help="instead: the model (as it is) decoded by N tensor-parallel local processes for each N, eager, with "
        "per-rank weight and KV-cache bytes and the all-reduces' share of decode time (e.g. --tp 1 2 3)",
    )  # fmt: skip
    parser.add_argument(
        "--json", type=Path, default=None, metavar="PATH", help="write every number and the machine here"
    )
    parser.add_argument("--markdown", type=Path, default=None, metavar="PATH", help="write the table here")
    parser.add_argument(
        "--plot", type=Path, default=None, metavar="PATH", help="write the PNG plot here (needs matplotlib)"
    )
