"""One healing recipe, judged by ``gqa eval --suite``: heal a saved ``gqa convert`` output (a merge without healing)
from the original for ``--minutes`` with the data and defaults ``gqa convert --heal-minutes`` uses (the source's
self-generated conversations and docstrings, answer tokens weighted), with ``--local-share`` of the budget spent on
layer-local healing first, ``--lr`` as the end-to-end peak rate and ``--train`` what trains; write the healed model to
OUT and run the suite on it. Each recipe then costs its healing and the suite (~7 minutes on a 2-core CPU), not another
conversion.

    .venv/bin/gqa convert results/mqa --kv-heads 1                                    # once
    .venv/bin/python benchmarks/heal_suite.py results/mqa-h10 --student results/mqa --minutes 10
    .venv/bin/python benchmarks/heal_suite.py results/mqa-h10-local --student results/mqa --minutes 10 \\
        --local-share 0.5 --json results/heal-suite.jsonl        # appends one line per run
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from safetensors.torch import save_file

from gqa.convert import heal
from gqa.convert.conversations import (
    HEALING_CONVERSATIONS,
    GenerationSettings,
    model_content_hash,
    self_generated_conversations,
)
from gqa.convert.data import heal_data
from gqa.evaluation.suite import run_suite
from gqa.loaders import read_model, resolve_model_path
from gqa.loaders.model import load_model
from gqa.models import CausalLM


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="where the healed model is written (an HF folder)")
    p.add_argument("--student", type=Path, required=True, help="a gqa convert output without healing")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--steps", type=int, default=None,
                   help="heal for this many steps (both phases) instead of --minutes: the same result however busy "
                        "the machine is")  # fmt: skip
    p.add_argument("--local-share", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=None, help="end-to-end peak rate (default: gqa convert's)")
    p.add_argument("--train", default="attention", help="what trains (gqa convert --heal-train)")
    p.add_argument("--precision", default="auto")
    p.add_argument("--json", type=Path, default=None, help="append the summary as one JSON line")
    a = p.parse_args()
    path = resolve_model_path(None)
    cfg, state = read_model(path)
    teacher = CausalLM.from_state(cfg, state, assign=True)
    ref = load_model(None, dtype="fp32")
    chats = self_generated_conversations(
        ref, ref.tokenizer, model_content_hash(path), GenerationSettings(count=HEALING_CONVERSATIONS)
    )  # as gqa convert heals
    data = heal_data(ref.tokenizer, chats.train, 256)
    del ref
    student = CausalLM.from_state(*read_model(a.student), assign=True)
    res = heal(student, teacher, data.ids, weights=data.weights, starts=data.starts, steps=a.steps or 10**9,
               minutes=None if a.steps else a.minutes,
               local_share=a.local_share, lr=a.lr, train=a.train, precision=a.precision)  # fmt: skip
    shutil.copytree(a.student, a.out)
    save_file(student.state_dict(), a.out / "model.safetensors", metadata={"format": "pt"})
    del student, teacher
    start = time.perf_counter()
    r = run_suite(a.out)
    local = res.local
    summary = {
        "out": str(a.out), "minutes": None if a.steps else a.minutes, "steps": a.steps, "local_share": a.local_share,
        "lr": a.lr, "train": a.train,
        "precision": res.precision,
        "end_to_end_steps": len(res.losses), "local_steps": None if local is None else len(local.losses),
        "local_block_error": None if local is None else [sum(e) / len(e) for e in (local.errors_before,
                                                                                  local.errors_after)],
        "heal_seconds": res.seconds, "suite_seconds": time.perf_counter() - start, "answer_kl": r.answer_kl,
        "prefix_tokens": r.prefix_tokens, "token_f1": r.token_f1, "right": [r.correct_original, r.correct_model],
        "kept": r.kept, "perplexity": {k: [v[0], v[1], v[1] / v[0]] for k, v in r.perplexity.items()},
    }  # fmt: skip
    print(json.dumps(summary))
    if a.json is not None:
        with a.json.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(summary) + "\n")


if __name__ == "__main__":
    main()
