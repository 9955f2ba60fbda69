"""The KV pool's default size (``serve.pool_size``), without a model: the rule on made-up sizes and on the embedded
SmolLM2's, and the sizes it refuses."""

from __future__ import annotations

import pytest

from gqa.serve.pool_size import CPU_MEMORY_SHARE, DEVICE_MEMORY_SHARE, default_pool_size

GiB = 2**30


def test_max_running_full_contexts_when_the_weights_outweigh_them():
    p = default_pool_size(100, 1000, 4, 10**6, 64 * GiB, CPU_MEMORY_SHARE)
    assert p.nbytes == 4 * 100 * 1000 and "--max-running 4" in p.reason


def test_the_weights_bound_the_pool_and_one_full_context_is_the_least():
    p = default_pool_size(100, 1000, 64, 250_000, 64 * GiB, CPU_MEMORY_SHARE)  # 2.5 contexts of weights
    assert p.nbytes == 250_000 and "the weights' size" in p.reason
    p = default_pool_size(100, 1000, 64, 30_000, 64 * GiB, CPU_MEMORY_SHARE)  # a context outweighs the weights
    assert p.nbytes == 100_000 and "one full context" in p.reason


def test_a_share_of_the_memory_caps_it_and_a_gpu_is_not_bounded_by_the_weights():
    p = default_pool_size(100, 1000, 64, 250_000, 400_000, CPU_MEMORY_SHARE)
    assert p.nbytes == 100_000 and "25% of the" in p.reason
    p = default_pool_size(100, 1000, 64, None, 64 * GiB, DEVICE_MEMORY_SHARE)
    assert p.nbytes == 64 * 100_000 and "--max-running 64" in p.reason
    p = default_pool_size(100, 1000, 64, None, 2_000_000, DEVICE_MEMORY_SHARE)
    assert p.nbytes == 1_000_000 and "50% of the" in p.reason


def test_the_embedded_smollm2_gets_one_context_not_a_quarter_of_the_memory():
    """SmolLM2-135M: 30 layers x 3 KV heads x 64 x 2 (K, V) x 2 bytes (bf16) a token, 8,192 tokens of context,
    ~96 MiB of quantized weights, 64 running: one full context (0.18 GiB), where the old default took a quarter of
    13 GiB available (3.2 GiB)."""
    token = 30 * 3 * 64 * 2 * 2
    p = default_pool_size(token, 8192, 64, 96 * 2**20, 13 * GiB, CPU_MEMORY_SHARE)
    assert p.nbytes == token * 8192 == 180 * 2**20


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 10, 1, 0, GiB, 0.25), "token_bytes must be a positive int, got 0"),
        ((1, 10, True, 0, GiB, 0.25), "max_running must be a positive int, got True"),
        ((1, 10, 1, -1, GiB, 0.25), "weight_bytes and memory must be >= 0"),
        ((1, 10, 1, 0, GiB, 0.0), r"share in \(0, 1\]"),
    ],
)
def test_bad_sizes_are_refused_by_name(args, message):
    with pytest.raises(ValueError, match=message):
        default_pool_size(*args)
