"""llama.cpp's own ``llama-bench`` on a GGUF file, as the peer of ``gqa bench model --shapes``: prompt processing at
each context (``-p``) and decode (``-n``, from an empty context), with ``--repack 0`` and ``1`` in the one run (which is
faster depends on the CPU: the repacked Q4_K layout is its AVX2/AVX-512 path, ``--repack 0`` the one its AMX path
needs); each row keeps the faster and says which."""

from __future__ import annotations

import json
from pathlib import Path

from .processes import timed_process

__all__ = ["llama_bench", "llama_first_token_cmd"]


def llama_bench(tool: Path, model: Path, contexts: list[int], new: int, threads: int, repeats: int,
                repack: tuple[int, ...] = (0, 1)) -> dict:  # fmt: skip
    """``{"prefill": {C: row}, "decode": row, "peak_rss_mib"}`` where a row is ``{"tok_s", "repack", "all"}``
    (``all``: tok/s per repack setting); llama-bench's mean over ``repeats`` runs after its own warm-up run."""
    cmd = [str(tool), "-m", str(model), "-p", ",".join(map(str, contexts)), "-n", str(new), "-t", str(threads),
           "-r", str(repeats), "--repack", ",".join(map(str, repack)), "-o", "json"]  # fmt: skip
    run = timed_process(cmd)
    records = json.loads(run["stdout"])
    prefill: dict[int, dict] = {}
    decode: dict = {}
    for r in records:
        row = prefill.setdefault(r["n_prompt"], {}) if r["n_gen"] == 0 else decode
        row.setdefault("all", {})[int(bool(r["repack"]))] = r["avg_ts"]
    for row in [*prefill.values(), decode]:
        best = max(row["all"], key=row["all"].get)
        row.update(tok_s=row["all"][best], repack=best)
    return {"prefill": prefill, "decode": decode, "peak_rss_mib": run["peak_rss_mib"], "command": " ".join(cmd)}


def llama_first_token_cmd(tool: Path, model: Path, prompt: int, threads: int, repack: int) -> list[str]:
    """llama-bench loading ``model`` and processing one ``prompt``-token batch once, no warm-up: exec to exit is
    llama.cpp's load-to-first-token (its logits)."""
    return [str(tool), "-m", str(model), "-p", str(prompt), "-n", "0", "-r", "1", "--no-warmup", "-t", str(threads),
            "--repack", str(repack), "-o", "json"]  # fmt: skip
