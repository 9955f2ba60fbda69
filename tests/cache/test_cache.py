"""KV caches: decoding through a cache equals one full causal forward; left-padded batches equal rows alone."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing

import gqa

E, H_q, H_kv, D = 48, 6, 2, 8


def module(seed=0, **kw):
    torch.manual_seed(seed)
    return gqa.GroupedQueryAttention(E, H_q, H_kv, rope=gqa.RoPE(D, theta=500.0), qkv_bias=True, **kw).eval()


def make_cache(kind, B, max_len=32, dtype=torch.float32):
    if kind == "static":
        return gqa.StaticKVCache(B, H_kv, D, max_len, dtype=dtype)
    return gqa.DynamicKVCache(B, H_kv, D, initial_len=2, dtype=dtype)


@pytest.mark.parametrize("kind", ["static", "dynamic"])
@pytest.mark.parametrize("chunks", [[1] * 9, [4, 1, 1, 3], [9]])
def test_decode_equals_full_forward(kind, chunks):
    attn = module()
    x = torch.randn(2, 9, E)
    full = attn(x, is_causal=True)
    cache = make_cache(kind, 2)
    outs, t = [], 0
    for n in chunks:
        outs.append(attn(x[:, t : t + n], is_causal=True, cache=cache))
        t += n
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-5, rtol=1e-5)
    assert cache.seq_len == 9
    assert torch.equal(cache.lengths, torch.tensor([9, 9]))


@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_left_padded_batch_equals_rows_alone(kind):
    attn = module(1)
    lengths, new = [5, 3, 1], 4
    T = max(lengths)
    seqs = [torch.randn(n + new, E) for n in lengths]
    # batched: left-pad the prompts, then decode `new` tokens for every row at once
    prompt = torch.zeros(len(lengths), T, E)
    for b, n in enumerate(lengths):
        prompt[b, T - n :] = seqs[b][:n]
    cache = make_cache(kind, len(lengths))
    cache.set_left_padding([T - n for n in lengths])
    out_prompt = attn(prompt, is_causal=True, cache=cache)
    steps = []
    for i in range(new):
        token = torch.stack([s[n + i] for s, n in zip(seqs, lengths, strict=True)])[:, None]  # (B, 1, E)
        steps.append(attn(token, is_causal=True, cache=cache))
    assert torch.equal(cache.lengths, torch.tensor(lengths) + new)
    for b, n in enumerate(lengths):
        alone = attn(seqs[b][None], is_causal=True)[0]  # (n + new, E)
        torch.testing.assert_close(out_prompt[b, T - n :], alone[:n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(torch.cat([s[b] for s in steps]), alone[n:], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out_prompt).all()  # padding queries see no key: zeros, not NaN


@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_kept_rows_decode_as_they_would_have_in_the_whole_batch(kind):
    """Rows 2 and 0 of a left-padded batch of 3, kept after the prompt (in that order), decode the next tokens as
    those rows alone; bad row lists are refused."""
    attn = module(2)
    lengths, new = [5, 3, 1], 3
    T = max(lengths)
    seqs = [torch.randn(n + new, E) for n in lengths]
    prompt = torch.zeros(3, T, E)
    for b, n in enumerate(lengths):
        prompt[b, T - n :] = seqs[b][:n]
    cache = make_cache(kind, 3)
    cache.set_left_padding([T - n for n in lengths])
    attn(prompt, is_causal=True, cache=cache)
    cache.keep_rows([2, 0])
    assert cache.key.shape[0] == 2 and torch.equal(cache.start, torch.tensor([T - 1, 0])) and cache.seq_len == T
    for i in range(new):
        token = torch.stack([seqs[2][1 + i], seqs[0][5 + i]])[:, None]  # (2, 1, E)
        out = attn(token, is_causal=True, cache=cache)
        for r, (b, n) in enumerate(((2, 1), (0, 5))):
            alone = attn(seqs[b][None, : n + i + 1], is_causal=True)[0, -1]
            torch.testing.assert_close(out[r, 0], alone, atol=1e-5, rtol=1e-5)
    for bad in ([], [2], [-1], [[0]]):
        with pytest.raises(ValueError, match="rows must be a non-empty 1-D list of rows in"):
            cache.keep_rows(bad)


def test_static_cache_overflow_raises_and_leaves_cache_unchanged():
    attn = module()
    cache = gqa.StaticKVCache(1, H_kv, D, 6)
    attn(torch.randn(1, 5, E), is_causal=True, cache=cache)
    key, value = cache.key.clone(), cache.value.clone()
    with pytest.raises(ValueError, match=r"overflow: 2 new tokens after 5 cached exceed max_len 6"):
        attn(torch.randn(1, 2, E), is_causal=True, cache=cache)
    assert cache.seq_len == 5
    assert torch.equal(cache.key, key) and torch.equal(cache.value, value)
    attn(torch.randn(1, 1, E), is_causal=True, cache=cache)  # the last slot still works
    assert cache.seq_len == 6


def test_dynamic_cache_grows_and_keeps_contents():
    cache = gqa.DynamicKVCache(2, H_kv, D, initial_len=3)
    ks = [torch.randn(2, H_kv, n, D) for n in (2, 1, 4, 9)]
    for k in ks:
        out_k, out_v = cache.update(k, -k)
    assert cache.capacity >= 16 and cache.seq_len == 16
    torch.testing.assert_close(out_k, torch.cat(ks, 2))
    torch.testing.assert_close(out_v, -torch.cat(ks, 2))


def test_update_returns_views_not_copies():
    cache = gqa.StaticKVCache(2, H_kv, D, 10)
    k, _ = cache.update(torch.randn(2, H_kv, 3, D), torch.randn(2, H_kv, 3, D))
    assert k.untyped_storage().data_ptr() == cache.key.untyped_storage().data_ptr()
    assert k.shape == (2, H_kv, 3, D)


def test_nbytes_and_kv_cache_bytes():
    cache = gqa.StaticKVCache(4, 3, 64, 128, dtype=torch.bfloat16)
    assert cache.nbytes == 2 * 4 * 3 * 64 * 128 * 2
    # SmolLM2-135M: 30 layers, 3 KV heads of 64, fp16 -> 23,040 bytes per token; MHA (9 heads) is 3x that
    assert gqa.kv_cache_bytes(30, 3, 64, 1) == 46_080  # float32 by default, as the caches themselves
    assert gqa.kv_cache_bytes(30, 3, 64, 1, dtype=torch.float16) == 23_040
    assert gqa.kv_cache_bytes(1, H_kv, D, 8, batch=2) == gqa.StaticKVCache(2, H_kv, D, 8).nbytes
    assert gqa.kv_cache_bytes(30, 9, 64, 4096, batch=2, dtype=torch.float32) == 2 * 30 * 9 * 64 * 4096 * 2 * 4
    mha = module().__class__(E, H_q)  # the same layer as MHA: a cache H_q / H_kv times larger
    assert mha.num_kv_heads == H_q and gqa.kv_cache_bytes(1, H_q, D, 10) == 3 * gqa.kv_cache_bytes(1, H_kv, D, 10)


def test_reset_and_dtype_mismatch():
    cache = gqa.StaticKVCache(1, H_kv, D, 8, dtype=torch.float16)
    with pytest.raises(TypeError, match=r"dtype torch\.float32 but the cache stores torch\.float16"):
        cache.update(torch.randn(1, H_kv, 1, D), torch.randn(1, H_kv, 1, D))
    cache.update(torch.randn(1, H_kv, 2, D).half(), torch.randn(1, H_kv, 2, D).half())
    cache.set_left_padding([1])
    cache.reset()
    assert cache.seq_len == 0 and not cache.padded and int(cache.start[0]) == 0


def test_half_precision_decode():
    attn = module().to(torch.bfloat16)
    x = torch.randn(1, 6, E, dtype=torch.bfloat16)
    full = attn(x, is_causal=True)
    cache = make_cache("static", 1, dtype=torch.bfloat16)
    steps = torch.cat([attn(x[:, i : i + 1], is_causal=True, cache=cache) for i in range(6)], 1)
    torch.testing.assert_close(steps, full, atol=3e-2, rtol=3e-2)
    assert steps.dtype == torch.bfloat16


def test_static_cache_under_torch_compile_no_recompiles():
    """A compiled decode step: static shapes (the whole buffer, masked), one graph for every step, same outputs."""
    torch._dynamo.reset()
    attn = module(2)
    lengths = [4, 2]
    x = torch.randn(2, 4 + 5, E)
    x[1, :2] = 0.0

    def run(step_fn):
        cache = gqa.StaticKVCache(2, H_kv, D, 16)
        cache.set_left_padding([0, 2])
        outs = [attn(x[:, :4], is_causal=True, cache=cache)]
        outs += [step_fn(x[:, t : t + 1], cache) for t in range(4, 9)]
        return torch.cat(outs, 1)

    def step(tok, cache):
        return attn(tok, is_causal=True, cache=cache)

    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    with torch.no_grad():
        eager = run(step)
        out = run(compiled)
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames"
    torch.testing.assert_close(out[:, 4:], eager[:, 4:], atol=1e-5, rtol=1e-5)
    assert lengths  # rows of different lengths decode in one compiled graph


@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_compiled_decode_past_the_rope_table_and_the_cache_capacity(kind):
    """Compiled decode steps beyond the RoPE table (8 positions) and, for a dynamic cache, beyond its capacity (2):
    the same outputs as one eager causal forward over the whole sequence."""
    torch._dynamo.reset()
    attn = module(3)
    attn.rope = gqa.RoPE(D, theta=500.0, max_position=8)
    x = torch.randn(2, 40, E)
    with torch.no_grad():
        full = attn(x, is_causal=True)
        attn.rope = gqa.RoPE(D, theta=500.0, max_position=8)  # a fresh, small table for the compiled run
        cache = make_cache(kind, 2, max_len=40)
        step = torch.compile(lambda t, c: attn(t, is_causal=True, cache=c), backend="eager")
        outs = [attn(x[:, :3], is_causal=True, cache=cache)]
        outs += [step(x[:, t : t + 1], cache) for t in range(3, 40)]
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-5, rtol=1e-5)
    assert cache.seq_len == 40 and cache.capacity >= 40
