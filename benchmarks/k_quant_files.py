"""The GGUF files of the K-quant benchmark (docs/performance.md), made by llama.cpp's own quantizer
(``llama_cpp.llama_model_quantize``, so ``make llama-cpp`` first):

* SmolLM2-135M-Instruct in Q4_K_M and Q6_K, requantized from the shipped Q4_1 file (``allow_requantize``): its rows
  of 576 values are not whole 256-value super-blocks, so llama.cpp falls back to Q5_0/Q8_0 for most tensors;
* a random Llama-shaped 1B model (hidden 2048, 16 layers, 32 query / 8 KV heads, MLP 8192, vocabulary 32,000) written
  as F16 with ``gguf`` and quantized to Q4_K_M: real Q4_K/Q6_K tensors throughout.

    python benchmarks/k_quant_files.py OUT_DIR
"""

from __future__ import annotations

import argparse
import ctypes
from pathlib import Path

import gguf
import numpy as np


def random_llama_f16(path: Path, hidden: int = 2048, layers: int = 16, heads: int = 32, kv_heads: int = 8,
                     mlp: int = 8192, vocab: int = 32000) -> Path:  # fmt: skip
    """A random Llama (weights ~ N(0, 0.02), norms 1) as an F16 GGUF with a placeholder SentencePiece vocabulary."""
    rng = np.random.default_rng(0)
    head_dim = hidden // heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(8192)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(mlp)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(500000.0)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<t{i}>" for i in range(vocab)])
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([1] * vocab)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    w.add_tensor("token_embd.weight", matrix(vocab, hidden))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.add_tensor("output.weight", matrix(vocab, hidden))
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.attn_q.weight", matrix(heads * head_dim, hidden))
        w.add_tensor(f"blk.{i}.attn_k.weight", matrix(kv_heads * head_dim, hidden))
        w.add_tensor(f"blk.{i}.attn_v.weight", matrix(kv_heads * head_dim, hidden))
        w.add_tensor(f"blk.{i}.attn_output.weight", matrix(hidden, heads * head_dim))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", matrix(mlp, hidden))
        w.add_tensor(f"blk.{i}.ffn_up.weight", matrix(mlp, hidden))
        w.add_tensor(f"blk.{i}.ffn_down.weight", matrix(hidden, mlp))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def quantize(src: Path, dst: Path, ftype: int) -> Path:
    """``src`` requantized to llama.cpp's file type ``ftype`` by llama.cpp."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src}")
    return dst


def main() -> None:
    import llama_cpp

    from gqa.loaders import default_model_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    out = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    smol = default_model_path()
    for name, ftype in (("Q4_K_M", llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M), ("Q6_K", llama_cpp.LLAMA_FTYPE_MOSTLY_Q6_K)):
        print(quantize(smol, out / f"SmolLM2-135M-Instruct.{name}.gguf", ftype))
    f16 = random_llama_f16(out / "random-llama-1b.F16.gguf")
    print(quantize(f16, out / "random-llama-1b.Q4_K_M.gguf", llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M))
    f16.unlink()


if __name__ == "__main__":
    main()
