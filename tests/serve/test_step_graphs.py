"""``serve.step_graphs`` with a step written here (no model, no Triton): the buckets and length tiers, which graph a
batch replays, what its padding rows hold, and that a replay reads the inputs copied into the static buffers. The
runner's graphs over a real model and pool: ``test_triton_runner.py`` (Triton's interpreter) and
``tests/decoding/test_gpu.py`` (CUDA)."""

from __future__ import annotations

import pytest
import torch

from gqa.serve.step_graphs import DecodeGraphs, bucket_for, graph_buckets, length_tiers

PAD = 99


def test_graph_buckets_are_vllms_sizes_up_to_the_running_limit():
    assert graph_buckets(1) == (1,)
    assert graph_buckets(4) == (1, 2, 4)
    assert graph_buckets(20) == (1, 2, 4, 8, 16, 20)
    assert graph_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert [bucket_for(n, graph_buckets(20)) for n in (1, 3, 5, 9, 17, 20, 21)] == [1, 4, 8, 16, 20, 20, None]
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="max_rows must be a positive integer"):
            graph_buckets(bad)


def test_length_tiers_grow_four_times_up_to_the_longest():
    assert length_tiers(128) == (128,)
    assert length_tiers(2048) == (2048,)
    assert length_tiers(8192) == (2048, 8192)
    assert length_tiers(131072) == (2048, 8192, 32768, 131072)
    assert length_tiers(10000) == (2048, 8192, 10000)
    assert length_tiers(100, first=16) == (16, 64, 100)
    with pytest.raises(ValueError, match="longest must be a positive integer"):
        length_tiers(0)


class Recorder:
    """A step that returns its inputs as its 'logits' (row: token id, position, first table entry, length) and
    counts the calls per (rows, length)."""

    def __init__(self):
        self.calls: list[tuple[int, int]] = []

    def __call__(self, ids, pos, table, length):
        self.calls.append((ids.shape[0], length))
        logits = torch.stack([ids, pos, table[:, 0], torch.full_like(ids, length)], -1).float()
        return logits, ids * 10


def test_a_batch_replays_its_bucket_and_tier_with_padding_rows_in_the_spare_block():
    step = Recorder()
    graphs = DecodeGraphs(step, buckets=(1, 2, 4), lengths=(16, 64, 100), width=7, pad_block=PAD,
                          device=torch.device("cpu"), recorded=True)  # fmt: skip
    # one warm-up run per graph, largest first, every row a padding row
    assert step.calls == [(4, 100), (4, 64), (4, 16), (2, 100), (2, 64), (2, 16), (1, 100), (1, 64), (1, 16)]
    assert graphs.takes(4, 100) and not graphs.takes(5, 10) and not graphs.takes(1, 101)
    shared = graphs.logits.data_ptr()  # one output buffer for every graph, as large as the largest bucket
    assert graphs.logits.shape == (4, 4) and graphs.greedy.shape == (4,)
    step.calls.clear()
    logits, greedy = graphs.run([7, 8, 9], [5, 20, 3], [[3, 1], [4, 5], [6]])
    assert step.calls == [(4, 64)]  # 3 rows -> 4; position 20 -> the tier of 64
    assert logits.tolist() == [[7, 5, 3, 64], [8, 20, 4, 64], [9, 3, 6, 64]]
    assert greedy.tolist() == [70, 80, 90]
    padding = graphs.inputs[3]
    assert padding[:3].tolist() == [0, 0, PAD]  # token 0 at position 0 in the spare block
    logits, greedy = graphs.run([1], [99], [[2] * 7])  # a replay reads what was copied since
    assert step.calls[-1] == (1, 100) and logits.tolist() == [[1, 99, 2, 100]] and greedy.tolist() == [10]
    assert graphs.logits.data_ptr() == shared
    with pytest.raises(ValueError, match="the largest graph takes 4 rows of 100 tokens"):
        graphs.run([1] * 5, [0] * 5, [[1]] * 5)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_engine_config_names_a_bad_cuda_graphs_setting(value):
    from gqa.serve.config import EngineConfig

    assert EngineConfig().cuda_graphs is True
    with pytest.raises(ValueError, match=f"cuda_graphs must be True or False, got {value!r}"):
        EngineConfig(cuda_graphs=value)


def test_graphed_decoding_refuses_quantized_weights_on_cuda():
    """A CPU-quantized model moved to CUDA keeps ``QuantizedLinear``s, whose CUDA path reads their blocks back on the
    host: no graph can hold that (a device-to-host copy while capturing), so ``graphs_apply`` says why not."""
    from types import SimpleNamespace

    from gqa.decoding.cuda_graphs import graphs_apply
    from gqa.models.quantized import QuantizedLinear

    layer = QuantizedLinear.__new__(QuantizedLinear)
    torch.nn.Module.__init__(layer)
    model = SimpleNamespace(device=torch.device("cuda"), modules=lambda: iter([layer]))
    assert "quantized weights" in graphs_apply(model, None)
    assert graphs_apply(SimpleNamespace(device=torch.device("cpu")), None) == "device cpu (CUDA only)"
