"""``gqa serve --replicas N`` and ``torchrun --nnodes M ... -m gqa serve --replicas N``: N engines behind one HTTP
front (``serve.replica_front``), each request sent to the replica most likely to hold its prompt's prefix, else the
least loaded (``--replica-routing``).

Locally, each replica is a child process serving the same flags (``--tp T`` included: a replica of T ranks) with
``cores / N`` threads, on a port of 127.0.0.1; the front waits until all serve, then serves on ``--host`` /
``--port``. Under torchrun every process is one replica (the world size is N): rank 0 runs the front and its own
replica as a child process; rank ``r > 0`` serves its replica on the address of its machine that reaches torchrun's
``MASTER_ADDR``, and tells rank 0 where (``all_gather_object`` over gloo; the process group is then left: replicas
never meet in a collective). Rank 0 tells the others to stop through a ``TCPStore`` it hosts; a replica whose rank 0
is gone stops too.

Faults: a replica that exits, stops its engine or stops answering is marked down and routed around (``/health``
says so, ``gqa_replica_up`` is 0); when none is left the front stops and exits 1. SIGTERM / Ctrl-C on the front
stops it gracefully, then every replica (SIGTERM, a kill ``STOP_GRACE_S`` later).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from ..serve.replica_front import Replica

__all__ = ["READY_TIMEOUT_S", "serve_replicas"]

READY_TIMEOUT_S = 600.0  # for every replica to load its model and serve
STOP_GRACE_S = 30.0
_STOP_KEY = "gqa/replicas/stop"


def serve_replicas(ns: argparse.Namespace, replicas: int, serve: Callable[[argparse.Namespace], int],
                   http: Callable, app_of: Callable) -> int:  # fmt: skip
    """Serve ``replicas`` replicas of ``serve(ns)`` (``cli.serve.serve_replica``, a module-level function) behind one
    front served by ``http`` (``cli.serve.serve_http``); ``app_of(ns)`` (``cli.serve.serving_app``) is a torchrun
    rank's own replica's app. This process's exit code."""
    from ..parallel.distributed import in_launched_world

    check_replica_flags(ns, replicas)
    if in_launched_world():
        return _torchrun(ns, replicas, serve, http, app_of)
    from ..serve.replica_processes import start_local_replicas, stop_replicas

    local = []
    try:
        local = start_local_replicas([replica_namespace(ns, i, replicas) for i in range(replicas)], serve)
        _wait_ready([r.url for r in local], [r.exit_code for r in local])
    except RuntimeError as e:
        print(f"gqa serve: {e}", file=sys.stderr)
        stop_replicas(local, 0.0)
        return 1
    try:
        return _front(ns, [Replica(r.url, r.exit_code, r.process.pid) for r in local], http)
    finally:
        stop_replicas(local, STOP_GRACE_S)


