"""Local replicas of ``gqa serve``: each a child process serving the same flags on a port of 127.0.0.1 that it
binds itself (no port race) and reports back, with ``cores / replicas`` threads (its tensor-parallel ranks share
them). A replica cannot outlive the process that started it (``PR_SET_PDEATHSIG``) and ignores Ctrl-C (the front
decides when replicas stop: SIGTERM, then a kill after a grace period).

    replicas = start_local_replicas([ns0, ns1], serve)   # serve(ns): the CLI's gqa serve, run in each child
    replicas[0].url, replicas[0].exit_code()          # "http://127.0.0.1:41234", None while it runs
    stop_replicas(replicas, grace=30)
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass

from ..parallel.distributed import CORES_ENV, available_cores
from ..parallel.local_ranks import die_with_parent

__all__ = ["LocalReplica", "bind_listener", "leave_world", "start_local_replicas", "stop_replicas"]

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
                 "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")  # fmt: skip
START_TIMEOUT_S = 60.0  # to bind a port (before any model is loaded)


@dataclass
class LocalReplica:
    """A replica's child process and the URL it serves on."""

    index: int
    url: str
    process: multiprocessing.Process

    def exit_code(self) -> int | None:
        return self.process.exitcode


def bind_listener(host: str) -> socket.socket:
    """A listening TCP socket on a free port of ``host``, for uvicorn to serve on (``serve_http``'s ``listen_fd``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def leave_world() -> None:
    """Forget the torchrun world this process was started in (its environment): from here it is a world of one."""
    for name in _TORCHRUN_ENV:
        os.environ.pop(name, None)


def start_local_replicas(
    namespaces: list[argparse.Namespace], serve: Callable[[argparse.Namespace], int]
) -> list[LocalReplica]:
    """A child process per namespace, replica ``i`` running ``serve(namespaces[i])`` (a module-level function) on a
    port of 127.0.0.1 it binds and reports, with ``1 / len(namespaces)`` of the cores; ``RuntimeError`` if one
    cannot start (the others stopped)."""
    threads = max(1, available_cores() // len(namespaces))
    spawn = multiprocessing.get_context("spawn")
    replicas: list[LocalReplica] = []
    try:
        for index, ns in enumerate(namespaces):
            ours, theirs = spawn.Pipe(duplex=False)
            process = spawn.Process(target=_replica_main, name=f"gqa-replica-{index}", daemon=False,
                                    args=(ns, serve, theirs, os.getpid(), threads))  # fmt: skip
            process.start()
            theirs.close()
            if not ours.poll(START_TIMEOUT_S):
                process.kill()
                raise RuntimeError(f"replica {index} did not start in {START_TIMEOUT_S:g} s")
            try:
                port = ours.recv()
            except EOFError:
                process.join(5.0)
                raise RuntimeError(f"replica {index} exited with code {process.exitcode} before serving") from None
            replicas.append(LocalReplica(index, f"http://127.0.0.1:{port}", process))
    except BaseException:
        stop_replicas(replicas, 0.0)
        raise
    return replicas


def stop_replicas(replicas: list[LocalReplica], grace: float = 30.0) -> None:
    """SIGTERM to every replica (a graceful stop), ``grace`` seconds for them to end, then a kill."""
    for replica in replicas:
        if replica.process.exitcode is None and replica.process.pid is not None:
            os.kill(replica.process.pid, signal.SIGTERM)
    for replica in replicas:
        replica.process.join(grace)
    for replica in replicas:
        if replica.process.is_alive():
            replica.process.kill()
            replica.process.join(5.0)


def _replica_main(ns: argparse.Namespace, serve: Callable, conn, parent: int, threads: int) -> None:
    die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    leave_world()
    os.environ[CORES_ENV] = str(threads)
    import torch

    torch.set_num_threads(threads)
    sock = bind_listener("127.0.0.1")
    conn.send(sock.getsockname()[1])
    conn.close()
    ns = argparse.Namespace(**{**vars(ns), "listen_fd": sock.fileno(), "host": "127.0.0.1"})
    raise SystemExit(serve(ns))
