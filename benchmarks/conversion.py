"""Conversion results (docs/bench/conversion-history.md): SmolLM2-135M-Instruct with 9, 3 and 1 KV heads, every method.

For each variant: perplexity on the default evaluation text (``gqa.evaluation.perplexity.default_eval_text``: CPython's
LICENSE.txt, first ``--tokens`` tokens, window 512, stride 256), mean KL(original || variant) on the same windows,
the same two on held-out docstrings (the first ``--tokens`` tokens of ``held_out_text()``: standard-library
docstrings that neither calibration nor healing reads),
KV-cache bytes per token, and decode tokens/s (eager, batch 1, 32 new tokens after a 512-token prompt, once per head
count). Conversions run in memory with ``gqa.convert.convert_state``; calibrated methods use the default calibration
text (standard-library docstrings), which is not the evaluation text.

With ``--heal-steps N`` every 3 -> 1 variant is then healed (``gqa.convert.heal``: distilled from the original on
``default_heal_text()``, other standard-library docstrings, also disjoint from the evaluation text) — the default
(``pca`` + refit) for N steps, plain ``pca``, ``mean`` and ``first`` for ``--heal-steps-others`` steps — and measured
again; ``--plots DIR`` saves each loss curve as ``DIR/heal_<method>.png``.

    .venv/bin/python benchmarks/conversion.py --json results/conversion.json
    .venv/bin/python benchmarks/conversion.py --heal-steps 1700 --heal-steps-others 100 --plots results \\
        --json results/conversion-healed.json
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from pathlib import Path

import torch

from gqa.bench import write_json_atomic
from gqa.cache.kv import kv_cache_bytes
from gqa.convert import (
    DEFAULT_METHOD,
    PRECISIONS,
    TRAINABLE,
    HealConfig,
    _calibration_activations,
    convert_state,
    heal,
    refit_convert_state,
    save_loss_curve,
)
from gqa.convert.calibration import default_calibration_text, default_heal_text, held_out_text
from gqa.decoding.generate import generate_stream
from gqa.evaluation.perplexity import DEFAULT_WINDOW, _score, default_eval_text, perplexity
from gqa.loaders import load_tokenizer, read_model
from gqa.models import CausalLM, use_input_major_weights

DEFAULT_VARIANT = f"{DEFAULT_METHOD} + refit"  # what `gqa convert --kv-heads 1` does


def save(path: Path | None, description: str, ids: list[int], rows: list[dict]) -> None:
    """Write the rows so far (after every row, so that a long healing run leaves its partial results)."""
    if path is not None:
        payload = {"eval_text": description, "tokens": len(ids), "torch": torch.__version__, "rows": rows}
        write_json_atomic(path, payload | {"threads": torch.get_num_threads()})


def build(cfg, state) -> CausalLM:
    model = CausalLM.from_state(cfg, state)
    use_input_major_weights(model)
    return model


def quality(model: CausalLM, original: CausalLM, ids: list[int]) -> dict[str, float]:
    """Perplexity and mean KL(original || model) in one pass over the windows (window 512, stride 256)."""
    if model is original:
        return {"perplexity": perplexity(model, ids), "kl": 0.0}
    nll, kl, count = _score(model, torch.tensor(ids), DEFAULT_WINDOW, None, original)
    return {"perplexity": math.exp(nll / count), "kl": kl / count}


def decode_tok_s(model: CausalLM, prompt: list[int], new: int = 32) -> float:
    stamps = [time.perf_counter() for _ in generate_stream(model, [prompt], max_new_tokens=new, eos_token_ids=[])]
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="evaluation tokens (default 2048)")
    parser.add_argument("--json", type=Path, default=None)
    d = HealConfig(steps=1)
    parser.add_argument("--heal-steps", type=int, default=0, help=f"heal 3 -> 1 {DEFAULT_METHOD} for N steps")
    parser.add_argument("--heal-steps-others", type=int, default=None, help="steps for mean/first (default N)")
    parser.add_argument("--heal-lr", type=float, default=d.lr)
    parser.add_argument("--heal-seq-len", type=int, default=d.seq_len)
    parser.add_argument("--heal-batch", type=int, default=d.batch_size)
    parser.add_argument("--heal-train", choices=TRAINABLE, default=d.train)
    parser.add_argument("--heal-precision", choices=PRECISIONS, default=d.precision)
    parser.add_argument("--plots", type=Path, default=None, help="folder for the loss curves (heal_<method>.png)")
    ns = parser.parse_args()
    others = ns.heal_steps if ns.heal_steps_others is None else ns.heal_steps_others
    torch.set_grad_enabled(False)
    cfg, state = read_model(None)
    tok = load_tokenizer(None)
    text, description = default_eval_text()
    ids = tok.encode(text, add_special_tokens=False)[: ns.tokens]
    held = tok.encode(held_out_text(), add_special_tokens=False)[: ns.tokens]
    original = build(cfg, state)

    def scores(model: CausalLM) -> dict[str, float]:
        q, h = quality(model, original, ids), quality(model, original, held)
        return q | {"held_perplexity": h["perplexity"], "held_kl": h["kl"]}

    expanded_cfg, expanded_state = convert_state(cfg, state, 9)  # exact expansion 3 -> 9 (MHA)
    calib = default_calibration_text()
    acts3 = _calibration_activations(cfg, state, tok, calib)
    acts9 = _calibration_activations(expanded_cfg, expanded_state, tok, calib)
    variants = [("original", 3, "-", cfg, state), ("expanded", 9, "exact", expanded_cfg, expanded_state)]
    for method in ("pca", "mean", "first"):
        variants.append(("9 -> 3", 3, method, *convert_state(expanded_cfg, expanded_state, 3, method, acts9)))
    for method in ("pca", "mean", "first"):
        variants.append(("3 -> 1", 1, method, *convert_state(cfg, state, 1, method, acts3)))
    variants.append(("3 -> 1", 1, DEFAULT_VARIANT, *refit_convert_state(cfg, state, 1, "pca", tok.encode(calib))))

    rows, speed = [], {}
    prompt = ids[:512]
    for name, heads, method, c, s in variants:
        model = original if name == "original" else build(c, s)
        row = {"variant": name, "kv_heads": heads, "method": method, **scores(model)}
        row["kv_bytes_per_token_fp32"] = kv_cache_bytes(c.num_layers, heads, c.head_dim, 1, dtype=torch.float32)
        if heads not in speed:
            speed[heads] = decode_tok_s(model, prompt)
        row["decode_tok_s"] = speed[heads]
        rows.append(row)
        print(f"[conversion] {name} {method}: ppl {row['perplexity']:.2f}", flush=True)
        save(ns.json, description, ids, rows)

    heal_ids = tok.encode(default_heal_text()) if ns.heal_steps > 0 else []
    for name, heads, method, c, s in sorted(variants, key=lambda v: v[2] != DEFAULT_VARIANT):  # the default first
        steps = ns.heal_steps if method == DEFAULT_VARIANT else others
        if name != "3 -> 1" or steps <= 0:
            continue
        config = HealConfig(
            steps, ns.heal_lr, ns.heal_seq_len, ns.heal_batch, ns.heal_train, precision=ns.heal_precision
        )
        student = CausalLM.from_state(c, s)  # a copy: s stays the unhealed weights
        with torch.enable_grad():
            res = heal(student, original, heal_ids, **dataclasses.asdict(config))
        if ns.plots:
            ns.plots.mkdir(parents=True, exist_ok=True)
            plot = ns.plots / f"heal_{method.replace(' + ', '_')}.png"
            save_loss_curve(res, plot, f"SmolLM2 3 -> 1 KV heads ({method}), healing ({res.precision})")
        use_input_major_weights(student)
        row = {"variant": "3 -> 1 healed", "kv_heads": heads, "method": method, **scores(student)}
        row["kv_bytes_per_token_fp32"] = kv_cache_bytes(c.num_layers, heads, c.head_dim, 1, dtype=torch.float32)
        row["decode_tok_s"] = speed[heads]
        row["heal"] = dataclasses.asdict(config) | {
            "precision_used": res.precision,
            "seconds": res.seconds, "seconds_per_step": res.seconds_per_step, "cpu_seconds": res.cpu_seconds,
            "tokens_per_step": res.tokens_per_step,
            "trained_parameters": res.trained_parameters, "heal_text_tokens": len(heal_ids), "losses": res.losses,
        }  # fmt: skip
        rows.append(row)
        print(
            f"[conversion] healed {method}: {steps} steps in {res.seconds:.0f} s ({res.seconds_per_step:.2f} s/step), "
            f"ppl {row['perplexity']:.2f}, KL {row['kl']:.3f}; held-out docstrings ppl {row['held_perplexity']:.2f}",
            flush=True,
        )
        save(ns.json, description, ids, rows)

    base = rows[0]["perplexity"]
    held_base = rows[0]["held_perplexity"]
    print(f"\nEvaluation text: {description}, first {len(ids)} tokens, window 512, stride 256.\n")
    print(
        "| variant | KV heads | method | healing | perplexity | x original | mean KL (nats) | held-out docstrings: "
        "perplexity | x original | mean KL | KV cache / token | decode tok/s |"
    )
    print("|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        h = r.get("heal")
        how = (
            "-"
            if h is None
            else f"{h['steps']} steps, {h['seconds'] / 60:.1f} min ({h['seconds_per_step']:.2f} s/step)"
        )
        print(
            f"| {r['variant']} | {r['kv_heads']} | {r['method']} | {how} | {r['perplexity']:.2f} | "
            f"{r['perplexity'] / base:.2f} | {r['kl']:.3f} | {r['held_perplexity']:.2f} | "
            f"{r['held_perplexity'] / held_base:.2f} | {r['held_kl']:.3f} | "
            f"{r['kv_bytes_per_token_fp32'] / 1024:.1f} KiB | {r['decode_tok_s']:.1f} |"
        )
    save(ns.json, description, ids, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
