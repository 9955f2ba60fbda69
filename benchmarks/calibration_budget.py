"""The calibration budget's curve: the default training-free conversion (SmolLM2-135M-Instruct, 3 -> 1 KV heads)
calibrated on the conversations of ``N`` sampled user turns, for several ``N``, each judged by ``gqa eval --suite``.

For each ``N`` the script runs, as a user would, ``gqa convert OUT/N --kv-heads 1 --calibration-conversations N`` and
``gqa eval OUT/N --suite --json OUT/N.json``, one after the other (nothing else should run meanwhile). The
conversations come from one cache (``--cache``, ``GQA_CACHE_DIR``): a set of ``n`` user turns is the first ``n`` rows
of the largest set, so every ``N`` reads the rows a fresh run of ``N`` would generate, and the suite's held-out set is
the same for all. What generating ``N`` from nothing costs is measured apart, from an empty cache
(``--generation-counts``; ``benchmarks/conversation_generation.py``). Writes ``OUT/table.md`` and ``OUT/curve.png``;
an ``N`` whose JSON exists is not run again (``--redo`` runs it anyway).

    .venv/bin/python benchmarks/calibration_budget.py --out results/budget --counts 64 128 256 512 1400 \\
        --generation-counts 64 256 1400
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

GQA = [sys.executable, "-m", "gqa"]
HERE = Path(__file__).resolve().parent


def run_count(n: int, out: Path, redo: bool, value_steps: int | None = None) -> dict:
    name = str(n) if value_steps is None else f"{n}-steps{value_steps}"
    result = out / f"{name}.json"
    if result.is_file() and not redo:
        return json.loads(result.read_text())
    dst = out / name
    command = [*GQA, "convert", str(dst), "--kv-heads", "1", "--force", "--calibration-conversations", str(n)]
    if value_steps is not None:  # the refit's alternations are no flag: set the default stream_convert reads
        command[1:3] = [
            "-c",
            "import inspect, sys, gqa.convert.streaming as s, gqa.cli as c; inspect.unwrap(s.stream_convert)"
            f".__kwdefaults__['value_steps'] = {value_steps}; sys.exit(c.main(sys.argv[1:]))",
        ]
    start = time.perf_counter()
    subprocess.run(command, check=True)
    seconds = time.perf_counter() - start
    subprocess.run([*GQA, "eval", str(dst), "--suite", "--json", str(result)], check=True)
    data = json.loads(result.read_text())
    data["convert_seconds"] = seconds
    data["count"] = n
    data["value_steps"] = value_steps
    result.write_text(json.dumps(data, indent=1) + "\n")
    return data


def generation_seconds(n: int, out: Path, redo: bool) -> dict:
    result = out / f"generation-{n}.json"
    if not result.is_file() or redo:
        subprocess.run([sys.executable, str(HERE / "conversation_generation.py"), "--count", str(n), "--json",
                        str(result)], check=True)  # fmt: skip
    return json.loads(result.read_text())


def kept_sd(r: dict) -> float:
    """The binomial standard deviation of the kept count: the original's right answers, each kept with the measured
    share."""
    right = r["correct_original"]
    p = r["kept"]
    return math.sqrt(right * p * (1 - p))


def table(results: dict[int, dict], generation: dict[int, dict]) -> str:
    any_result = next(iter(results.values()))
    genres = list(any_result["perplexity"])
    head = ["user turns", "training conversations", "calibration tokens", "generation", "conversion", "answer KL",
            "prefix / F1", "questions right", "kept (± binomial SD)", *(f"ppl {g}" for g in genres)]  # fmt: skip
    rows = [head, ["---:"] * len(head)]
    for n, r in sorted(results.items()):
        gen = f"{generation[n]['seconds'] / 60:.1f} min" if n in generation else "-"
        right = r["correct_original"]
        rows.append([
            str(n), str(r.get("train_conversations", "-")), f"{r.get('calibration_tokens', 0):,}", gen,
            f"{r['convert_seconds'] / 60:.1f} min", f"{r['answer_kl']:.3f}",
            f"{r['prefix_tokens']:.1f} / {r['token_f1']:.3f}", f"{r['correct_model']}/{r['questions']}",
            f"{round(r['kept'] * right)}/{right} ± {kept_sd(r):.1f}",
            *(f"{r['perplexity'][g][1]:.2f} ({r['perplexity'][g][1] / r['perplexity'][g][0]:.2f}x)" for g in genres),
        ])  # fmt: skip
    return "\n".join("| " + " | ".join(row) + " |" for row in rows) + "\n"


def plot(results: dict[int, dict], generation: dict[int, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = sorted(results)
    right = results[ns[0]]["correct_original"]
    kept = [results[n]["kept"] * right for n in ns]
    sd = [kept_sd(results[n]) for n in ns]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(14, 4))
    a.errorbar(ns, kept, yerr=sd, marker="o", capsize=3)
    a.set(xscale="log", xlabel="user turns sampled (N)", ylabel=f"original's right answers kept (of {right})",
          title="answers kept (± binomial SD)")  # fmt: skip
    b.plot(ns, [results[n]["answer_kl"] for n in ns], marker="o")
    b.set(xscale="log", xlabel="user turns sampled (N)", ylabel="answer KL (nats/token)", title="answer KL")
    c.plot(ns, [results[n]["convert_seconds"] / 60 for n in ns], marker="o", label="conversion (conversations cached)")
    timed = sorted(generation)
    c.plot(timed, [generation[n]["seconds"] / 60 for n in timed], marker="s", label="generating the conversations")
    c.set(xscale="log", xlabel="user turns sampled (N)", ylabel="minutes", title="time on this machine")
    c.legend()
    for ax in (a, b, c):
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def calibration_counts(n: int) -> tuple[int, int]:
    """``(training conversations, calibration tokens)`` a conversion with ``N = n`` reads, from the cache."""
    from gqa.convert.conversations import GenerationSettings, model_content_hash, read_cached
    from gqa.convert.data import calibration_ids
    from gqa.loaders import load_tokenizer, resolve_model_path

    chats = read_cached(model_content_hash(resolve_model_path(None)), GenerationSettings(count=n))
    return len(chats.train), len(calibration_ids(load_tokenizer(None), chats.train))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--counts", type=int, nargs="+", default=[64, 128, 256, 512, 1400])
    ap.add_argument("--generation-counts", type=int, nargs="*", default=[], help="time generating these from nothing")
    ap.add_argument("--cache", type=Path, default=None, help="GQA_CACHE_DIR for the conversions (default: as set)")
    ap.add_argument("--value-steps", type=int, nargs="*", default=[],
                    help="also run the first count with the refit's alternations set to each of these")  # fmt: skip
    ap.add_argument("--redo", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.cache is not None:
        os.environ["GQA_CACHE_DIR"] = str(args.cache)
    results = {}
    for n in args.counts:
        results[n] = run_count(n, args.out, args.redo)
        results[n]["train_conversations"], results[n]["calibration_tokens"] = calibration_counts(n)
        (args.out / f"{n}.json").write_text(json.dumps(results[n], indent=1) + "\n")
        print(f"N={n}: kept {results[n]['kept']:.0%}, answer KL {results[n]['answer_kl']:.3f}", flush=True)
    for steps in args.value_steps:
        r = run_count(args.counts[0], args.out, args.redo, steps)
        print(f"N={args.counts[0]}, {steps} value steps: kept {r['kept']:.0%}, answer KL {r['answer_kl']:.3f}, "
              f"conversion {r['convert_seconds'] / 60:.1f} min", flush=True)  # fmt: skip
    generation = {n: generation_seconds(n, args.out, args.redo) for n in args.generation_counts}
    (args.out / "table.md").write_text(table(results, generation))
    plot(results, generation, args.out / "curve.png")
    print(table(results, generation))


if __name__ == "__main__":
    main()
