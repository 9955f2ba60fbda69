"""The paged KV cache's block manager: allocation, reference counts, prefix sharing only of computed full blocks,
reclaiming cached blocks least recently freed first, OutOfBlocks taking nothing, and the pool always balancing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gqa.serve import BlockManager, OutOfBlocks


def test_a_sequence_takes_blocks_as_it_grows_and_gives_them_back():
    m = BlockManager(num_blocks=8, block_size=4)
    t = m.allocate([1, 2, 3, 4, 5])  # 5 tokens: 2 blocks
    assert len(t.blocks) == 2 and len(set(t.blocks)) == 2 and m.num_free == 6 and t.cached_tokens == 0
    for tok in (6, 7, 8):
        m.append(t, tok)
    assert len(t.blocks) == 2  # 8 tokens fill 2 blocks exactly
    m.append(t, 9)
    assert len(t.blocks) == 3 and t.slot(8, 4) == (t.blocks[2], 0) and t.slot(5, 4) == (t.blocks[1], 1)
    m.free(t)
    assert m.num_free == 8 and m.refs == [0] * 8


def test_blocks_behind_a_sliding_window_go_back_early_and_once():
    """``release_before``: the blocks wholly before a position return to the pool (a shared prefix block only loses
    this sequence's reference, a computed one stays cached), their ids stay in the table, and ``free`` gives back the
    rest only."""
    m = BlockManager(num_blocks=8, block_size=4)
    a = m.allocate(list(range(10)))  # 3 blocks
    m.computed(a, 10)
    b = m.allocate([*range(8), 42])  # shares a's two full blocks
    assert b.cached_tokens == 8 and m.num_free == 4
    ids = list(a.blocks)
    assert m.release_before(a, 7) == 1 and a.blocks == ids and a.released == 1  # slots 0-3 only
    assert m.refs[ids[0]] == 1 and m.num_free == 4  # b still holds it
    assert m.release_before(a, 9) == 1 and m.release_before(a, 9) == 0 and m.release_before(a, -3) == 0
    m.free(b)  # b's references go: the two cached blocks are idle (reclaimable), b's own block fresh
    assert m.num_free == 7 and m.refs[ids[0]] == 0 and m.refs[ids[2]] == 1
    m.free(a)
    assert m.num_free == 8 and sum(m.refs) == 0 and a.released == 0
    assert m.allocate([*range(8), 7]).cached_tokens == 8  # released blocks kept their prefix


def test_a_common_prefix_is_shared_once_computed():
    m = BlockManager(num_blocks=16, block_size=4)
    system = list(range(100, 108))  # two full blocks
    a = m.allocate([*system, 1, 2, 3])
    b = m.allocate([*system, 4, 5])
    assert b.cached_tokens == 0 and set(a.blocks).isdisjoint(b.blocks)  # a's K/V not written yet: nothing shared
    m.computed(a, 11)
    c = m.allocate([*system, 6])
    assert c.cached_tokens == 8 and c.blocks[:2] == a.blocks[:2] and c.blocks[2] not in a.blocks
    assert [m.refs[x] for x in a.blocks[:2]] == [2, 2] and m.prefix_hits == 2
    assert m.prefix_queries == 2 + 2 + 2  # each sequence's full blocks before its last token, hit or not
    d = m.allocate([*system[:4], 9, 9, 9, 9, 1])  # same first block, different second
    assert d.cached_tokens == 4 and d.blocks[0] == a.blocks[0] and d.blocks[1] != a.blocks[1]
    for t in (a, b, c, d):
        m.free(t)
    assert m.num_free == 16 and sum(m.refs) == 0


def test_the_last_prompt_token_is_always_computed():
    """A prompt of whole cached blocks shares all but its last block: the last token's logits are needed."""
    m = BlockManager(num_blocks=8, block_size=4)
    a = m.allocate(list(range(8)))
    m.computed(a, 8)
    b = m.allocate(list(range(8)))
    assert b.cached_tokens == 4 and b.blocks[0] == a.blocks[0] and b.blocks[1] != a.blocks[1]


def test_free_cached_blocks_are_reused_then_reclaimed_least_recently_freed_first():
    m = BlockManager(num_blocks=4, block_size=2)
    a = m.allocate([1, 2, 3])
    m.computed(a, 3)
    m.free(a)  # block a[0] ([1, 2]) stays cached while free
    assert m.num_free == 4
    b = m.allocate([1, 2, 5])
    assert b.cached_tokens == 2 and b.blocks[0] == a_first(m, [1, 2])
    m.free(b)
    c = m.allocate(list(range(10, 17)))  # 4 blocks: every free block, the cached one reclaimed last
    assert len(c.blocks) == 4 and m.num_free == 0
    m.free(c)
    d = m.allocate([1, 2, 5])
    assert d.cached_tokens == 0  # the [1, 2] block was reclaimed: its cache entry is gone


def a_first(m: BlockManager, tokens: list[int]) -> int:
    from gqa.serve.blocks import block_hash

    return m._cached[block_hash(b"", tokens)]


def test_a_shared_prefix_outlives_later_one_off_blocks():
    """Reclaiming takes never-shared idle blocks first: a prefix two sequences read stays cached while one-off
    prompts freed after it come and go (plain least-recently-freed order reclaimed the prefix first)."""
    m = BlockManager(num_blocks=6, block_size=2)
    system = [1, 2, 3, 4]
    for tail in ([5, 6], [7, 8]):  # two requests over the same two-block prefix: the second one reads it
        t = m.allocate([*system, *tail])
        m.computed(t, 6)
        m.free(t)
    for n in range(3):  # then one-off prompts of two blocks, each freed before the next
        t = m.allocate([10 + 4 * n, 11 + 4 * n, 12 + 4 * n, 13 + 4 * n])
        m.computed(t, 4)
        m.free(t)
    again = m.allocate([*system, 9, 9])
    assert again.cached_tokens == 4


def test_a_resumed_sequence_is_counted_apart():
    """A sequence taken up again after preemption finds its own blocks cached: its lookup goes to resumed_*, so the
    prefix cache's hit rate (prefix_hits / prefix_queries) counts first admissions only, as vLLM's does."""
    m = BlockManager(num_blocks=8, block_size=2)
    a = m.allocate([1, 2, 3, 4, 5])
    m.computed(a, 5)
    m.free(a)  # preempted: its two full blocks stay cached
    again = m.allocate([1, 2, 3, 4, 5, 6], resumed=True)
    assert again.cached_tokens == 4
    assert (m.prefix_hits, m.prefix_queries, m.resumed_hits, m.resumed_queries) == (0, 2, 2, 2)


def test_out_of_blocks_takes_nothing():
    m = BlockManager(num_blocks=3, block_size=4)
    a = m.allocate(list(range(9)))  # 3 blocks
    queries = m.prefix_queries
    with pytest.raises(OutOfBlocks):
        m.allocate(list(range(9)))
    assert m.num_free == 0 and m.refs == [1, 1, 1]
    assert m.prefix_queries == queries  # waiting for room is not a lookup
    for tok in range(3):
        m.append(a, tok)  # fills the third block
    with pytest.raises(OutOfBlocks):
        m.append(a, 99)
    assert len(a.tokens) == 12 and len(a.blocks) == 3


def test_keep_free_leaves_that_many_blocks_or_takes_nothing():
    m = BlockManager(num_blocks=5, block_size=4)
    with pytest.raises(OutOfBlocks, match=r"3 blocks needed \(3 to keep free\), 5 free"):
        m.allocate(list(range(9)), keep_free=3)
    assert m.num_free == 5 and m.refs == [0] * 5
    m.allocate(list(range(9)), keep_free=2)
    assert m.num_free == 2


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 4), (4, 0), (True, 4), (4, 2.0), (-1, 1)])
def test_bad_sizes_are_value_errors_naming_the_argument(num_blocks, block_size):
    with pytest.raises(ValueError, match="num_blocks" if num_blocks in (0, True, -1) else "block_size"):
        BlockManager(num_blocks, block_size)


