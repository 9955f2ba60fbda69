"""The KV cache's storage types (``gqa.cache.kv_dtypes``): their bytes against the ``gguf`` package's own blocks
(llama.cpp's reference quantizer), the counts ``gqa info`` prints, and errors that name what is wrong."""

from __future__ import annotations

import numpy as np
import pytest

from gqa.cache.kv_dtypes import KV_DTYPES, kv_bytes_per_token, kv_dtype
from gqa.cli.info import kv_dtype_table


@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
def test_block_types_take_the_bytes_ggufs_quantizer_writes(name, head_dim):
    gguf = pytest.importorskip("gguf")
    rows = np.random.default_rng(0).standard_normal((5, head_dim)).astype(np.float32)
    written = gguf.quants.quantize(rows, gguf.GGMLQuantizationType[name.upper()])
    assert written.nbytes == 5 * kv_dtype(name).row_bytes(head_dim)
    assert (KV_DTYPES[name].block, KV_DTYPES[name].block_bytes) == gguf.GGML_QUANT_SIZES[
        gguf.GGMLQuantizationType[name.upper()]
    ]


def test_bytes_per_token_of_smollm2_by_hand():
    # 30 layers x 3 KV heads x 64 values x 2 (K, V): 11,520 values a token
    assert kv_bytes_per_token(30, 3, 64, kv_dtype("bf16")) == 11_520 * 2
    assert kv_bytes_per_token(30, 3, 64, kv_dtype("fp32")) == 11_520 * 4
    assert kv_bytes_per_token(30, 3, 64, kv_dtype("q8_0")) == 11_520 // 32 * 34
    assert kv_bytes_per_token(30, 3, 64, kv_dtype("q4_0")) == 11_520 // 32 * 18
    assert kv_dtype("q4_0").bits_per_value == 4.5 and not kv_dtype("fp16").quantized


def test_the_table_sets_fewer_heads_beside_fewer_bits():
    table = kv_dtype_table(30, 9, 3, 64, budget_gib=0.5).splitlines()
    assert table[0].startswith("| KV dtype | bits | MHA (9 KV) per token | tokens in 0.5 GiB | GQA (3 KV)")
    q4 = next(line for line in table if line.startswith("| q4_0 |"))
    assert f"| 6.33 KiB | {2**29 // 6480:,} |" in q4  # 11,520 // 32 x 18 = 6,480 bytes
    odd = kv_dtype_table(2, 4, 4, 40)  # MHA = GQA here: one column pair; 40 is no multiple of 32
    assert "GQA" not in odd.splitlines()[0] and "| q8_0 | 8.5 | needs a head dim that is a multiple of 32 |" in odd
    assert "| bf16 | 16 | 1.25 KiB | 838,860 |" in odd  # 2 layers x 4 x 40 x 2 (K, V) x 2 bytes = 1,280 bytes


def test_bad_names_and_shapes_are_refused_by_name():
    choices = "fp32, bf16, fp16, q8_0, q4_0, fp8_e4m3, fp8"
    with pytest.raises(ValueError, match=f"kv_cache_dtype must be one of {choices}, got 'q5_k'"):
        kv_dtype("q5_k")
    with pytest.raises(ValueError, match="--kv-cache-dtype-k must be one of"):
        kv_dtype("int8", flag="--kv-cache-dtype-k")
    with pytest.raises(ValueError, match="a q8_0 KV cache needs a head dim that is a multiple of 32, got 80"):
        kv_dtype("q8_0").row_bytes(80)
    with pytest.raises(ValueError, match="num_kv_heads must be a non-negative int"):
        kv_bytes_per_token(2, -1, 64, kv_dtype("bf16"))
