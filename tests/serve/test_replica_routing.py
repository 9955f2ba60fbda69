"""The replica router's policy as pure functions (``serve.replica_routing``), and the front's metrics merging."""

from __future__ import annotations

import pytest

from gqa.serve.replica_front import pool_tokens, summed_metrics
from gqa.serve.replica_routing import CHARS_PER_TOKEN, CHUNK_CHARS, ReplicaRouter, chunk_keys, prompt_text

SYSTEM = "You are a terse assistant for a shipping company. " * 12  # ~600 characters: ~9 chunks


def _chat(system: str, *turns: str) -> dict:
    messages = [{"role": "system", "content": system}]
    messages += [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    return {"model": "m", "messages": messages, "max_tokens": 8}


def test_prompt_text_of_a_growing_conversation_starts_with_the_earlier_one():
    first = prompt_text(_chat(SYSTEM, "Where is my parcel?"))
    later = prompt_text(_chat(SYSTEM, "Where is my parcel?", "In Lyon.", "When will it arrive?"))
    assert later.startswith(first)
    keys, later_keys = chunk_keys(first), chunk_keys(later)
    assert len(keys) == len(first) // CHUNK_CHARS and later_keys[: len(keys)] == keys
    # sampling settings are not the prompt
    assert prompt_text(_chat(SYSTEM, "x") | {"temperature": 0.3, "max_tokens": 99}) == prompt_text(_chat(SYSTEM, "x"))


def test_chunk_keys_are_chained():
    """The same chunk after different text has a different key: a key names its whole prefix."""
    a, b = chunk_keys("A" * CHUNK_CHARS + "C" * CHUNK_CHARS), chunk_keys("B" * CHUNK_CHARS + "C" * CHUNK_CHARS)
    assert a[1] != b[1] and a[0] != b[0]
    assert chunk_keys("x" * (CHUNK_CHARS - 1)) == []


def test_a_repeated_prefix_stays_on_one_replica_and_new_prompts_spread():
    router = ReplicaRouter(3)
    systems = [f"System prompt number {i}: " + SYSTEM for i in range(3)]
    first = [router.pick(chunk_keys(prompt_text(_chat(s, "hello")))) for s in systems]
    for i in first:
        router.done(i)
    assert sorted(first) == [0, 1, 2]  # distinct prefixes: the least loaded, then the least sent
    for round_ in range(4):
        for s, home in zip(systems, first, strict=True):
            i = router.pick(chunk_keys(prompt_text(_chat(s, f"question {round_}"))))
            router.done(i)
            assert i == home
    assert router.by_prefix == [4, 4, 4]


def test_a_busy_holder_is_passed_over():
    """The holder keeps its prefix's requests until its load exceeds both twice the other's and the other's plus
    ``balance_slack``."""
    router = ReplicaRouter(2, balance_slack=2)
    keys = chunk_keys(prompt_text(_chat(SYSTEM, "q")))
    home = router.pick(keys)  # held from here, never done: the holder's load grows
    picks = [router.pick(keys) for _ in range(4)]
    assert picks[:2] == [home, home]  # loads 1, 2: within 0 + 2
    assert picks[2] != home  # 3 > max(2 * 0, 0 + 2): the other, which learns the prefix
    assert router.load[home] == 3 and router.by_prefix[home] == 2


def test_a_burst_of_new_prefixes_is_split_by_cached_text_not_by_load():
    """Requests arriving at once (none done): four prefixes drawn A A B A C D. Placing a new prefix on the least
    loaded replica gave B, C and D to the one not busy with A's (3 prefixes against 1, more than its pool holds); while
    the loads are within the balance bound a new prefix goes where the least text is cached (SGLang's router), 2
    against 2."""
    router = ReplicaRouter(2)
    systems = {name: f"Instructions for product {name}: " + SYSTEM for name in "ABCD"}
    homes: dict[str, set[int]] = {}
    for n, name in enumerate("AABACD"):
        homes.setdefault(name, set()).add(router.pick(chunk_keys(prompt_text(_chat(systems[name], f"q{n}")))))
    assert all(len(h) == 1 for h in homes.values())
    held = [sum(homes[name] == {i} for name in "ABCD") for i in range(2)]
    assert held == [2, 2] and router.load == [4, 2]


def test_a_small_shared_start_is_not_a_prefix_hit():
    """A short shared start weighs little against a replica's load, and below ``min_share`` it is not counted as a
    prefix hit."""
    router = ReplicaRouter(2, min_share=0.5)
    short = "s" * CHUNK_CHARS
    home = router.pick(chunk_keys(short + "a" * 10 * CHUNK_CHARS))
    assert router.pick(chunk_keys(short + "b" * 10 * CHUNK_CHARS)) != home
    assert router.by_prefix == [0, 0]


def test_round_robin_and_least_loaded_ignore_prefixes():
    rr = ReplicaRouter(3, "round-robin")
    keys = chunk_keys(prompt_text(_chat(SYSTEM, "q")))
    assert [rr.pick(keys) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    ll = ReplicaRouter(2, "least-loaded")
    assert [ll.pick(keys) for _ in range(4)] == [0, 1, 0, 1]  # none done: alternating by load


def test_a_replica_down_is_never_picked():
    for policy in ("prefix", "least-loaded", "round-robin"):
        router = ReplicaRouter(3, policy)
        keys = chunk_keys(prompt_text(_chat(SYSTEM, "q")))
        home = router.pick(keys)
        router.done(home)
        router.down(home)
        assert home not in {router.pick(keys) for _ in range(6)}
        for i in range(3):
            router.down(i)
        with pytest.raises(RuntimeError, match="no replica"):
            router.pick(keys)


def test_bad_router_arguments():
    with pytest.raises(ValueError, match="replicas"):
        ReplicaRouter(0)
    with pytest.raises(ValueError, match="policy"):
        ReplicaRouter(2, "random")


def test_summed_metrics_add_up_each_sample():
    a = '# HELP x_total things\n# TYPE x_total counter\nx_total 3\ny{kind="a"} 1.5\n'
    b = '# HELP x_total things\n# TYPE x_total counter\nx_total 4\ny{kind="a"} 2\ny{kind="b"} 1\n'
    text = summed_metrics([a + "gqa_kv_block_size 16\n", b + "gqa_kv_block_size 16\n"])
    assert text.count("# HELP x_total") == 1
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    assert samples == {"x_total": "7", 'y{kind="a"}': "3.5", 'y{kind="b"}': "1", "gqa_kv_block_size": "16"}


def test_a_replica_forgets_past_what_its_pool_holds():
    """With a pool of ~2 prefixes' text, a third prefix pushes out the least recently used, as the replica's own
    prefix cache does: the router stops sending that prefix there for a hit it would not get."""
    router = ReplicaRouter(1)
    prompts = [f"Prefix {i}: " + SYSTEM for i in range(3)]
    keys = [chunk_keys(prompt_text(_chat(p, "q"))) for p in prompts]
    router.set_capacity(0, tokens=int(2.2 * len(keys[0]) * CHUNK_CHARS / CHARS_PER_TOKEN))
    for k in keys:
        router.done(router.pick(k))
    assert router.matched(0, keys[0]) == 0 and router.matched(0, keys[2]) == len(keys[2])


def test_pool_tokens_from_a_replicas_metrics():
    text = "# HELP gqa_kv_blocks_free x\ngqa_kv_blocks_free 90\ngqa_kv_blocks_used 10\ngqa_kv_block_size 16\n"
    assert pool_tokens(text) == 1600
    assert pool_tokens("gqa_kv_blocks_free 90\n") == 0
