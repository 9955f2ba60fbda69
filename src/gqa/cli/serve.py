"""``gqa serve``: a model behind an OpenAI-compatible HTTP API (the server: ``gqa.serve``)."""

from __future__ import annotations

import argparse
import itertools
import math
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from ..options.common import (
    EMBEDDED_MODEL,
    add_kv_dtype_arguments,
    add_model_arguments,
    add_tp_argument,
    kv_dtype_choice,
    kv_flag_errors,
    loading,
    model_label,
    torch_device,
)
from ..serve.replica_routing import BALANCE_SLACK

HELP = "serve a model over an OpenAI-compatible HTTP API (continuous batching, paged KV cache)"
DESCRIPTION = HELP

EMBEDDED_NAME = "SmolLM2-135M-Instruct"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``gqa serve`` on ``parser``."""
    add_model_arguments(
        parser,
        "weight dtype; auto: bf16 where the CPU multiplies bf16 natively, else fp32, and a GGUF's q8_0/q4_*/q5_* "
        "weights stay quantized",
        auto=True,
        model_help="GGUF file or HF directory; repeat it to serve several models, each loaded on its first request "
        "(a request's 'model' picks one; default: embedded SmolLM2-135M)",
    )
    add_kv_dtype_arguments(parser)
    add_tp_argument(parser)  # gqa serve --tp N: cli.serve_tp
    parser.add_argument(
        "--replicas", type=int, default=1, metavar="N",
        help="N engines (local processes, each with cores/N threads and --tp ranks; under torchrun one per process) "
        "behind one HTTP front that sends a request to the replica most likely to hold its prompt's prefix, else "
        "the least loaded (default: 1)",
    )  # fmt: skip
    parser.add_argument(
        "--replica-routing", default="prefix", choices=("prefix", "least-loaded", "round-robin"),
        help="how --replicas' front picks a replica (default: prefix, then least loaded)",
    )  # fmt: skip
    parser.add_argument(
        "--replica-balance", type=int, default=BALANCE_SLACK, metavar="N",
        help="prefix routing keeps sending a prefix's requests to the replica holding it until that replica has more "
        f"than twice the least loaded one's requests and N more (default: {BALANCE_SLACK}; SGLang's router calls "
        "this its balance thresholds): lower spreads load sooner, higher keeps more prefix-cache hits",
    )  # fmt: skip
    parser.add_argument(
        "--device", default="cpu", metavar="DEV",
        help="cpu (the native kernels) or cuda / cuda:N (the paged Triton kernel, KV pool in device memory; auto "
        "dtype is bf16 there, quantized weights are dequantized)",
    )  # fmt: skip
    parser.add_argument(
        "--enforce-eager", action="store_true",
        help="on CUDA, run every step eagerly (default: steps of decode rows alone replay CUDA graphs captured at "
        "start-up, one per batch size 1, 2, 4, 8, 16, 24, ... up to --max-running; vLLM's flag)",
    )  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 exposes it to the network)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (0: any free one, printed at start)")
    parser.add_argument(
        "--kv-cache-mib", type=float, default=None, metavar="N",
        help="KV cache pool size in MiB (default: --max-running full contexts, but on CPU at most the weights' size "
        "or one full context if that is more, and at most a quarter of the available memory, on CUDA half the free "
        "device memory; printed at start); fewer KV heads fit more sequences in it",
    )  # fmt: skip
    parser.add_argument("--block-size", type=int, default=16, metavar="N", help="token slots per KV cache block")
    parser.add_argument("--max-running", type=int, default=64, metavar="N", help="requests decoded together at most")
    parser.add_argument(
        "--max-queue", type=int, default=256, metavar="N",
        help="requests accepted beyond --max-running before the server answers 429 (retry later)",
    )  # fmt: skip
    parser.add_argument(
        "--prefill-chunk", type=int, default=64, metavar="N",
        help="prompt tokens per step while others decode (4x while none does; a long prompt delays streams a chunk)",
    )  # fmt: skip
    parser.add_argument(
        "--speculate", type=int, default=0, metavar="K",
        help="verify up to K draft tokens per step for greedy requests, looked up in their own prompt and output "
        "(exactly greedy's output; pays off where answers copy their context; 0: off)",
    )  # fmt: skip
    parser.add_argument(
        "--prefix-cache-dir", type=Path, default=None, metavar="DIR",
        help="keep prompts' full KV blocks in DIR (a file per block, keyed by the model's weights, dtypes, KV cache "
        "type and block size), so a prompt prefix seen before — also before a restart — is read, not prefilled "
        "(default: off)",
    )  # fmt: skip
    parser.add_argument(
        "--prefix-cache-gib", type=float, default=4.0, metavar="N",
        help="at most N GiB of files in --prefix-cache-dir per served model, the least recently used deleted first",
    )  # fmt: skip
    parser.add_argument(
        "--api-key", default=None,
        help="require 'Authorization: Bearer KEY'; also read from $GQA_API_KEY, which keeps it out of ps "
        "(default: open)",
    )  # fmt: skip
    parser.add_argument("--max-body-mib", type=float, default=16.0, metavar="N",
                        help="the largest request body accepted, in MiB (a larger one gets 413)")  # fmt: skip
    parser.add_argument("--header-timeout", type=float, default=15.0, metavar="SECONDS",
                        help="close a connection whose request headers take longer (slowloris)")  # fmt: skip
    parser.add_argument("--chat-template", type=Path, default=None, metavar="FILE",
                        help="render chats with this jinja template instead of the model's")  # fmt: skip
    parser.add_argument(
        "--served-model-name", action="append", default=None, metavar="NAME",
        help="the model's name in the API (default: --model's file or folder name); with several --model, one per "
        "--model, in their order",
    )  # fmt: skip
    parser.add_argument(
        "--models-dir", type=Path, default=None, metavar="DIR",
        help="serve every *.gguf file and every HF folder (with config.json) in DIR as well, named by the file's "
        "name without .gguf or the folder's name (without --model: these alone)",
    )  # fmt: skip
    parser.add_argument(
        "--max-loaded", type=int, default=None, metavar="N",
        help="with several models: at most N loaded at once; a request for another unloads the least recently used "
        "(default: no bound)",
    )  # fmt: skip
    parser.add_argument(
        "--max-loaded-gib", type=float, default=None, metavar="GIB",
        help="with several models: the loaded models' weights and KV pools take at most GIB together; the least "
        "recently used are unloaded to make room (a larger model is served alone; default: no bound)",
    )  # fmt: skip


def api_key_of(ns: argparse.Namespace) -> str | None:
    """``--api-key``, else ``$GQA_API_KEY``, else None (open); an empty key is refused."""
    key = ns.api_key if ns.api_key is not None else os.environ.get("GQA_API_KEY")
    if key is not None and not key.strip():
        raise ValueError("--api-key (or $GQA_API_KEY) must not be empty")
    return key


def served_models(ns: argparse.Namespace) -> list[tuple[str, str | None]]:
    """``(name in the API, path)`` of every model to serve (``None``: the embedded one): ``--model``'s (or the
    embedded model when neither ``--model`` nor ``--models-dir`` is given), then ``--models-dir``'s. ``ValueError``
    naming the flag for a path that is no model, a name given twice, a ``--served-model-name`` count that does not
    match."""
    from ..loaders import resolve_model_path

    paths = ns.model or ([] if ns.models_dir is not None else [None])
    names = ns.served_model_name or []
    if names and len(names) != len(paths):
        raise ValueError(f"--served-model-name: given {len(names)} time(s) for {len(paths)} --model")
    models = [(names[i] if names else EMBEDDED_NAME if p is None else Path(p).name, p) for i, p in enumerate(paths)]
    if ns.models_dir is not None:
        if not ns.models_dir.is_dir():
            raise ValueError(f"--models-dir {ns.models_dir}: no such folder")
        found = sorted(p for p in ns.models_dir.iterdir() if (p.is_file() and p.suffix.lower() == ".gguf")
                       or (p.is_dir() and (p / "config.json").is_file()))  # fmt: skip
        if not found:
            raise ValueError(f"--models-dir {ns.models_dir}: holds no .gguf file and no HF folder (with config.json)")
        models += [(p.stem if p.is_file() else p.name, str(p)) for p in found]
    if len(models) > 1:  # checked now: each loads only on its first request
        for _, path in models:
            if path is not None:
                try:
                    resolve_model_path(path)
                except ValueError as e:
                    raise ValueError(f"--model {e}") from None
    seen: dict[str, str | None] = {}
    for name, path in models:
        if name in seen:
            raise ValueError(f"two models are named {name!r} ({model_label(seen[name])} and {model_label(path)}): "
                             "--served-model-name names each --model")  # fmt: skip
        seen[name] = path
    return models


def run(parser: argparse.ArgumentParser | None, ns: argparse.Namespace) -> int:
    from .parallel import tp_size

    if ns.replicas != 1:
        from .serve_replicas import serve_replicas

        serving_settings(ns)  # every flag checked here, before a replica starts
        return serve_replicas(ns, ns.replicas, serve_replica, serve_http, serving_app)
    if tp_size(ns) > 1:  # --tp N, or under torchrun: serve_tp starts (or joins) the ranks
        from .serve_tp import serve_tp

        return serve_tp(*serving_settings(ns), tp_size(ns), engine_config(ns), load_served, serve_http)
    return serve_http(ns, serving_app(ns))


def serve_replica(ns: argparse.Namespace) -> int:
    """One replica of ``gqa serve --replicas`` (in a child process): ``gqa serve`` with its flags."""
    return run(None, ns)


def serve_http(ns: argparse.Namespace, app, watch=None) -> int:
    """Serve ``app`` on ``--host``/``--port`` (or on the listening socket ``ns.listen_fd``, a replica's) until
    SIGTERM / Ctrl-C; 0 after a graceful stop, 1 if it never started. ``watch(server)``, when given, is called with
    the ``uvicorn.Server`` before it runs."""
    import socket

    import uvicorn

    from ..serve.http_protocol import with_header_timeout

    protocol = with_header_timeout(ns.header_timeout)
    config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level="info", access_log=False,
                            timeout_graceful_shutdown=30, http=protocol)  # fmt: skip
    server = uvicorn.Server(config)
    # uvicorn shuts down gracefully on SIGTERM / SIGINT and then raises the signal again to the handler it found:
    # one that does nothing makes a graceful stop exit 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda number, frame: None)
    if watch is not None:
        watch(server)
    fd = getattr(ns, "listen_fd", None)
    server.run(sockets=None if fd is None else [socket.socket(fileno=fd)])
    return 0 if server.started else 1


def serving_app(ns: argparse.Namespace):
    """The ASGI app ``gqa serve`` serves, the flags checked (``ValueError`` naming one): one model's app
    (``server.build_app``), loaded now; or, for several, the router (``model_router``) that loads each on its first
    request."""
    settings, models = serving_settings(ns)
    if len(models) == 1:  # loaded now and served directly: no router in the way
        return load_served(settings, models[0][1], models[0][0]).app
    return model_router(settings, models)


def serving_settings(ns: argparse.Namespace) -> tuple[Settings, list[tuple[str, str | None]]]:
    """The flags read and checked (``ValueError`` naming one), and the models to serve (``served_models``)."""
    from ..cache.kv import kv_kinds
    from ..hardware import auto_dtype
    from ..options.dtypes import DTYPES
    from ..serve.config import MAX_DRAFT
    from ..serve.prefix_store import writable_directory

    for flag, value, low in (("--port", ns.port, 0), ("--block-size", ns.block_size, 1),
                             ("--max-running", ns.max_running, 1), ("--max-queue", ns.max_queue, 0),
                             ("--prefill-chunk", ns.prefill_chunk, 1)):  # fmt: skip
        if value < low or (flag == "--port" and value > 65535):
            raise ValueError(f"{flag} must be {'in [0, 65535]' if flag == '--port' else f'>= {low}'}, got {value}")
    if ns.kv_cache_mib is not None and not (math.isfinite(ns.kv_cache_mib) and ns.kv_cache_mib > 0):
        raise ValueError(f"--kv-cache-mib must be a positive number of MiB, got {ns.kv_cache_mib}")
    if not 0 <= ns.speculate <= MAX_DRAFT:
        raise ValueError(f"--speculate must be in [0, {MAX_DRAFT}], got {ns.speculate}")
    if not (math.isfinite(ns.prefix_cache_gib) and ns.prefix_cache_gib > 0):
        raise ValueError(f"--prefix-cache-gib must be > 0, got {ns.prefix_cache_gib}")
    if ns.prefix_cache_dir is not None:
        writable_directory(ns.prefix_cache_dir, "--prefix-cache-dir")  # before the model is loaded
    if not (math.isfinite(ns.max_body_mib) and ns.max_body_mib > 0):
        raise ValueError(f"--max-body-mib must be a positive number of MiB, got {ns.max_body_mib}")
    if ns.max_loaded is not None and ns.max_loaded < 1:
        raise ValueError(f"--max-loaded must be >= 1, got {ns.max_loaded}")
    if ns.max_loaded_gib is not None and not (math.isfinite(ns.max_loaded_gib) and ns.max_loaded_gib > 0):
        raise ValueError(f"--max-loaded-gib must be a positive number of GiB, got {ns.max_loaded_gib}")
    models = served_models(ns)
    api_key = api_key_of(ns)
    template = None
    if ns.chat_template is not None:
        try:
            template = ns.chat_template.read_text()
        except (OSError, UnicodeError) as e:
            raise ValueError(f"--chat-template {ns.chat_template}: cannot read it ({e})") from None
        if not template.strip():
            raise ValueError(f"--chat-template {ns.chat_template}: the file is empty")
    device = torch_device(ns.device)
    if device.type == "cuda":  # the Triton runner takes float weights: auto is bf16, quantized ones are dequantized
        dtype = DTYPES["bf16"] if ns.dtype == "auto" else DTYPES[ns.dtype]
    else:
        dtype = auto_dtype() if ns.dtype == "auto" else DTYPES[ns.dtype]
    with kv_flag_errors(ns):  # here, not at a model's first request (several models load on demand)
        kv_kinds(kv_dtype_choice(ns), dtype, "kv_dtype", device)
    if getattr(ns, "listen_fd", None) is None and os.environ.get("RANK", "0") == "0":  # (a replica is handed its
        check_listen(ns.host, ns.port)  # socket; under torchrun only rank 0 listens)
    return Settings(ns, device, dtype, template, api_key), models


def check_listen(host: str, port: int) -> None:
    """``ValueError`` naming the flag unless ``--host`` resolves and ``--port`` is free on it — before the model is
    loaded (uvicorn would find out after, and exit 3 with its own log line)."""
    import errno
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn picks it
    try:
        socket.getaddrinfo(host, port, family=family, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"--host {host}: cannot resolve it ({e})") from None
    if port == 0:
        return
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a closed port's TIME_WAIT
        try:
            probe.bind((host, port))
        except OSError as e:
            flag = f"--port {port}" if e.errno == errno.EADDRINUSE else f"--host {host}"  # (in use / not here)
            raise ValueError(f"{flag}: cannot listen on {host}:{port} ({e.strerror})") from None


@dataclass(frozen=True)
class Settings:
    """What every served model is loaded with: the flags, read and checked."""

    ns: argparse.Namespace
    device: object  # torch.device
    dtype: object  # torch.dtype
    template: str | None
    api_key: str | None


def load_served(settings: Settings, path: str | None, name: str):
    """Load the model at ``path`` (``None``: the embedded one) and build its app, served as ``name``: a
    ``model_router.Loaded`` (the app's lifespan starts its engine thread)."""
    from ..loaders.model import load_model
    from ..serve.async_engine import AsyncEngine
    from ..serve.engine import Engine, EngineError
    from ..serve.model_router import Loaded
    from ..serve.runner import full_context_bytes
    from ..serve.server import build_app
    from ..serve.tp_runner import ShardedRunner

    ns, device, dtype, template = settings.ns, settings.device, settings.dtype, settings.template
    sharded = getattr(ns, "sharded", False)  # rank 0 of a tensor-parallel server (serve_tp)
    with kv_flag_errors(ns), loading(f"{model_label(path)} as {ns.dtype} on {device}"):
        model = load_model(path, dtype="auto" if ns.dtype == "auto" and device.type == "cpu" else dtype,
                           device=device, kv_dtype=kv_dtype_choice(ns), tensor_parallel=sharded)  # fmt: skip
    if template is not None:
        if model.tokenizer is None:
            raise ValueError("--chat-template: this model has no tokenizer")
        try:
            model.tokenizer.use_chat_template(template)
        except ValueError as e:
            raise ValueError(f"--chat-template {ns.chat_template}: {e}") from None
    try:
        config = engine_config(ns)
        engine = Engine(model, model.tokenizer, config, runner=ShardedRunner if sharded else None)
    except EngineError as e:
        raise ValueError(f"this model cannot be served: {e}") from e
    cfg, blocks = model.config, engine.blocks
    slots = blocks.num_blocks * blocks.block_size
    print(
        f"gqa serve: {name} ({model_label(path) if path else EMBEDDED_MODEL}), {cfg.num_heads} query / "
        f"{cfg.num_kv_heads} KV heads stored as {'/'.join(dict.fromkeys(k.name for k in engine.cache.kinds))}; "
        f"KV cache {slots} tokens = {engine.cache.nbytes / 2**30:.2f} GiB "
        f"({blocks.num_blocks} blocks of {blocks.block_size}, {slots / cfg.max_position_embeddings:.1f} "
        f"{cfg.max_position_embeddings}-token contexts; {engine.runner.pool_size.reason})",
        file=sys.stderr,
    )
    graphs = getattr(engine.runner, "graphs", None)
    if graphs is not None:
        print(f"gqa serve: CUDA graphs for decode batches of {', '.join(map(str, graphs.buckets))} rows, captured in "
              f"{engine.runner.graph_seconds:.1f} s (--enforce-eager: none)", file=sys.stderr)  # fmt: skip
    if engine.disk is not None:
        print(f"gqa serve: prefix cache on disk: {engine.disk.store}", file=sys.stderr)
    if slots < cfg.max_position_embeddings:  # say it once, at start, not as a refusal per request
        full = full_context_bytes(model, config) / 2**20
        print(f"gqa serve: note: the KV cache holds {slots} tokens, fewer than the model's context of "
              f"{cfg.max_position_embeddings}: a request's prompt and max_tokens together can use at most {slots} "
              f"(--kv-cache-mib {math.ceil(full)} holds a full context)", file=sys.stderr)  # fmt: skip
    served = AsyncEngine(engine, ns.max_queue)
    app = build_app(served, model.tokenizer, name, settings.api_key, max_body_bytes=int(ns.max_body_mib * 2**20))
    weights = sum(t.nbytes for t in itertools.chain(model.parameters(), model.buffers()))
    return Loaded(app, served, weights + engine.cache.nbytes)


def engine_config(ns: argparse.Namespace):
    """The ``EngineConfig`` the flags ask for."""
    from ..serve.config import EngineConfig

    return EngineConfig(kv_cache_mib=ns.kv_cache_mib, block_size=ns.block_size, max_running=ns.max_running,
                        prefill_chunk=ns.prefill_chunk, speculate=ns.speculate,
                        prefix_cache_dir=ns.prefix_cache_dir, prefix_cache_gib=ns.prefix_cache_gib,
                        cuda_graphs=not getattr(ns, "enforce_eager", False))  # fmt: skip


def model_router(settings: Settings, models: list[tuple[str, str | None]]):
    """The ASGI app serving ``models`` (``(name, path)``), each loaded on its first request (``model_router``)."""
    from functools import partial

    from ..serve.loaded_models import LoadedModels
    from ..serve.model_router import ModelRouter, ServedModel

    ns = settings.ns
    gib = ns.max_loaded_gib
    loaded = LoadedModels(ns.max_loaded, None if gib is None else int(gib * 2**30))
    pool = 0 if ns.kv_cache_mib is None else int(ns.kv_cache_mib * 2**20)
    served = {name: ServedModel(partial(load_served, settings, path, name), disk_bytes(path) + pool)
              for name, path in models}  # fmt: skip
    names = ", ".join(served)
    print(f"gqa serve: {len(served)} models ({names}), each loaded on its first request; at most "
          f"{ns.max_loaded or 'any number'} loaded at once"
          + ("" if gib is None else f", {gib:g} GiB of weights and KV pools"), file=sys.stderr)  # fmt: skip
    return ModelRouter(served, loaded, settings.api_key, max_body_bytes=int(ns.max_body_mib * 2**20))


def disk_bytes(path: str | None) -> int:
    """The bytes of a model's weights on disk (a GGUF file, an HF folder's weight files): what its load is expected
    to take before it has been loaded once."""
    from ..loaders import resolve_model_path

    resolved = resolve_model_path(path)
    if resolved.is_file():
        return resolved.stat().st_size
    return sum(f.stat().st_size for f in resolved.iterdir() if f.suffix in (".safetensors", ".bin", ".pt"))
