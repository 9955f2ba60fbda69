"""``gqa serve --tp N`` and ``torchrun ... -m gqa serve``: one server over N tensor-parallel ranks.

Rank 0 serves HTTP and runs the engine (``serve.tp_runner.ShardedRunner``); the other ranks load their shard and
run the steps rank 0 sends them (``serve.tp_runner.serve_shard``). ``--tp N`` makes this process rank 0 and spawns
the others (``parallel.local_ranks``); under torchrun each process is the rank torchrun made it.

Stopping: SIGTERM / Ctrl-C on rank 0 stops the server gracefully, then tells the other ranks to stop. A rank that
ends (or a step that fails: a rank dead, hung past ``GQA_DIST_TIMEOUT``, or raising) ends the engine: the requests
waiting get 503 in OpenAI's error shape, the server stops and exits 1; whatever still runs ``LOSS_GRACE_S`` seconds
after the loss is killed, so the exit is bounded and no rank outlives rank 0.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from ..options.common import kv_dtype_choice
from ..parallel.distributed import in_launched_world, init_process_group
from ..parallel.local_ranks import LocalRanks, start_local_ranks
from ..serve.config import EngineConfig

__all__ = ["LOSS_GRACE_S", "serve_tp"]

LOSS_GRACE_S = 15.0  # after a rank is lost, the server has this long to answer its clients and stop; then it is killed
WATCH_INTERVAL_S = 0.2


def serve_tp(settings, models: list, tp: int, config: EngineConfig, load: Callable, http: Callable) -> int:
    """Serve ``models``' one model over ``tp`` ranks with ``settings`` (``cli.serve``'s: the flags read) and the
    engine ``config``; ``load`` and ``http`` are ``cli.serve``'s ``load_served`` and ``serve_http``. This process's
    exit code (rank 0: 0 after a graceful stop, 1 after a lost rank). ``ValueError`` naming the flag for what cannot be
    served so, before any rank starts."""
    from ..loaders import read_config
    from ..parallel.tensor_parallel import check_tp

    ns = settings.ns
    if len(models) != 1:
        raise ValueError(f"--tp serves one model, got {len(models)} (--model / --models-dir)")
    if settings.device.type != "cpu":
        raise ValueError(f"--tp serves on CPU (gloo), not --device {ns.device}")
    if ns.prefix_cache_dir is not None:  # its blocks would hold rank 0's KV heads alone
        raise ValueError("--prefix-cache-dir does not work with --tp yet")
    path = models[0][1]
    cfg = read_config(path)
    check_tp(cfg.num_heads, cfg.num_kv_heads, tp)  # before any process or process group
    spawnable = {k: v for k, v in vars(ns).items() if k != "run"}
    rank_ns = argparse.Namespace(**spawnable, sharded=True, path=path, engine_config=config)
    ranks, code = None, 1
    if in_launched_world():
        init_process_group("cpu")
    else:
        ranks = start_local_ranks(tp, serve_rank, rank_ns)
    try:
        if dist.get_rank() > 0:
            serve_rank(rank_ns)
            return 0
        code = _lead(dataclasses.replace(settings, ns=rank_ns), models[0][0], ranks, load, http)
        return code
    finally:
        if ranks is not None:
            ranks.stop(10.0 if code == 0 else 0.0)  # after a graceful stop the ranks end on their own
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def serve_rank(ns: argparse.Namespace) -> None:
    """A rank > 0: load this rank's shard as rank 0 loads its, then run the steps rank 0 sends until it says stop
    (``serve_shard``)."""
    from ..loaders.model import load_model
    from ..options.dtypes import DTYPES
    from ..serve.tp_runner import RanksLost, serve_shard

    model = load_model(ns.path, dtype="auto" if ns.dtype == "auto" else DTYPES[ns.dtype], tokenizer=False,
                       kv_dtype=kv_dtype_choice(ns), tensor_parallel=True)  # fmt: skip
    try:
        serve_shard(model, ns.engine_config)
    except RuntimeError as e:  # rank 0 went away (or a step failed): nothing more to do here
        raise RanksLost(f"gqa serve: rank {dist.get_rank()}: {type(e).__name__}: {e}") from e


def _lead(settings, name: str, ranks: LocalRanks | None, load: Callable, http: Callable) -> int:
    """Rank 0: the engine over the ranks behind the HTTP front, until SIGTERM / Ctrl-C or a lost rank."""
    loaded = load(settings, settings.ns.path, name)
    served, runner = loaded.engine, loaded.engine.engine.runner
    shard = runner.shard.model.shard
    print(f"gqa serve: tensor parallel over {shard.tp} ranks; rank 0 holds {len(shard.q_heads)} query / "
          f"{len(shard.kv_heads)} KV heads", file=sys.stderr)  # fmt: skip
    lost: list[str] = []

    def watch(server) -> None:
        def loop() -> None:
            while not server.should_exit:
                time.sleep(WATCH_INTERVAL_S)
                if server.should_exit:  # a stop asked for (SIGTERM, Ctrl-C): not a loss
                    break
                gone = ranks.lost() if ranks is not None else None
                if gone is not None:
                    lost.append(f"rank {gone[0]} exited with code {gone[1]}")
                elif server.started and not served.alive:
                    lost.append(runner.lost or "the engine stopped")
                if lost:
                    print(f"gqa serve: {lost[0]}: stopping (exit 1)", file=sys.stderr)
                    server.should_exit = True
                    break
            if lost:  # bounded: whatever still runs after the grace period is killed
                time.sleep(LOSS_GRACE_S)
                if ranks is not None:
                    ranks.stop(0.0)
                os._exit(1)

        threading.Thread(target=loop, name="gqa-tp-watch", daemon=True).start()

    code = http(settings.ns, loaded.app, watch)
    served.stop()
    print(f"gqa serve: rank 0 ran {runner.shard.summary()}", file=sys.stderr)
    if not lost and not served._thread.is_alive():  # (a thread stuck in a step must not meet a second collective)
        # the other ranks stop; a RuntimeError: they have already (a SIGTERM to the whole process group: systemd,
        # timeout, kill -PGID)
        with contextlib.suppress(RuntimeError):
            runner.close()
    return 1 if lost else code
