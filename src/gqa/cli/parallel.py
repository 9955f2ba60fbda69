"""``--tp N``: a command on N tensor-parallel processes, started by gqa itself or by torchrun.

``gqa generate --tp N ...`` starts N local workers (``gqa.parallel.distributed.launch_local``); under
``torchrun --nproc-per-node N -m gqa generate ...`` every process torchrun started runs the command as one rank of
torchrun's world. Either way the head layout is checked against ``--tp`` before any process or process group is
started, each rank loads only its shard (``load_model(..., tensor_parallel=True)``), and only rank 0 prints.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import torch.distributed as dist

from ..options.common import add_tp_argument  # defined there, without torch (gqa generate --help)
from ..parallel.distributed import in_launched_world, launch_local, launched_world

__all__ = ["add_tp_argument", "is_lead", "run_on_ranks", "tp_size"]


def is_lead() -> bool:
    """Whether this process prints: the only one, or rank 0 of a tensor-parallel run."""
    return not dist.is_initialized() or dist.get_rank() == 0


def tp_size(ns: argparse.Namespace) -> int:
    """The number of tensor-parallel ranks: torchrun's world size when launched by it (``--tp``, if given, must
    agree), else ``--tp`` (default 1)."""
    if in_launched_world():
        world = int(os.environ["WORLD_SIZE"])
        if ns.tp is not None and ns.tp != world:
            raise ValueError(f"--tp {ns.tp} differs from torchrun's world size {world}; leave --tp out under torchrun")
        return world
    tp = 1 if ns.tp is None else ns.tp
    if tp < 1:
        raise ValueError(f"--tp must be >= 1, got {tp}")
    return tp


def run_on_ranks(ns: argparse.Namespace, command: Callable[[argparse.Namespace], int]) -> int:
    """``command(ns)`` in this process (tp 1), on every rank of torchrun's world, or on ``--tp`` local workers.

    ``command`` is a module-level function (the workers are spawned) and sees ``ns.sharded`` True on the ranks.
    """
    from ..loaders import read_config
    from ..parallel.tensor_parallel import check_tp

    tp = tp_size(ns)
    if tp == 1:
        return command(ns)
    cfg = read_config(ns.model)
    check_tp(cfg.num_heads, cfg.num_kv_heads, tp)  # before any process group work
    sharded = argparse.Namespace(**{k: v for k, v in vars(ns).items() if k != "run"}, sharded=True)  # spawnable
    if in_launched_world():
        with launched_world():
            return command(sharded)
    return max(launch_local(tp, command, sharded).values())
