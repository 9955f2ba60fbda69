"""``gqa.parallel.distributed.launched_world`` under a real ``torchrun`` (2 gloo ranks on one machine): the group it
creates is gone when the block ends, normally or by an exception; a group that existed before is left alone.

A torchrun rank that leaves its gloo group to the interpreter's exit can abort there ("terminate called without an
active exception", SIGABRT): ``gqa convert``'s data-parallel healing did, now and then, before it used this block.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

WORKER = textwrap.dedent(
    """
    import sys

    import torch.distributed as dist
    from gqa.parallel.distributed import launched_world

    ending = sys.argv[1]
    try:
        with launched_world() as (rank, world):
            assert dist.is_initialized() and (rank, world) == (dist.get_rank(), 2), (rank, world)
            with launched_world() as inner:  # the group exists: this block neither makes nor ends one
                assert inner == (rank, world)
            assert dist.is_initialized(), "the inner block ended the outer block's group"
            dist.barrier()
            if ending == "raise":
                raise KeyError("boom")
    except KeyError:
        assert ending == "raise"
    assert not dist.is_initialized(), f"the group outlived its block ({ending})"
    print(f"rank {rank} ok", flush=True)
    """
)


@pytest.mark.parametrize("ending", ["return", "raise"])
def test_launched_world_ends_the_group_it_made(tmp_path, ending):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = os.environ | {"GQA_DIST_TIMEOUT": "60", "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script), ending],
        capture_output=True, text=True, env=env, timeout=180,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(re.findall(r"rank \d ok", run.stdout)) == ["rank 0 ok", "rank 1 ok"], run.stdout


def test_outside_torchrun_it_is_one_process(monkeypatch):
    import torch.distributed as dist

    from gqa.parallel.distributed import launched_world

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with launched_world() as world:
        assert world == (0, 1)
        assert not dist.is_initialized()
