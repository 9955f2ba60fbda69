"""The serving scheduler on its own — no model, no kernels, no tensors: admission order, prompt chunk sizes,
preemption's choice and recomputation, prefix reuse, finishing, and the block accounting after each."""

from __future__ import annotations

import pytest

from gqa.serve.blocks import BlockManager
from gqa.serve.request import Request, RequestState
from gqa.serve.sampling import SamplingParams
from gqa.serve.scheduler import Scheduler

EOS = 0


def scheduler(num_blocks=16, block_size=4, max_running=4, prefill_chunk=8) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), max_running, prefill_chunk, {EOS})


def request(name: str, prompt: list[int], max_tokens: int = 4, ignore_eos: bool = False) -> Request:
    return Request(name, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos), tokens=list(prompt))


def run_step(s: Scheduler, token: int = 7):
    """One step as the engine runs it, with ``token`` as every sampled token: (the work, the outputs)."""
    batch = s.schedule()
    wanting = s.fed(batch.work)
    return [(r.request_id, start, end) for r, start, end in batch.work], s.update(wanting, [token] * len(wanting))


def test_admission_is_first_come_first_served_up_to_max_running():
    s = scheduler(max_running=2)
    for name in "abc":
        s.add(request(name, [5, 6]))
    work, _ = run_step(s)
    assert [w[0] for w in work] == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c"] and [r.state for r in s.running] == [RequestState.DECODE] * 2


def test_prompts_are_read_in_chunks_and_decoding_rows_come_first():
    """While a request decodes, prompts get ``prefill_chunk`` rows per step; while none does, four times that."""
    s = scheduler(num_blocks=64, prefill_chunk=8)
    s.add(request("long", list(range(1, 41)), max_tokens=8))  # 40 prompt tokens
    work, outputs = run_step(s)
    assert work == [("long", 0, 32)] and outputs == []  # nothing decodes: 4 x 8 rows
    work, outputs = run_step(s)
    assert work == [("long", 32, 40)] and [o.token_ids for o in outputs] == [[7]]
    s.add(request("next", list(range(100, 120))))  # no block in common with "long"
    work, _ = run_step(s)
    assert work == [("long", 40, 41), ("next", 0, 8)]  # the decoding row first, then one chunk of 8
    work, _ = run_step(s)
    assert work == [("long", 41, 42), ("next", 8, 16)]


def test_finishing_by_eos_length_and_abort_frees_every_block():
    s = scheduler()
    free = s.blocks.num_free
    s.add(request("eos", [5, 6, 7]))
    s.add(request("length", [5, 6], max_tokens=2, ignore_eos=True))
    s.add(request("aborted", [9, 9, 9, 9, 9]))
    batch = s.schedule()
    wanting = s.fed(batch.work)
    outputs = {o.request_id: o for o in s.update(wanting, [EOS, 3, 3])}
    assert outputs["eos"].finished and outputs["eos"].finish_reason == "stop"
    assert not outputs["length"].finished
    assert s.abort("aborted").finish_reason == "abort" and s.abort("aborted") is None
    _, outputs = run_step(s, token=EOS)  # ignore_eos: EOS is a token like another, max_tokens ends it
    assert outputs[0].finish_reason == "length" and outputs[0].completion_tokens == 2
    assert not s.has_work and s.blocks.num_free == free


def test_admission_keeps_a_block_free_for_each_running_request():
    """Three requests in 6 blocks of 2 slots (2 blocks each): a alone takes its 2; b leaves 2 free for a's and its own
    next block; c would leave none, so it waits rather than be preempted at the next block boundary."""
    s = scheduler(num_blocks=6, block_size=2, max_running=3)
    for name, first in zip("abc", (5, 8, 11), strict=True):  # no prefix in common
        s.add(request(name, [first, first + 1, first + 2], max_tokens=2, ignore_eos=True))
    work, _ = run_step(s)
    assert [w[0] for w in work] == ["a", "b"] and [r.request_id for r in s.waiting] == ["c"]
    for _ in range(20):
        if not s.has_work:
            break
        run_step(s)
    assert not s.has_work and s.counts["preemptions"] == 0 and s.blocks.num_free == 6


def test_preemption_takes_the_latest_admitted_and_recomputes_it_from_its_tokens():
    """Two requests in 6 blocks of 2 slots (a third waits): when their growth runs out of blocks the latest admitted
    one is preempted (blocks freed, front of the queue), then readmitted and recomputed from its prompt and the
    tokens it already had."""
    s = scheduler(num_blocks=6, block_size=2, max_running=3)
    for name, first in zip("abc", (5, 8, 11), strict=True):
        s.add(request(name, [first, first + 1, first + 2], max_tokens=6, ignore_eos=True))
    for _ in range(10):
        run_step(s)
        if s.counts["preemptions"]:
            break
    assert [r.request_id for r in s.waiting] == ["b", "c"] and s.counts["preemptions"] == 1
    b = s.waiting[0]
    assert b.state is RequestState.WAITING and b.table is None and b.computed == 0 and b.preemptions == 1
    had = len(b.tokens)  # its prompt and the tokens it produced
    done = {}
    for _ in range(100):
        if not s.has_work:
            break
        work, outputs = run_step(s)
        for rid, start, end in work:
            if rid == "b":  # readmitted: what it had is read again (from its cached full blocks on), then it decodes
                done.setdefault("recomputed", (start, end))
        for o in outputs:
            if o.finished:
                done[o.request_id] = o.completion_tokens
    assert done["a"] == done["b"] == done["c"] == 6 and had >= 5
    start, end = done["recomputed"]
    assert start < had - 1 and end == had  # its last token's row (at least) computed again, then new ones
    assert s.blocks.num_free == 6
    # the lookups counted as vLLM counts them: three first admissions (one full block each), b's readmission apart
    assert s.blocks.prefix_queries == 3 and s.blocks.resumed_queries == (had - 1) // 2
    assert s.blocks.resumed_hits == (start // 2)  # its blocks still cached, read again instead of computed


def test_a_shared_prefix_is_computed_once():
    """Two prompts with the same first 8 tokens (two full blocks): the second request starts at token 8."""
    s = scheduler(num_blocks=16, block_size=4)
    system = [11, 12, 13, 14, 15, 16, 17, 18]
    s.add(request("first", [*system, 1, 2]))
    run_step(s)
    s.add(request("second", [*system, 3, 4, 5]))
    work, _ = run_step(s)
    assert ("second", 8, 11) in work
    assert s.blocks.prefix_hits == 2


def test_a_failing_step_fails_the_running_requests_or_the_head_of_the_queue():
    s = scheduler(max_running=1)
    s.add(request("running", [5, 6]))
    s.add(request("waiting", [7, 8]))
    run_step(s)
    failed = s.fail_step("KeyError: boom")
    assert [(o.request_id, o.finish_reason, o.error) for o in failed] == [("running", "error", "KeyError: boom")]
    assert [r.request_id for r in s.waiting] == ["waiting"]
    assert [o.request_id for o in s.fail_step("IndexError")] == ["waiting"]  # nothing runs: the head fails
    assert not s.has_work and s.blocks.num_free == 16


def test_a_request_id_is_taken_once():
    from gqa.serve.request import EngineError

    s = scheduler()
    s.add(request("x", [5]))
    with pytest.raises(EngineError, match="already in use"):
        s.add(request("x", [6]))


def test_the_scheduler_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, gqa.serve.scheduler; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout == "False\n"