def test_empty_prompts_and_bad_counts_are_value_errors():
    m = BlockManager(4, 4)
    with pytest.raises(ValueError, match="at least one token"):
        m.allocate([])
    t = m.allocate([1, 2])
    with pytest.raises(ValueError, match="num_tokens"):
        m.computed(t, 3)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["new", "grow", "done", "free"]), st.integers(0, 5), st.integers(1, 9))))
def test_the_pool_always_balances(ops):
    """Any sequence of allocations (prompts from a small alphabet, so prefixes repeat), growth, computed marks and
    frees: every block is free or referenced exactly as often as tables hold it, and all come back at the end."""
    m = BlockManager(num_blocks=12, block_size=3)
    live = []
    for op, a, n in ops:
        try:
            if op == "new":
                live.append(m.allocate([a % 2] * 3 + [a] * n))
            elif op == "grow" and live:
                m.append(live[a % len(live)], n)
            elif op == "done" and live:
                t = live[a % len(live)]
                m.computed(t, len(t.tokens))
            elif op == "free" and live:
                m.free(live.pop(a % len(live)))
        except OutOfBlocks:
            pass
        held = [b for t in live for b in t.blocks]
        assert all(m.refs[b] == held.count(b) for b in range(12))
        assert m.num_free == 12 - len(set(held))
    for t in live:
        m.free(t)
    assert m.num_free == 12 and sum(m.refs) == 0


def test_a_cached_prefix_is_shared_in_whole_blocks():
    m = BlockManager(num_blocks=32, block_size=4)
    first = m.allocate(list(range(23)))
    m.computed(first, 23)  # 5 full blocks cached
    assert m.allocate([*range(23), 99]).cached_tokens == 20
    assert m.allocate([*range(22), 99]).cached_tokens == 20
    assert m.allocate([*range(21), 99]).cached_tokens == 20
    assert m.allocate([*range(6), 99]).cached_tokens == 4
