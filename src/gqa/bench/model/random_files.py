"""Random Llama-shaped GGUF files for ``gqa bench model --shapes``: written as F16 tensor by tensor (one tensor in
memory at a time, so an 8B model's 16 GB never is), quantized to Q4_K_M by llama.cpp's ``llama-quantize``, and
cached by name in a folder, so that a second run reuses them.

Weights ~ N(0, 0.02), norms 1, a placeholder vocabulary of ``<tN>`` tokens (SentencePiece "llama" model): speed does
not depend on the values, and both engines read the very same file. For servers (``gqa bench serve --shape``), whose
chat requests need a real tokenizer and chat template, ``tokenizer=`` copies another GGUF's (the embedded SmolLM2's:
GPT-2 BPE, 49,152 tokens, ChatML) and sizes the embeddings to it. Neither torch nor the model code is imported.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["LLAMA_SHAPES", "LlamaShape", "find_llama_tool", "model_file", "quantize", "tokenizer_fields",
           "write_random_f16"]  # fmt: skip


@dataclass(frozen=True)
class LlamaShape:
    """A Llama model's sizes: ``hidden`` (model width), ``layers``, ``heads`` query and ``kv_heads`` KV heads of
    ``hidden // heads``, ``mlp`` (SwiGLU width), ``vocab``; an untied ``output.weight``."""

    label: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    mlp: int
    vocab: int

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every tensor's GGUF name and numpy shape ``(rows, cols)`` (``(n,)`` for norms), in file order."""
        d, kv = self.hidden // self.heads, self.kv_heads * (self.hidden // self.heads)
        out = [("token_embd.weight", (self.vocab, self.hidden)), ("output_norm.weight", (self.hidden,)),
               ("output.weight", (self.vocab, self.hidden))]  # fmt: skip
        for i in range(self.layers):
            out += [(f"blk.{i}.attn_norm.weight", (self.hidden,)), (f"blk.{i}.ffn_norm.weight", (self.hidden,)),
                    (f"blk.{i}.attn_q.weight", (self.heads * d, self.hidden)),
                    (f"blk.{i}.attn_k.weight", (kv, self.hidden)), (f"blk.{i}.attn_v.weight", (kv, self.hidden)),
                    (f"blk.{i}.attn_output.weight", (self.hidden, self.heads * d)),
                    (f"blk.{i}.ffn_gate.weight", (self.mlp, self.hidden)),
                    (f"blk.{i}.ffn_up.weight", (self.mlp, self.hidden)),
                    (f"blk.{i}.ffn_down.weight", (self.hidden, self.mlp))]  # fmt: skip
        return out


LLAMA_SHAPES = {  # the vocabulary of the 1B and 3B as the issue's earlier files (32,000); the 8B's is Llama 3.1's
    "llama-1b": LlamaShape("Llama-3.2-1B shapes, 32k vocabulary", 2048, 16, 32, 8, 8192, 32000),
    "llama-3b": LlamaShape("Llama-3.2-3B shapes, 32k vocabulary", 3072, 28, 24, 8, 8192, 32000),
    "llama-8b": LlamaShape("Llama-3.1-8B shapes, 128k vocabulary", 4096, 32, 32, 8, 14336, 128256),
    "tiny": LlamaShape("tiny (tests)", 256, 2, 4, 2, 512, 512),
}


def tokenizer_fields(path: Path) -> list[tuple[str, Any, Any, Any]]:
    """Every ``tokenizer.*`` key of the GGUF at ``path`` as ``(key, value, type, array element type or None)``, as
    ``gguf.GGUFWriter.add_key_value`` takes them."""
    import gguf

    out = []
    for name, field in gguf.GGUFReader(str(path)).fields.items():
        if name.startswith("tokenizer."):
            array = field.types[0] == gguf.GGUFValueType.ARRAY
            out.append((name, field.contents(), field.types[0], field.types[-1] if array else None))
    return out


