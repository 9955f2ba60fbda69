"""Converted chat models judged by their answers: ``gqa convert`` variants, each scored by ``gqa eval --suite``.

Runs the CLI as a user would, one variant after another (nothing else should run on the machine meanwhile), and
writes ``OUT/<variant>/`` (the converted model), ``OUT/<variant>.json`` (the suite's results, conversion time added)
and ``OUT/table.md`` (the table of docs/bench/conversion-history.md). A variant whose JSON exists is not run again
(``--redo`` runs it anyway), so an interrupted run resumes.

    .venv/bin/python benchmarks/conversion_answers.py --out results/answers
    .venv/bin/python benchmarks/conversion_answers.py --out results/answers --variants default healed-30
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

GQA = [sys.executable, "-m", "gqa"]
VARIANTS = {  # name -> gqa convert flags (after DST --kv-heads 1)
    "mean": ["--method", "mean"],
    "prose-calibrated": ["--no-conversations"],
    "default": [],
    "healed-10": ["--heal-minutes", "10"],
    "healed-30": ["--heal-minutes", "30"],
}


def run_variant(name: str, out: Path, redo: bool) -> dict:
    result = out / f"{name}.json"
    if result.is_file() and not redo:
        return json.loads(result.read_text())
    dst = out / name
    start = time.perf_counter()
    subprocess.run([*GQA, "convert", str(dst), "--kv-heads", "1", "--force", *VARIANTS[name]], check=True)
    seconds = time.perf_counter() - start
    subprocess.run([*GQA, "eval", str(dst), "--suite", "--json", str(result)], check=True)
    data = json.loads(result.read_text())
    heal_log = dst / "heal_log.json"
    data["convert_seconds"] = seconds
    if heal_log.is_file():
        log = json.loads(heal_log.read_text())
        data["heal_seconds"], data["heal_steps"] = log["seconds"], len(log["losses"])
        data["heal_local_steps"] = len(log["local"]["losses"]) if log.get("local") else 0
    result.write_text(json.dumps(data, indent=1) + "\n")
    return data


def table(results: dict[str, dict]) -> str:
    any_result = next(iter(results.values()))
    genres = list(any_result["perplexity"])
    head = ["variant", "convert (heal) time", "answer KL", "prefix / F1", "questions right", "kept",
            *(f"ppl {g}" for g in genres)]  # fmt: skip
    rows = [head, ["---"] + ["---:"] * (len(head) - 1)]
    orig = ["original", "-", "0", "all / 1.000", f"{any_result['correct_original']}/{any_result['questions']}", "100%"]
    rows.append(orig + [f"{any_result['perplexity'][g][0]:.2f}" for g in genres])
    for name, r in results.items():
        time_ = f"{r['convert_seconds'] / 60:.1f} min"
        if "heal_seconds" in r:
            local = f"{r['heal_local_steps']} layer-local + " if r.get("heal_local_steps") else ""
            kind = "end-to-end " if local else ""
            time_ += f" ({r['heal_seconds'] / 60:.1f} min, {local}{r['heal_steps']} {kind}steps)"
        ppl = [f"{r['perplexity'][g][1]:.2f} ({r['perplexity'][g][1] / r['perplexity'][g][0]:.2f}x)" for g in genres]
        rows.append([name, time_, f"{r['answer_kl']:.3f}", f"{r['prefix_tokens']:.1f} / {r['token_f1']:.3f}",
                     f"{r['correct_model']}/{r['questions']}", f"{r['kept']:.0%}", *ppl])  # fmt: skip
    return "\n".join("| " + " | ".join(row) + " |" for row in rows) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for the models, JSON results and table")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--redo", action="store_true", help="run variants whose results exist again")
    ns = parser.parse_args()
    ns.out.mkdir(parents=True, exist_ok=True)
    results = {name: run_variant(name, ns.out, ns.redo) for name in ns.variants}
    text = table(results)
    (ns.out / "table.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