def check_replica_flags(ns: argparse.Namespace, replicas: int) -> None:
    """``ValueError`` naming the flag for what replicas cannot do."""
    if replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {replicas}")
    if ns.replica_balance < 0:
        raise ValueError(f"--replica-balance must be >= 0, got {ns.replica_balance}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and world != replicas:
        raise ValueError(f"--replicas {replicas} under torchrun needs a world of {replicas} processes, one per "
                         f"replica (this one has {world}); tensor-parallel replicas run with --replicas N --tp T "
                         "on one machine")  # fmt: skip
    if world > 1 and ns.tp not in (None, 1):
        raise ValueError("--tp with --replicas under torchrun is not supported: each torchrun process is one replica")


def replica_namespace(ns: argparse.Namespace, index: int, replicas: int) -> argparse.Namespace:
    """Replica ``index``'s flags: the front's, as one replica, with ``--prefix-cache-dir``'s folder and budget split
    (``DIR/replica-i``, ``1/N`` of the GiB: two processes never evict each other's files)."""
    own = vars(ns) | {"replicas": 1}
    if ns.prefix_cache_dir is not None:
        own |= {"prefix_cache_dir": Path(ns.prefix_cache_dir) / f"replica-{index}",
                "prefix_cache_gib": ns.prefix_cache_gib / replicas}  # fmt: skip
    return argparse.Namespace(**{k: v for k, v in own.items() if k != "run"})


def _front(ns: argparse.Namespace, replicas: list[Replica], http: Callable) -> int:
    """The front over ``replicas`` on ``--host`` / ``--port`` until a stop or until every replica is down (then
    1)."""
    from ..serve.replica_front import ReplicaFront
    from ..serve.replica_routing import ReplicaRouter

    router = ReplicaRouter(len(replicas), ns.replica_routing, balance_slack=ns.replica_balance)
    server_box: list = []
    all_down = threading.Event()

    def stop_all() -> None:
        all_down.set()
        if server_box:
            server_box[0].should_exit = True

    front = ReplicaFront(replicas, router,
                         max_body_bytes=int(ns.max_body_mib * 2**20), on_all_down=stop_all)  # fmt: skip
    print(f"gqa serve: {len(replicas)} replicas ({', '.join(r.url for r in replicas)}) behind one front, "
          f"{ns.replica_routing} routing", file=sys.stderr)  # fmt: skip
    code = http(ns, front, server_box.append)
    return 1 if all_down.is_set() else code


def _wait_ready(urls: list[str], exit_codes: list[Callable], timeout: float = READY_TIMEOUT_S) -> None:
    """Until every replica's ``/health`` answers 200; ``RuntimeError`` naming one that exits or takes too long."""
    deadline = time.monotonic() + timeout
    waiting = dict(enumerate(urls))
    while waiting:
        for index, url in list(waiting.items()):
            code = exit_codes[index]()
            if code is not None:
                raise RuntimeError(f"replica {index} exited with code {code} before serving")
            with contextlib.suppress(OSError), urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    del waiting[index]
        if waiting and time.monotonic() > deadline:
            raise RuntimeError(f"replica(s) {sorted(waiting)} did not serve within {timeout:g} s")
        if waiting:
            time.sleep(0.2)


# -- under torchrun --------------------------------------------------------------------------------------------------


def _torchrun(ns: argparse.Namespace, replicas: int, serve: Callable, http: Callable, app_of: Callable) -> int:
    import torch.distributed as dist

    from ..parallel.distributed import init_process_group
    from ..serve.replica_processes import bind_listener, start_local_replicas, stop_replicas

    rank, _ = init_process_group("cpu")
    local, store, listener = [], None, None
    try:
        if rank == 0:
            local = start_local_replicas([replica_namespace(ns, 0, replicas)], serve)
            store = _store_host()
            mine = (local[0].url, store.port)
        else:
            listener = bind_listener(_route_address(os.environ["MASTER_ADDR"]))
            host, port = listener.getsockname()[:2]
            mine = (f"http://{host if ':' not in host else f'[{host}]'}:{port}", None)
        everyone: list = [None] * replicas
        dist.all_gather_object(everyone, mine)  # a rank that never joins: an error after GQA_DIST_TIMEOUT
    except RuntimeError as e:  # torch.distributed's errors are RuntimeErrors
        print(f"gqa serve: replica {rank}: the replicas did not all start: {e}", file=sys.stderr)
        stop_replicas(local, 0.0)
        return 1
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    if rank > 0:
        return _remote_replica(ns, rank, replicas, listener, everyone[0][1], http, app_of)
    try:
        codes = [local[0].exit_code] + [lambda: None] * (replicas - 1)
        urls = [url for url, _ in everyone]
        try:
            _wait_ready(urls, codes)
        except RuntimeError as e:
            print(f"gqa serve: {e}", file=sys.stderr)
            return 1
        return _front(ns, [Replica(url, code) for url, code in zip(urls, codes, strict=True)], http)
    finally:
        store.set(_STOP_KEY, "1")
        stop_replicas(local, STOP_GRACE_S)
        time.sleep(1.0)  # the other ranks read the stop before the store goes


def _remote_replica(ns: argparse.Namespace, rank: int, replicas: int, listener: socket.socket, store_port: int,
                    http: Callable, app_of: Callable) -> int:  # fmt: skip
    """Rank ``r > 0`` under torchrun: its replica served on ``listener`` until rank 0 says stop or is gone."""
    import torch.distributed as dist

    from ..serve.replica_processes import leave_world

    master = os.environ["MASTER_ADDR"]
    leave_world()  # this process is a world of its own from here
    store = dist.TCPStore(master, store_port, is_master=False, timeout=timedelta(seconds=60))
    own = replica_namespace(ns, rank, replicas)
    own.listen_fd = listener.fileno()

    def watch(server) -> None:
        def loop() -> None:
            while not server.should_exit:
                try:
                    if store.check([_STOP_KEY]):
                        break
                except Exception:  # rank 0 is gone
                    print(f"gqa serve: replica {rank}: the front (rank 0) is gone: stopping", file=sys.stderr)
                    break
                time.sleep(0.5)
            server.should_exit = True

        threading.Thread(target=loop, name="gqa-replica-watch", daemon=True).start()

    return http(own, app_of(own), watch)


def _store_host():
    import torch.distributed as dist

    return dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)


def _route_address(master: str) -> str:
    """This machine's address on the route to ``master`` (what rank 0 can reach it by): 127.0.0.1 on one machine."""
    family = socket.AF_INET6 if ":" in master else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((master, 9))  # no packet is sent: the kernel picks the route
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"