def write_random_f16(path: Path, shape: LlamaShape, seed: int = 0, tokenizer: Path | None = None) -> Path:
    """A random ``shape`` Llama as an F16 GGUF at ``path``: the tensor table first, then each tensor generated and
    written in turn (norms F32, as llama.cpp's converter writes them); with ``tokenizer`` (a GGUF file), its
    tokenizer and chat template, the vocabulary its size."""
    import gguf

    rng = np.random.default_rng(seed)
    fields = tokenizer_fields(tokenizer) if tokenizer is not None else []
    tokens = next((value for key, value, _, _ in fields if key == "tokenizer.ggml.tokens"), None)
    if tokenizer is not None and not tokens:
        raise ValueError(f"tokenizer={tokenizer}: the file has no tokenizer.ggml.tokens")
    if tokens:
        shape = replace(shape, vocab=len(tokens))
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(131072)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.mlp)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(shape.hidden // shape.heads)
    w.add_rope_freq_base(500000.0)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    if fields:
        for key, value, vtype, sub in fields:
            w.add_key_value(key, value, vtype, sub)
    else:
        w.add_tokenizer_model("llama")
        w.add_token_list([f"<t{i}>" for i in range(shape.vocab)])
        w.add_token_scores([0.0] * shape.vocab)
        w.add_token_types([1] * shape.vocab)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
    tensors = shape.tensors()
    for name, dims in tensors:
        dtype = np.dtype(np.float32 if len(dims) == 1 else np.float16)
        w.add_tensor_info(name, dims, dtype, int(np.prod(dims)) * dtype.itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, dims in tensors:
        if len(dims) == 1:
            w.write_tensor_data(np.ones(dims, np.float32))
            continue
        t = np.empty(dims, np.float16)
        for r in range(0, dims[0], 1024):  # float32 draws a slab at a time: one tensor's F16 is all that is held
            t[r : r + 1024] = rng.standard_normal((min(1024, dims[0] - r), dims[1]), dtype=np.float32) * 0.02
        w.write_tensor_data(t)
    w.close()
    return path


def find_llama_tool(name: str, folder: Path | None = None) -> Path | None:
    """llama.cpp's ``name`` (``llama-bench``, ``llama-quantize`` ...): in ``folder`` if given, else on ``PATH``."""
    if folder is not None:
        exe = Path(folder) / name
        return exe if os.access(exe, os.X_OK) else None
    found = shutil.which(name)
    return Path(found) if found else None


def quantize(src: Path, dst: Path, kind: str, tool: Path, threads: int) -> Path:
    """``src`` quantized to llama.cpp's file type ``kind`` (``"Q4_K_M"``) by its ``llama-quantize`` at ``tool``;
    written to a temporary name and renamed, so that an interrupted run leaves no half file in the cache."""
    part = dst.with_name(dst.name + ".part")
    proc = subprocess.run([str(tool), str(src), str(part), kind, str(threads)], capture_output=True, text=True)
    if proc.returncode != 0:
        part.unlink(missing_ok=True)
        raise RuntimeError(f"{tool} could not quantize {src} to {kind}:\n{proc.stderr[-2000:]}")
    part.replace(dst)
    return dst


def model_file(
    name: str, folder: Path, tool: Path | None, kind: str = "Q4_K_M", threads: int = 2, tokenizer: Path | None = None
) -> Path:
    """The cached ``kind`` file of the random ``LLAMA_SHAPES[name]`` model in ``folder``: made the first time (F16,
    then ``llama-quantize`` at ``tool``, then the F16 file deleted), reused afterwards. With ``tokenizer`` (a GGUF
    file): that file's tokenizer and chat template, named ``random-NAME-chat.KIND.gguf``."""
    dst = Path(folder) / f"random-{name}{'-chat' if tokenizer is not None else ''}.{kind}.gguf"
    if dst.exists():
        return dst
    if tool is None:
        raise FileNotFoundError(
            f"making {dst.name} needs llama.cpp's llama-quantize (gqa has no K-quant writer of its own): put it on "
            "PATH or pass --llama-cpp DIR"
        )
    dst.parent.mkdir(parents=True, exist_ok=True)
    f16 = dst.with_name(dst.name.replace(f".{kind}.", ".F16.") + ".part")
    label = LLAMA_SHAPES[name].label
    if tokenizer is not None:
        label = f"{label.split(',')[0]}, the vocabulary and tokenizer of {Path(tokenizer).name}"
    print(f"[bench model] writing {f16.name} ({label}) ...", file=sys.stderr, flush=True)
    try:
        write_random_f16(f16, LLAMA_SHAPES[name], tokenizer=tokenizer)
        print(f"[bench model] quantizing to {dst.name} with {tool} ...", file=sys.stderr, flush=True)
        return quantize(f16, dst, kind, tool, threads)
    finally:
        f16.unlink(missing_ok=True)
