"""Tensor parallelism over block-quantized weights: a rank keeps its shard of a GGUF's blocks (rows of q/k/v/gate/up,
block-aligned columns of o_proj/down_proj), never the whole model dequantized."""

from __future__ import annotations

import pytest
import torch
from helpers import k_quants, tp_workers

from gqa import kernels
from gqa.models import ModelConfig
from gqa.models.quantized import FORMATS, QuantizedTensor
from gqa.parallel.tensor_parallel import rank_shard, shard_tensor


def _blocks(fmt: str, M: int, K: int) -> QuantizedTensor:
    """Random ``(M, K)`` weights as ``fmt`` blocks (llama.cpp's layouts, made by ``helpers.k_quants``)."""
    g = torch.Generator().manual_seed(M * K)
    x = torch.randn(M, K, generator=g).numpy()
    raw = k_quants.quantize(x, k_quants.Q[fmt.upper()])
    return QuantizedTensor(torch.from_numpy(raw), FORMATS[fmt], (M, K))


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1", "q4_k", "q6_k"])
def test_narrowed_blocks_are_the_slices_of_the_dequantized_weight(fmt):
    w = _blocks(fmt, 12, 1024)
    whole = w.dequantize()
    values = w.format.block_values
    rows = w.narrow(0, 5, 4)
    assert rows.shape == (4, 1024) and rows.blocks.is_contiguous()
    assert torch.equal(rows.dequantize(), whole[5:9])
    cols = w.narrow(1, 2 * values, values)
    assert cols.shape == (12, values) and cols.blocks.is_contiguous()
    assert torch.equal(cols.dequantize(), whole[:, 2 * values : 3 * values])
    with pytest.raises(ValueError, match=f"do not fall on its blocks of {values} values"):
        w.narrow(1, values // 2, values)
    with pytest.raises(ValueError, match="outside"):
        w.narrow(0, 10, 4)


def test_a_column_cut_through_blocks_is_held_in_float_with_a_warning():
    """o_proj of 2 heads of 64 values at tp=2 cuts a q4_k super-block of 256 in half: that weight (and only it) is
    dequantized, with a warning naming it."""
    cfg = ModelConfig(vocab_size=32, hidden_size=256, intermediate_size=512, num_layers=1, num_heads=4, num_kv_heads=2,
                      head_dim=64, max_position_embeddings=64)  # fmt: skip
    shard = rank_shard(cfg, 2, 1)
    o = _blocks("q4_k", 256, 256)
    with pytest.warns(UserWarning, match=r"model.layers.0.self_attn.o_proj.weight: columns \[128, 256\)"):
        got = shard_tensor("model.layers.0.self_attn.o_proj.weight", o, shard, 64)
    assert torch.equal(got, o.dequantize()[:, 128:])
    up = shard_tensor("model.layers.0.mlp.down_proj.weight", _blocks("q4_k", 256, 512), shard, 64)
    assert isinstance(up, QuantizedTensor) and up.shape == (256, 256)


@pytest.mark.skipif(not kernels.vectorized(), reason="blocks are kept where the native kernels run")
def test_smollm2_sharded_over_two_ranks_keeps_its_blocks_and_its_answers(capsys):
    """``load_model(tensor_parallel=True)`` (dtype auto) at tp=2: each rank holds its shard of the Q4_1 file's
    blocks — the two ranks' layer bytes add up to the whole model's, each less than 0.7x of it, and the embeddings'
    blocks too (each rank its vocabulary rows) — and gives the one process's greedy tokens. Logits (float32
    activations): the quantized kernels round each activation block to 8 bits, so a last-bit difference in a partial
    sum can move a block's rounding and the logits differ by as much as the rounding itself does; both must then be
    as close to the float model (the file's blocks dequantized) as each other. ``gqa info --tp 2`` says the bytes each
    rank holds."""
    import gqa
    from gqa.parallel.distributed import launch_local

    ids = [1, 9690, 314, 253, 5248, 30, 2, 198]  # a few of SmolLM2's token ids
    ranks = launch_local(2, tp_workers.smollm2_quantized, ids, 12)
    one = tp_workers.smollm2_quantized(ids, 12)
    with torch.no_grad():
        exact = gqa.load_model(dtype=torch.float32, tokenizer=False)(torch.tensor([ids]))[0]
    one_error = (one["logits"] - exact).abs()
    assert one["types"] == ["QuantizedLinear", "QuantizedLinear", "QuantizedLinear"]
    for got in ranks.values():
        assert got["types"] == ["QuantizedLinear", "ReducingQuantizedLinear", "ReducingQuantizedLinear"]
        assert set(got["bytes"]) == set(one["bytes"])  # the same formats: nothing dequantized
        assert got["layer_bytes"] < 0.7 * one["layer_bytes"]
        error = (got["logits"] - exact).abs()
        assert error.max() < 1.5 * one_error.max() and error.mean() < 1.2 * one_error.mean()
        assert got["tokens"] == one["tokens"]
    assert sum(got["layer_bytes"] for got in ranks.values()) == one["layer_bytes"]
    for fmt in set(one["bytes"]) - {"float32"}:  # every block once: the layers' and the embeddings' (vocabulary rows)
        assert sum(got["bytes"][fmt] for got in ranks.values()) == one["bytes"][fmt], fmt
    # gqa info --tp 2 tells each rank's bytes kept as blocks before anything is loaded (float32 norms, as here)
    from gqa.cli import main as cli

    assert cli(["info", "--tp", "2"]) == 0
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.startswith(("| 0 |", "| 1 |"))]
    for rank, row in enumerate(rows[-2:]):
        assert row[7].strip() == f"{sum(ranks[rank]['bytes'].values()) / 2**20:.1f} MiB"
