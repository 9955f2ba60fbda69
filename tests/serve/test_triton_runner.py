"""The GPU serving path on CPU tensors through Triton's interpreter: the paged-attention kernel against a float64
oracle written here, batch invariance of its rows, and the engine with ``TritonModelRunner`` against HF
transformers' greedy generation and each request served alone (the same checks the CPU runner passes).

The kernel tests run in a child process with ``TRITON_INTERPRET=1`` (``tests/helpers/interpreter.py`` says why).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

import gqa
from gqa.cache.kv_dtypes import KV_DTYPES
from gqa.cache.quantize import quantize
from gqa.kernels.triton.paged import CHUNK, paged_attention
from gqa.serve.engine import Engine
from gqa.serve.sampling import SamplingParams
from tests.helpers.families import family_model
from tests.helpers.interpreter import interpreting, run_interpreted
from tests.helpers.kv_blocks import stored_as
from tests.helpers.serving import hf_greedy, serve_all, tiny_qwen2

transformers = pytest.importorskip("transformers")
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed: the paged kernel cannot run", allow_module_level=True)

INTERPRETED = interpreting()
CHILD = "GQA_TEST_TRITON_RUNNER_CHILD"
needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child process")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy in the interpreter: -inf - -inf, log(0)


@pytest.mark.skipif(bool(os.environ.get(CHILD)), reason="the child process itself")
def test_triton_runner_in_interpreter_process():
    run_interpreted(__file__, CHILD, min_passed=14)


def _pools(num_blocks, H_kv, block_size, D, D_v, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(num_blocks, H_kv, block_size, D, generator=g).to(dtype)
    value = torch.randn(num_blocks, H_kv, block_size, D_v, generator=g).to(dtype)
    return key, value


def _reference(q, key, value, tables, lengths, window=None, softcap=None, sinks=None):
    """float64: each row's keys gathered position by position through its table, K/V repeated per query head; the
    ``window`` keys before the row's own and it, ``softcap`` on the scaled scores, ``sinks (H_q,)`` as a key of
    value zero."""
    block_size = key.shape[2]
    G = q.shape[1] // key.shape[1]
    out = []
    for n in range(q.shape[0]):
        length = int(lengths[n])
        pos = torch.arange(0 if window is None else max(length - 1 - window, 0), length)
        blocks, slots = tables[n].long()[pos // block_size], pos % block_size
        k = key[blocks, :, slots].double().repeat_interleave(G, dim=1).transpose(0, 1)  # (H_q, len, D)
        v = value[blocks, :, slots].double().repeat_interleave(G, dim=1).transpose(0, 1)
        scores = (q[n].double()[:, None] @ k.transpose(-1, -2))[:, 0] * q.shape[-1] ** -0.5  # (H_q, len)
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        if sinks is not None:
            scores = torch.cat([scores, sinks.double()[:, None]], -1)
        weights = scores.softmax(-1)[:, : len(pos)]
        out.append(torch.einsum("hs,hsd->hd", weights, v))
    return torch.stack(out)


@needs_interpreter
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("block_size, H_q, H_kv, D, D_v", [(16, 9, 3, 64, 64), (5, 18, 6, 40, 24), (16, 4, 4, 16, 16)])
def test_paged_attention_matches_float64(dtype, tol, block_size, H_q, H_kv, D, D_v):
    key, value = _pools(300, H_kv, block_size, D, D_v, dtype)
    lengths = torch.tensor([1, 7, CHUNK + 3, 2 * CHUNK + 40, 33])  # one key, several splits, a partial split
    width = -(-int(lengths.max()) // block_size)
    g = torch.Generator().manual_seed(1)
    tables = torch.stack([torch.randperm(300, generator=g)[:width] for _ in lengths]).int()  # scattered blocks
    q = torch.randn(len(lengths), H_q, D, generator=g).to(dtype)
    out = paged_attention(q, key, value, tables, lengths, max_length=int(lengths.max()), max_context=4096)
    ref = _reference(q, key, value, tables, lengths)
    assert out.shape == (len(lengths), H_q, D_v) and out.dtype == dtype
    assert ((out.double() - ref).norm() / ref.norm()).item() < tol


@needs_interpreter
@pytest.mark.parametrize(
    "window, softcap, with_sinks",
    [
        (100, None, False),
        (CHUNK, None, False),
        (0, None, False),
        (None, 2.0, False),
        (None, None, True),
        (700, 5.0, True),
    ],
)
def test_paged_window_softcap_sinks_match_float64(window, softcap, with_sinks):
    """A window shorter than a split, one as long, the row's own key alone; soft-capping; sinks; all three."""
    key, value = _pools(500, 2, 16, 32, 32, torch.float32, seed=2)
    lengths = torch.tensor([1, 90, CHUNK + 3, 3 * CHUNK + 40, 2 * CHUNK])
    g = torch.Generator().manual_seed(3)
    tables = torch.randperm(500, generator=g).view(5, 100).int()  # scattered, no block in two rows
    q = torch.randn(len(lengths), 6, 32, generator=g) * 4  # large scores: the soft-cap bends them
    sinks = torch.randn(6, generator=g) + 3 if with_sinks else None
    out = paged_attention(q, key, value, tables, lengths, max_length=int(lengths.max()), max_context=4096,
                          window=window, softcap=softcap, sinks=sinks)  # fmt: skip
    ref = _reference(q, key, value, tables, lengths, window, softcap, sinks)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5
    assert ((out.double() - _reference(q, key, value, tables, lengths)).norm() / ref.norm()).item() > 1e-2
    if window is not None:  # keys before each row's window: never read; a row alone = in the batch
        before = torch.zeros(500, 16, dtype=torch.bool)
        for n, length in enumerate(lengths.tolist()):
            pos = torch.arange(max(length - 1 - window, 0))
            before[tables[n].long()[pos // 16], pos % 16] = True
        key[before.unsqueeze(1).expand(-1, 2, -1)] = float("nan")
        value[before.unsqueeze(1).expand(-1, 2, -1)] = float("nan")
        again = paged_attention(q, key, value, tables, lengths, max_length=int(lengths.max()), max_context=4096,
                                window=window, softcap=softcap, sinks=sinks)  # fmt: skip
        assert torch.equal(again, out)
        alone = paged_attention(q[3:4], key, value, tables[3:4], lengths[3:4], max_length=int(lengths[3]),
                                max_context=4096, window=window, softcap=softcap, sinks=sinks)  # fmt: skip
        assert torch.equal(alone[0], out[3])


@needs_interpreter
def test_a_row_is_computed_the_same_alone_and_in_any_batch():
    key, value = _pools(200, 2, 16, 32, 32, torch.float32)
    lengths = torch.tensor([CHUNK + 100, 3, 2 * CHUNK + 1])
    tables = torch.stack([torch.randperm(200)[:80] for _ in lengths]).int()
    q = torch.randn(3, 6, 32)
    together = paged_attention(q, key, value, tables, lengths, max_length=2 * CHUNK + 1, max_context=2048)
    for n in range(3):
        alone = paged_attention(q[n : n + 1], key, value, tables[n : n + 1], lengths[n : n + 1],
                                max_length=int(lengths[n]), max_context=2048)  # fmt: skip
        assert torch.equal(alone[0], together[n])


QUANTIZED_POOLS = {
    # id: (K kind, V kind, H_q, H_kv, D, block_size, window, softcap, sinks); None: float rows
    "q8_0-D64": ("q8_0", "q8_0", 18, 6, 64, 16, None, None, False),
    "q4_0-D32-window-softcap-sinks": ("q4_0", "q4_0", 18, 6, 32, 5, 100, 5.0, True),
    "q8_0-q4_0": ("q8_0", "q4_0", 6, 2, 32, 16, None, None, False),
    "float-q8_0": (None, "q8_0", 6, 2, 64, 16, None, None, False),
    "fp8-D64": ("fp8_e4m3", "fp8_e4m3", 18, 6, 64, 16, None, None, False),
    "fp8-q8_0-D32-window-softcap-sinks": ("fp8_e4m3", "q8_0", 18, 6, 32, 5, 100, 5.0, True),
}


@needs_interpreter
@pytest.mark.parametrize("case", list(QUANTIZED_POOLS), ids=list(QUANTIZED_POOLS))
def test_paged_attention_reads_quantized_pools(case):
    """Pools of uint8 rows of q8_0 / q4_0 blocks (K, V or both), read where they lie: float64 attention over the
    values the blocks hold, ragged rows through scattered tables, each row alone the same bits as in the batch."""
    k_name, v_name, H_q, H_kv, D, block_size, window, softcap, with_sinks = QUANTIZED_POOLS[case]
    key, value = _pools(500, H_kv, block_size, D, D, torch.float32, seed=4)
    key, k_format, k_values = stored_as(key, k_name, key=True)
    value, v_format, v_values = stored_as(value, v_name)
    lengths = torch.tensor([1, 7, CHUNK + 3, 40])  # one key, a few, two splits, a partial block
    width = -(-int(lengths.max()) // block_size)
    g = torch.Generator().manual_seed(5)
    tables = torch.randperm(500, generator=g)[: len(lengths) * width].view(len(lengths), width).int()
    q = torch.randn(len(lengths), H_q, D, generator=g) * 3
    sinks = torch.randn(H_q, generator=g) + 3 if with_sinks else None
    options = dict(max_context=4096, window=window, softcap=softcap, sinks=sinks, k_format=k_format,
                   v_format=v_format)  # fmt: skip
    out = paged_attention(q, key, value, tables, lengths, max_length=int(lengths.max()), **options)
    ref = _reference(q, k_values, v_values, tables, lengths, window, softcap, sinks)
    assert out.shape == (len(lengths), H_q, D) and out.dtype == torch.float32
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5
    for n in (0, 2):
        alone = paged_attention(q[n : n + 1], key, value, tables[n : n + 1], lengths[n : n + 1],
                                max_length=int(lengths[n]), **options)  # fmt: skip
        assert torch.equal(alone[0], out[n])


@needs_interpreter
def test_paged_attention_checks_quantized_pools():
    key = quantize(torch.randn(10, 2, 16, 32), KV_DTYPES["q8_0"])
    value = torch.randn(10, 2, 16, 32)
    tables, lengths = torch.zeros(2, 4, dtype=torch.int32), torch.ones(2, dtype=torch.long)
    args = dict(
        query=torch.randn(2, 4, 32), key_pool=key, value_pool=value, tables=tables, lengths=lengths, max_length=1
    )
    with pytest.raises(ValueError, match="dtypes query"):  # blocks, yet called float
        paged_attention(**args)
    with pytest.raises(ValueError, match=r"value_pool must be uint8 rows of q4_0 blocks \(18 bytes each\)"):
        paged_attention(**args, k_format=0, v_format=1)
    with pytest.raises(ValueError, match="k_format must be -1"):
        paged_attention(**args, k_format=5)
    with pytest.raises(ValueError, match="does not match pools"):  # blocks of 64 values for D = 32
        paged_attention(**args | dict(key_pool=quantize(torch.randn(10, 2, 16, 64), KV_DTYPES["q8_0"])), k_format=0)
    assert paged_attention(**args, k_format=0).shape == (2, 4, 32)


@needs_interpreter
@pytest.mark.parametrize(
    "change, words",
    [
        (dict(tables=torch.zeros(2, 4)), "tables must be int32/int64"),
        (dict(lengths=torch.ones(3, dtype=torch.long)), "lengths must be"),
        (dict(max_length=0), "max_length must be a positive int"),
        (dict(max_length=1000), "exceeds the tables"),
        (dict(query=torch.randn(2, 5, 16)), "does not match pools"),
        (dict(window=-1), "window must be an int >= 0"),
        (dict(sinks=torch.zeros(3)), r"sinks must be a floating-point tensor of shape \(H_q,\) = \(4,\)"),
        (dict(softcap=-2.0), "softcap must be"),
    ],
)
def test_bad_arguments_are_named(change, words):
    key, value = _pools(10, 2, 16, 16, 16, torch.float32)
    args = dict(query=torch.randn(2, 4, 16), key_pool=key, value_pool=value,
                tables=torch.zeros(2, 4, dtype=torch.int32), lengths=torch.ones(2, dtype=torch.long),
                max_length=1) | change  # fmt: skip
    with pytest.raises(ValueError, match=words):
        paged_attention(**args)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    return path, tiny_qwen2(path)


def _engine(model, **options) -> Engine:
    from gqa.serve.triton_runner import TritonModelRunner

    return Engine(model, runner=TritonModelRunner, **options)


@needs_interpreter
def test_engine_on_the_triton_runner_equals_hf_and_each_request_alone(tiny):
    path, ref = tiny
    model = gqa.load_model(path, dtype=torch.float32, tokenizer=False)
    prompts = [[5, 9, 17, 33, 2, 8, 100, 41, 7], [11], list(range(20, 60))]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    engine = _engine(model, kv_cache_mib=1, block_size=4, prefill_chunk=16)
    free = engine.blocks.num_free
    together = serve_all(engine, prompts, params)
    assert engine.blocks.num_free == free
    for prompt, tokens in zip(prompts, together, strict=True):
        assert tokens == hf_greedy(ref, prompt, 6)
        assert serve_all(_engine(model, kv_cache_mib=1, block_size=4, prefill_chunk=16), [prompt], params) == [tokens]


@needs_interpreter
@pytest.mark.parametrize("arch", ["mistral", "gemma3_text"])
def test_the_triton_runner_serves_the_families_past_their_windows(tmp_path, arch):
    """Mistral (every layer slides: blocks behind the window go back to the pool as it moves) and Gemma 3 (q/k norms,
    local RoPE, sandwich norms, interleaved windows): greedy answers equal transformers' for 10 tokens past 5-key
    windows (Mistral's alone too). Every family's layers go through the same fused layers, each family's against
    transformers in ``tests/decoding/test_fused_step.py`` (the interpreter is slow: two families here)."""
    ref = family_model(arch, tmp_path)
    model = gqa.load_model(tmp_path, dtype=torch.float32, tokenizer=False)
    prompts = [[5, 9, 17, 33, 2, 8, 40, 41, 7], [11, 12], list(range(20, 40))]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    engine = _engine(model, kv_cache_mib=1, block_size=4, prefill_chunk=8)
    assert engine.runner.window == (4 if arch == "mistral" else None)
    free = engine.blocks.num_free
    together = serve_all(engine, prompts, params)
    assert engine.blocks.num_free == free
    for prompt, tokens in zip(prompts, together, strict=True):
        assert tokens == hf_greedy(ref, prompt, 10)
    if arch == "mistral":
        alone = _engine(model, kv_cache_mib=1, block_size=4, prefill_chunk=8)
        assert serve_all(alone, [prompts[2]], params) == [together[2]]


@needs_interpreter
def test_triton_runner_prefix_cache_and_seeded_sampling(tiny):
    path, ref = tiny
    model = gqa.load_model(path, dtype=torch.float32, tokenizer=False)
    engine = _engine(model, kv_cache_mib=1, block_size=8, prefill_chunk=16)
    system = list(range(30, 62))  # 4 full blocks
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    serve_all(engine, [[*system, 5]], greedy)
    hits = engine.blocks.prefix_hits
    second = serve_all(engine, [[*system, 7, 8]], greedy)[0]
    assert engine.blocks.prefix_hits - hits == 4
    assert second == hf_greedy(ref, [*system, 7, 8], 4)
    sampled = SamplingParams(max_tokens=5, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    first = serve_all(engine, [[4, 5, 6]], sampled)
    assert serve_all(engine, [[4, 5, 6]], sampled) == first


@needs_interpreter
def test_the_triton_runner_serves_from_a_q8_0_pool(tmp_path):
    """``kv_cache_dtype="q8_0"``: the pool holds uint8 blocks (1.9x the float32 pool's tokens... here 3.8x: the model
    is float32), each request served alone gives the tokens it gives in the batch, and they are the CPU engine's over
    the same q8_0 pool (the native kernels: another implementation of the blocks)."""
    from gqa import kernels
    from gqa.serve.engine import Engine

    family_model("qwen2", tmp_path, head_dim=32)
    model = gqa.load_model(tmp_path, dtype=torch.float32, tokenizer=False)
    prompts = [[5, 9, 17, 33, 2, 8, 40, 41, 7], [11, 12], list(range(20, 40))]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    options = dict(kv_cache_mib=1, block_size=4, prefill_chunk=8, kv_cache_dtype="q8_0")
    engine = _engine(model, **options)
    assert engine.cache.key[0].dtype == torch.uint8 and engine.cache.key[0].shape[-1] == 34
    assert engine.blocks.num_blocks >= 3.7 * _engine(model, kv_cache_mib=1, block_size=4).blocks.num_blocks
    together = serve_all(engine, prompts, params)
    for prompt, tokens in zip(prompts, together, strict=True):
        assert serve_all(_engine(model, **options), [prompt], params) == [tokens]
    if kernels.vectorized():
        assert serve_all(Engine(model, **options), prompts, params) == together


def test_the_engine_picks_the_runner_by_device(tiny):
    from gqa.serve.engine import runner_for
    from gqa.serve.runner import ModelRunner

    path, _ = tiny
    model = gqa.load_model(path, dtype=torch.float32, tokenizer=False)
    assert runner_for(model) is ModelRunner  # CPU: the native one


def _graphed(model, **options) -> Engine:
    """The engine with its decode steps replayed from recorded graphs (``step_graphs.RecordedStep``: CUDA graphs'
    stand-in on CPU, reading the same static buffers)."""
    import functools

    from gqa.serve.triton_runner import TritonModelRunner

    return Engine(model, runner=functools.partial(TritonModelRunner, graphs=True), **options)


@needs_interpreter
@pytest.mark.parametrize("kv_cache_dtype", [None, "fp8_e4m3"])
def test_decode_steps_replay_graphs_and_give_the_eager_tokens(tmp_path, kv_cache_dtype):
    """Five requests, at most four running (buckets 1, 2, 4: batches of 3 padded to 4): HF's greedy tokens (float
    pool), the eager engine's (fp8 pool), a request alone the same; decode steps went through the graphs, the
    spare block was never handed out and every block came back."""
    ref = family_model("qwen2", tmp_path, head_dim=32)
    model = gqa.load_model(tmp_path, dtype=torch.float32, tokenizer=False)
    prompts = [[5, 9, 17, 33, 2, 8, 40, 41, 7], [11], list(range(20, 40)), [3, 4], [60, 61, 62, 63, 64]]
    params = SamplingParams(max_tokens=7, ignore_eos=True)
    options = dict(kv_cache_mib=1, block_size=4, prefill_chunk=8, max_running=4, kv_cache_dtype=kv_cache_dtype)
    engine = _graphed(model, **options)
    graphs = engine.runner.graphs
    assert graphs.buckets == (1, 2, 4) and graphs.replays == 0
    assert engine.cache.key[0].shape[0] == engine.blocks.num_blocks + 1  # the spare block, past the manager's
    if kv_cache_dtype == "fp8_e4m3":  # a byte a value
        assert engine.cache.key[0].dtype == torch.uint8 and engine.cache.key[0].shape[-1] == 32
    free = engine.blocks.num_free
    together = serve_all(engine, prompts, params)
    assert graphs.replays >= 6 and engine.blocks.num_free == free
    assert engine.stats().cuda_graph_steps == graphs.replays < engine.stats().steps  # prompts stepped eagerly
    if kv_cache_dtype is None:
        assert together == [hf_greedy(ref, prompt, 7) for prompt in prompts]
    else:
        assert together == serve_all(_engine(model, **options), prompts, params)
    assert serve_all(_graphed(model, **options), [prompts[2]], params) == [together[2]]  # bucket 1


@needs_interpreter
def test_a_graphed_step_writes_its_rows_and_the_spare_block_only(tmp_path):
    """Three decode rows in the bucket of four: each row's K/V land in its own slot, the padding row's in the spare
    block, no other slot of the pool changes; the logits are the eager step's for the same rows, and a second replay
    with other rows reads the new inputs (a graph replays what its buffers hold)."""
    from gqa.serve.config import EngineConfig
    from gqa.serve.paged_cache import table_tensor
    from gqa.serve.triton_runner import TritonModelRunner

    family_model("llama", tmp_path)
    model = gqa.load_model(tmp_path, dtype=torch.float32, tokenizer=False)
    runner = TritonModelRunner(model, EngineConfig(kv_cache_mib=1, block_size=4, max_running=4), graphs=True)
    cache, spare = runner.cache, runner.cache.num_blocks
    g = torch.Generator().manual_seed(0)
    for pool in cache.key + cache.value:
        pool.copy_(torch.randn(pool.shape, generator=g))
    ids, positions, tables = [7, 8, 9], [5, 0, 9], [[3, 1], [4], [10, 11, 12]]
    eager_pools = [p.clone() for p in cache.key + cache.value]
    before = [p.clone() for p in eager_pools]
    logits, greedy = runner.graphs.run(ids, positions, tables)
    after = cache.key + cache.value
    written = {(1, 1), (4, 0), (12, 1)}  # (block, slot) of positions 5, 0, 9 through the tables, block_size 4
    for old, new in zip(before, after, strict=True):
        changed = {(b, s) for b, _, s in (old != new).any(-1).nonzero().tolist()}
        assert {(b, s) for b, s in changed if b != spare} == written
        assert changed - written <= {(spare, 0)}
    # the same rows eagerly, over the pool as it was
    for pool, old in zip(after, eager_pools, strict=True):
        pool.copy_(old)
    table = table_tensor(tables)
    with torch.inference_mode():
        runner._grow_ropes(10)
        eager = runner._step(torch.tensor(ids), torch.tensor(positions), table, 10, None)
    assert logits.shape == eager.shape and torch.allclose(logits, eager, atol=1e-5, rtol=1e-5)
    assert torch.equal(greedy, eager.argmax(-1))
    other, _ = runner.graphs.run([1, 2], [3, 6], [[5], [6, 7]])
    assert other.shape[0] == 2 and not torch.allclose(other, logits[:2])


@needs_interpreter
def test_graphs_of_several_length_tiers_and_splits_give_transformers_tokens(tmp_path, monkeypatch):
    """Tiers of 16, 64 and 128 keys and attention splits of 32 (both shrunk from 2,048 and 512 to fit the tiny
    model's context): sequences that cross tiers and splits while they decode get transformers' greedy tokens, and
    each tier's graphs were replayed."""
    from gqa.kernels.triton import paged
    from gqa.serve import step_graphs

    monkeypatch.setattr(step_graphs, "FIRST_TIER", 16)
    monkeypatch.setattr(paged, "CHUNK", 32)
    ref = family_model("qwen2", tmp_path, head_dim=32)
    model = gqa.load_model(tmp_path, dtype=torch.float32, tokenizer=False)
    prompts = [list(range(20, 60)), [5, 9, 17, 33, 2, 8, 40, 41, 7]]  # decoding from 40 and 9 tokens on
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    engine = _graphed(model, kv_cache_mib=1, block_size=4, prefill_chunk=64, max_running=2)
    graphs = engine.runner.graphs
    assert graphs.lengths == (16, 64, 128)
    together = serve_all(engine, prompts, params)
    assert together == [hf_greedy(ref, prompt, 30) for prompt in prompts]
    short = serve_all(engine, [[3, 4]], SamplingParams(max_tokens=10, ignore_eos=True))  # alone, within 16 keys
    assert short == [hf_greedy(ref, [3, 4], 10)]
    assert {length for _, length in graphs.used} == {16, 64, 128}


@needs_interpreter
def test_fp8_never_reaches_the_cpu_kernels(tmp_path):
    """fp8 caches exist on CPU only under Triton's interpreter (here): the CPU engine refuses an fp8 pool by name,
    and ``generate`` over fp8 static caches decodes without the native step (which reads q8_0 / q4_0 only)."""
    family_model("qwen2", tmp_path, head_dim=32)
    model = gqa.load_model(tmp_path, dtype=torch.float32, tokenizer=False)
    with pytest.raises(ValueError, match="kv_cache_dtype fp8_e4m3 is read by the CUDA kernels only"):
        Engine(model, kv_cache_mib=1, kv_cache_dtype="fp8")
    out = model.generate([[5, 9, 17, 33]], max_new_tokens=4, eos_token_ids=[], kv_dtype="fp8")
    assert len(out[0]) == 4
