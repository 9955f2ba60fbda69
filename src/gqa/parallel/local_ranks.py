"""A world of ``N`` local processes in which this process is rank 0: for a server, whose rank 0 must outlive a lost
rank long enough to answer its clients (``launch_local`` runs every rank as a child and stops them all when one
fails, rank 0 included).

``start_local_ranks(N, fn, *args)`` spawns ranks ``1 .. N-1`` running ``fn(*args)`` (a module-level function), then
joins the process group as rank 0 (gloo on CPU, NCCL on CUDA, ``timeout_seconds()``) with a rendezvous on a free port
of 127.0.0.1. The ranks cannot outlive rank 0: each asks the kernel to kill it when its parent dies
(``PR_SET_PDEATHSIG``), and ignores Ctrl-C (the terminal sends it to the whole process group: rank 0 alone decides
when the others stop). ``LocalRanks.lost()`` says which rank ended, ``stop()`` waits for them, then ends them.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .distributed import init_process_group

__all__ = ["LocalRanks", "start_local_ranks"]

_PR_SET_PDEATHSIG = 1


class LocalRanks:
    """The child processes of ranks ``1 .. N-1`` (``processes[i]`` is rank ``i + 1``)."""

    def __init__(self, processes: list[multiprocessing.Process]) -> None:
        self.processes = processes

    def lost(self) -> tuple[int, int] | None:
        """``(rank, exit code)`` of the first rank that has ended, or ``None`` while all run."""
        for rank, p in enumerate(self.processes, start=1):
            if p.exitcode is not None:
                return rank, p.exitcode
        return None

    def stop(self, timeout: float = 10.0) -> None:
        """Wait ``timeout`` seconds at most for every rank to end, then terminate (and kill) those still running."""
        for p in self.processes:
            p.join(timeout)
        for p in self.processes:
            if p.is_alive():
                p.terminate()
                p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _world_env(rank: int, world: int, port: int) -> dict[str, str]:
    """What torchrun would set for ``rank`` of a one-machine world."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world)}  # fmt: skip


def _die_with_parent(parent: int) -> None:
    """Have the kernel kill this process when its parent dies (Linux; elsewhere nothing is asked)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the request was made
        os._exit(1)


def _rank_main(env: dict[str, str], parent: int, device: str, fn: Callable[..., Any], args: tuple) -> None:
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(env)
    init_process_group(device)
    try:
        fn(*args)
    finally:
        with contextlib.suppress(Exception):  # the group may be broken: rank 0 is gone
            dist.destroy_process_group()


def start_local_ranks(nprocs: int, fn: Callable[..., Any], *args: Any, device: str = "cpu") -> LocalRanks:
    """Spawn ranks ``1 .. nprocs-1`` running ``fn(*args)`` and join their process group as rank 0 (module
    docstring); the caller runs rank 0's part, then ``stop()``. A rank that never joins makes this raise once
    ``timeout_seconds()`` have passed (the others stopped)."""
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 2:
        raise ValueError(f"nprocs must be an int >= 2, got {nprocs!r}")
    port = _free_port()
    spawn = multiprocessing.get_context("spawn")
    processes = [spawn.Process(target=_rank_main, name=f"gqa-rank-{rank}", daemon=False,
                               args=(_world_env(rank, nprocs, port), os.getpid(), device, fn, args))
                 for rank in range(1, nprocs)]  # fmt: skip
    ranks = LocalRanks(processes)
    for p in processes:
        p.start()
    os.environ.update(_world_env(0, nprocs, port))
    try:
        init_process_group(torch.device(device))
    except BaseException:
        ranks.stop(0.0)
        raise
    return ranks
