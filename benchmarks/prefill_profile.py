"""Where one prompt's prefill time goes, and the memory beyond the file: ``torch.profiler``'s operators (self CPU
time) over ``--runs`` forwards of a ``--context``-token prompt, after a warm one, on a GGUF file as ``gqa.load_model``
loads it by default; the process's resident memory (``/proc/self/status``: file pages vs anonymous) after the load and
after the prefills.

    python benchmarks/prefill_profile.py FILE.gguf --context 128
    perf record -g python benchmarks/prefill_profile.py FILE.gguf --no-profiler   # the native frames under them
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import gqa


def memory_mib() -> dict[str, float]:
    """``VmRSS`` split as the kernel counts it (``RssFile``: the mapped file's pages, ``RssAnon``: the rest) and
    ``VmHWM``, MiB."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key = line.split(":")[0]
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
            out[key] = int(line.split()[1]) / 1024
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-profiler", action="store_true", help="time the runs only (under perf record)")
    parser.add_argument("--rows", type=int, default=25, help="operators in the table")
    ns = parser.parse_args()
    print(f"before load: {memory_mib()}")
    model = gqa.load_model(ns.model, tokenizer=False)
    print(f"after load: {memory_mib()}  (file {ns.model.stat().st_size / 2**20:.0f} MiB)")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, model.config.vocab_size, (1, ns.context), generator=g)

    def prefill() -> float:
        caches = model.new_caches(1, ns.context + 32)
        start = time.perf_counter()
        model(ids, caches=caches, last_only=True)
        return time.perf_counter() - start

    with torch.inference_mode():
        print(f"first prefill: {ns.context / prefill():.1f} tok/s")
        print(f"after the first prefill: {memory_mib()}")
        if ns.no_profiler:
            times = [prefill() for _ in range(ns.runs)]
        else:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                times = [prefill() for _ in range(ns.runs)]
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=ns.rows))
    print(f"warm prefill: {' '.join(f'{ns.context / t:.1f}' for t in times)} tok/s")
    print(f"at the end: {memory_mib()}")


if __name__ == "__main__":
    main()
