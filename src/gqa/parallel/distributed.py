"""gqa across processes, on torch.distributed: the process group, and N local workers started by torchrun's engine.

Two ways in, the same workers:

* ``torchrun --nproc-per-node N -m gqa generate ...`` (or ``--nnodes``/``--node-rank`` for several machines, with
  torchrun's own rendezvous): torchrun sets ``RANK``/``WORLD_SIZE``/... and each process calls ``init_process_group``;
* ``gqa generate --tp N ...``: ``launch_local`` starts the N workers itself with ``torch.distributed.launcher`` —
  the launcher torchrun is built on — on one machine.

The backend is gloo on CPU and NCCL on CUDA. Every process group has a timeout (``GQA_DIST_TIMEOUT`` seconds,
default ``DEFAULT_TIMEOUT_S``): a rank that is missing or stuck makes the others fail with an error instead of
waiting forever, and a rank that raises makes the launcher stop the rest and report that rank's error.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "CORES_ENV",
    "DEFAULT_TIMEOUT_S",
    "DistributedError",
    "available_cores",
    "in_launched_world",
    "init_process_group",
    "launch_local",
    "launched_world",
    "shared_seed",
    "timeout_seconds",
]

DEFAULT_TIMEOUT_S = 300.0
PEER_LOSS_GRACE_S = 2.0  # a rank whose peer died waits this long before failing itself


class DistributedError(ChildProcessError):
    """A worker of a launch failed: the message names its rank and repeats its error (an ``OSError``, as the
    failure of a child process)."""


def timeout_seconds() -> float:
    """The process-group timeout: ``$GQA_DIST_TIMEOUT`` seconds, else ``DEFAULT_TIMEOUT_S``."""
    text = os.environ.get("GQA_DIST_TIMEOUT")
    if text is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise ValueError(f"GQA_DIST_TIMEOUT must be a positive number of seconds, got {text!r}")
    return value


CORES_ENV = "GQA_CPU_CORES"  # the cores this process and the ranks it starts may use (a replica's share); default: all


def available_cores() -> int:
    """The cores this process may use: ``$GQA_CPU_CORES`` (set for a replica of ``gqa serve --replicas``), else
    every core of the machine."""
    return int(os.environ.get(CORES_ENV, "0")) or os.cpu_count() or 1


def in_launched_world() -> bool:
    """Whether this process is one of several started by torchrun (or ``launch_local``)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init_process_group(device: str | torch.device = "cpu") -> tuple[int, int]:
    """Join the world torchrun described in the environment: gloo for CPU, NCCL for CUDA, ``timeout_seconds()``.

    Each process gets ``cores / local ranks`` intra-op threads (at least 1) and, on CUDA, the GPU of its local rank.
    Returns ``(rank, world_size)``; a no-op returning the same when the group exists already.
    """
    device = torch.device(device)
    if not dist.is_initialized():
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        torch.set_num_threads(max(1, available_cores() // max(local_world, 1)))
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_seconds()))
    return dist.get_rank(), dist.get_world_size()


@contextlib.contextmanager
def launched_world(device: str | torch.device = "cpu") -> Iterator[tuple[int, int]]:
    """``(rank, world_size)`` of torchrun's world (``(0, 1)`` outside one) for the ``with`` block.

    A group this block creates is destroyed when it ends, however it ends: one left to the interpreter's exit can
    abort the process there (gloo's threads, "terminate called without an active exception"). A group that existed
    before (``launch_local``'s workers make their own) is left to its owner.
    """
    if not in_launched_world():
        yield 0, 1
        return
    owned = not dist.is_initialized()
    world = init_process_group(device)
    try:
        yield world
    finally:
        if owned and dist.is_initialized():
            dist.destroy_process_group()


def shared_seed() -> int:
    """A random seed drawn by rank 0 and broadcast, so every rank samples the same tokens (a collective: all ranks
    must call it)."""
    seed = torch.randint(0, 2**62, (1,)) if dist.get_rank() == 0 else torch.zeros(1, dtype=torch.long)
    dist.broadcast(seed, src=0)
    return int(seed)


def _run_worker(fn: Callable[..., Any], device: str, args: tuple) -> Any:
    from torch.distributed.elastic.multiprocessing.errors import record

    @record  # writes this rank's exception where the launcher reads it
    def run() -> Any:
        init_process_group(device)
        try:
            return fn(*args)
        except Exception as e:
            if _peer_lost(str(e)):
                time.sleep(PEER_LOSS_GRACE_S)  # let the launcher see the rank that failed first, and report it
            raise
        finally:
            dist.destroy_process_group()

    return run()


def launch_local(nprocs: int, fn: Callable[..., Any], *args: Any, device: str = "cpu") -> dict[int, Any]:
    """Run ``fn(*args)`` in ``nprocs`` new local processes that form one process group; return ``{rank: result}``.

    ``fn`` and ``args`` must be picklable (a module-level function): the workers are spawned, as torchrun spawns
    them. If a worker raises, the launcher stops the others and this raises ``DistributedError`` with that worker's
    rank and message.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nprocs, run_id=f"gqa-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", rdzv_timeout=int(timeout_seconds()), max_restarts=0,
        monitor_interval=0.1, start_method="spawn",
    )  # fmt: skip
    quiet = logging.getLogger("torch.distributed.elastic")  # its tracebacks of a failed rank; ours is one line
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        return elastic_launch(config, _run_worker)(fn, device, args)
    except ChildFailedError as e:
        raise DistributedError(_failure_message(e, nprocs)) from None
    finally:
        quiet.setLevel(level)


def _peer_lost(message: str) -> bool:
    """Whether an error says a collective failed because another rank went away (a consequence, not a cause)."""
    return any(s in message for s in ("Connection closed by peer", "Connection reset by peer", "DistBackendError"))


def _failure_message(error: Any, nprocs: int) -> str:  # error: a ChildFailedError
    """The failure that caused the others: the earliest one that is not another rank's lost connection."""

    def text(failure: Any) -> str:
        message = failure.message
        if isinstance(message, dict):
            message = message.get("message", message)
        if not message or "To enable traceback" in str(message):
            return f"exit code {failure.exitcode}"
        return str(message).strip()

    failures = error.failures
    rank = min(failures, key=lambda r: (_peer_lost(text(failures[r])), failures[r].timestamp, r))
    return f"rank {rank} of {nprocs} failed: {text(error.failures[rank])}"
