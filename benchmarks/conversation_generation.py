"""How long a chat model takes to write its self-generated conversations (``gqa.convert.conversations``), the wait
before the first conversion of a model: a set of the embedded SmolLM2-135M-Instruct (default: the conversion's 256
user turns), generated from scratch into a temporary cache folder (the user's cache is neither read nor written),
each phase timed.

    .venv/bin/python benchmarks/conversation_generation.py [--count 256] [--batch-size 128] [--json FILE]
    # docs/conversion.md's machine I (2-core Intel Xeon VM, AVX-512, AMX): 256 turns 86 s, 1,400 turns 392 s
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from gqa.bench import write_json_atomic
from gqa.convert import conversations
from gqa.loaders import resolve_model_path
from gqa.loaders.model import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=conversations.GenerationSettings.count, help="user turns sampled")
    ap.add_argument("--batch-size", type=int, default=conversations.GenerationSettings.batch_size,
                    help="rows decoded together")  # fmt: skip
    ap.add_argument("--json", type=Path, help="write the result here")
    args = ap.parse_args()
    path = resolve_model_path(None)
    model = load_model(None, dtype=torch.float32)
    phases: dict[str, float] = {}
    real = conversations.generate_many

    def timed(*a, phase: str = "", **kw):  # each phase's wall time
        start = time.perf_counter()
        out = real(*a, phase=phase, **kw)
        phases[phase] = time.perf_counter() - start
        phases[f"{phase} tokens"] = sum(len(row) for row in out)
        return out

    conversations.generate_many = timed
    with tempfile.TemporaryDirectory() as cache:
        os.environ["GQA_CACHE_DIR"] = cache
        settings = conversations.GenerationSettings(count=args.count, batch_size=args.batch_size)
        start = time.perf_counter()
        made = conversations.self_generated_conversations(
            model, model.tokenizer, conversations.model_content_hash(path), settings
        )
        seconds = time.perf_counter() - start
    result = {
        "count": args.count, "batch_size": args.batch_size,
        "conversations": len(made), "train": len(made.train), "held_out": len(made.held_out),
        "seconds": round(seconds, 1), "threads": torch.get_num_threads(),
        **{k: round(v, 1) if isinstance(v, float) else v for k, v in phases.items()},
    }  # fmt: skip
    for phase in ("user turns", "answers"):
        result[f"{phase} tok/s"] = round(phases[f"{phase} tokens"] / phases[phase], 1)
    print(json.dumps(result, indent=1))
    if args.json:
        write_json_atomic(args.json, result)


if __name__ == "__main__":
    main()
