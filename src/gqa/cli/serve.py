"""``gqa serve``: a model behind an OpenAI-compatible HTTP API (the flags: ``serve_args``; the server:
``gqa.serve``)."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from ..hardware import auto_dtype
from ..options.common import EMBEDDED_MODEL, loading, model_label
from ..options.dtypes import DTYPES

EMBEDDED_NAME = "SmolLM2-135M-Instruct"


def serve_device(text: str):
    """``--device`` as a torch device: cpu, or a CUDA device that exists here; else ``ValueError`` naming the flag."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device must be cpu, cuda or cuda:N, got {text!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu, cuda or cuda:N, got {text!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {text}: no CUDA device on this machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def run_serve(ns: argparse.Namespace) -> int:
    import uvicorn

    from ..loaders.model import load_model
    from ..serve.async_engine import AsyncEngine
    from ..serve.config import EngineConfig
    from ..serve.engine import Engine, EngineError
    from ..serve.server import build_app

    for flag, value, low in (("--port", ns.port, 0), ("--block-size", ns.block_size, 1),
                             ("--max-running", ns.max_running, 1), ("--max-queue", ns.max_queue, 0),
                             ("--prefill-chunk", ns.prefill_chunk, 1)):  # fmt: skip
        if value < low or (flag == "--port" and value > 65535):
            raise ValueError(f"{flag} must be {'in [0, 65535]' if flag == '--port' else f'>= {low}'}, got {value}")
    if ns.kv_cache_mib is not None and not ns.kv_cache_mib > 0:
        raise ValueError(f"--kv-cache-mib must be > 0, got {ns.kv_cache_mib}")
    device = serve_device(ns.device)
    if device.type == "cuda":  # the Triton runner takes float weights: auto is bf16, quantized ones are dequantized
        dtype = DTYPES["bf16"] if ns.dtype == "auto" else DTYPES[ns.dtype]
    else:
        dtype = auto_dtype() if ns.dtype == "auto" else DTYPES[ns.dtype]
    with loading(f"{model_label(ns.model)} as {ns.dtype} on {device}"):
        model = load_model(ns.model, dtype="auto" if ns.dtype == "auto" and device.type == "cpu" else dtype,
                           device=device)  # fmt: skip
    try:
        config = EngineConfig(kv_cache_mib=ns.kv_cache_mib, block_size=ns.block_size, max_running=ns.max_running,
                              prefill_chunk=ns.prefill_chunk)  # fmt: skip
        engine = Engine(model, model.tokenizer, config)
    except EngineError as e:
        raise ValueError(f"this model cannot be served: {e}") from e
    name = ns.served_model_name or (EMBEDDED_NAME if ns.model is None else Path(ns.model).name)
    cfg, blocks = model.config, engine.blocks
    print(
        f"gqa serve: {name} ({model_label(ns.model) if ns.model else EMBEDDED_MODEL}), {cfg.num_heads} query / "
        f"{cfg.num_kv_heads} KV heads; KV cache {engine.cache.nbytes / 2**20:.0f} MiB = {blocks.num_blocks} blocks "
        f"of {blocks.block_size} tokens, {blocks.num_blocks * blocks.block_size // cfg.max_position_embeddings} full "
        f"{cfg.max_position_embeddings}-token contexts",
        file=sys.stderr,
    )
    app = build_app(AsyncEngine(engine, ns.max_queue), model.tokenizer, name, ns.api_key)
    config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level="info", access_log=False,
                            timeout_graceful_shutdown=30)  # fmt: skip
    server = uvicorn.Server(config)
    # uvicorn shuts down gracefully on SIGTERM / SIGINT and then raises the signal again to the handler it found:
    # one that does nothing makes a graceful stop exit 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda number, frame: None)
    server.run()
    return 0 if server.started else 1
