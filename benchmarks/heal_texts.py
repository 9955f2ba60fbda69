"""Which text heals a merged model best? SmolLM2-135M-Instruct 3 -> 1 KV heads (``pca``), healed for the same number
of steps on each heal text, then scored on three held-out texts: CPython's ``LICENSE.txt`` (the default evaluation
text), standard-library docstrings that healing never reads (``held_out_text()``), and text sampled from the
original model with a seed that healing never uses.

Heal texts: ``doc`` = ``default_heal_text(400_000)`` (docstrings; the default heal text before it grew to all of
them); ``gen`` = ``--gen-rows`` x ``--gen-len`` tokens sampled from the original model (temperature 1, from the BOS
token alone); ``mix`` = the two interleaved in 2048-token blocks.
Every row: perplexity (window 512, stride 256, first 2048 tokens) and mean KL(original || model) on each text.

    .venv/bin/python benchmarks/heal_texts.py --steps 150 --json results/heal-texts.json     # ~25 min here
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from conversion import quality  # benchmarks/conversion.py, beside this script

from gqa.bench import write_json_atomic
from gqa.convert import _calibration_activations, convert_state, heal
from gqa.convert.calibration import default_calibration_text, default_heal_text, held_out_text
from gqa.decoding.generate import generate
from gqa.evaluation.perplexity import default_eval_text
from gqa.loaders import load_tokenizer, read_model
from gqa.models import CausalLM

TOKENS = 2048


def sample(model: CausalLM, bos: int, rows: int, length: int, seed: int) -> list[int]:
    """``rows`` samples of ``length`` tokens from ``model`` (temperature 1, from ``bos``), concatenated."""
    out: list[int] = []
    for start in range(0, rows, 16):
        n = min(16, rows - start)
        for row in generate(model, [[bos]] * n, max_new_tokens=length, temperature=1.0, seed=seed + start,
                            eos_token_ids=[]):  # fmt: skip
            out += [bos, *row]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--gen-rows", type=int, default=64)
    parser.add_argument("--gen-len", type=int, default=512)
    parser.add_argument("--recipes", nargs="+", default=["none", "doc", "gen", "mix"])
    parser.add_argument("--json", type=Path, default=None)
    ns = parser.parse_args()
    torch.manual_seed(0)
    cfg, state = read_model(None)
    tok = load_tokenizer(None)
    merged_cfg, merged = convert_state(
        cfg, state, 1, "pca", _calibration_activations(cfg, state, tok, default_calibration_text())
    )
    teacher = CausalLM.from_state(cfg, state).eval()
    bos = cfg.bos_token_id if cfg.bos_token_id is not None else 0
    heal_ids = {"doc": tok.encode(default_heal_text(400_000))}
    evals = {
        "license": tok.encode(default_eval_text()[0])[:TOKENS],
        "held_doc": tok.encode(held_out_text())[:TOKENS],
        "held_gen": sample(teacher, bos, 8, 256, seed=10_000)[:TOKENS],
    }
    if {"gen", "mix"} & set(ns.recipes):
        start = time.perf_counter()
        heal_ids["gen"] = sample(teacher, bos, ns.gen_rows, ns.gen_len, seed=0)
        print(f"sampled {len(heal_ids['gen'])} tokens in {time.perf_counter() - start:.0f} s", flush=True)
        heal_ids["mix"] = [t for i in range(0, len(heal_ids["doc"]), 2048)
                           for t in heal_ids["doc"][i : i + 2048] + heal_ids["gen"][i : i + 2048]]  # fmt: skip

    def score(model: CausalLM) -> dict:  # perplexity and KL in one pass per text (window 512, stride 256)
        scores = {name: quality(model, teacher, ids) for name, ids in evals.items()}
        return {name: {"ppl": q["perplexity"], "kl": q["kl"]} for name, q in scores.items()}

    rows = [{"recipe": "original", **score(teacher)}]
    for recipe in ns.recipes:
        student = CausalLM.from_state(merged_cfg, merged)
        row: dict = {"recipe": "pca, not healed" if recipe == "none" else recipe}
        if recipe != "none":
            result = heal(student, teacher, heal_ids[recipe], steps=ns.steps, lr=ns.lr, progress=False)
            row |= {"heal_tokens": len(heal_ids[recipe]), "seconds": result.seconds,
                    "final_loss": sum(result.losses[-20:]) / len(result.losses[-20:])}  # fmt: skip
        rows.append(row | score(student))
        print(json.dumps(rows[-1]), flush=True)
    print("\n| heal text | " + " | ".join(f"{n} ppl | {n} KL" for n in evals) + " |")
    print("|---|" + "---:|" * (2 * len(evals)))
    for r in rows:
        print(f"| {r['recipe']} | " + " | ".join(f"{r[n]['ppl']:.1f} | {r[n]['kl']:.3f}" for n in evals) + " |")
    if ns.json:
        write_json_atomic(ns.json, {"steps": ns.steps, "lr": ns.lr, "gen": [ns.gen_rows, ns.gen_len], "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
