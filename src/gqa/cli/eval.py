"""``gqa eval``: perplexity of a model on a text, and its KL divergence from a reference model (the flags:
``eval_args``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..evaluation.perplexity import check_windows, default_eval_text, evaluate
from ..options.common import loading, model_label
from ..options.dtypes import DTYPES


def load_text(path: str | None) -> tuple[str, str]:
    """``(text, description)`` of a text file, or of the default evaluation text when ``path`` is ``None``."""
    if path is None:
        return default_eval_text()
    return Path(path).read_text(encoding="utf-8"), path


def model_name(path: str | None) -> str:
    if path is not None:
        return path
    from ..loaders import default_model_path

    return f"{default_model_path().name} (default)"


def run_eval(ns: argparse.Namespace) -> int:
    if ns.suite:
        return run_suite_command(ns)
    if ns.json is not None or ns.show_answers:
        raise ValueError("--json and --show-answers go with --suite")
    stride = check_windows(ns.window, None)  # evaluate() checks the rest before loading anything
    text, description = load_text(ns.text)
    what = f"{model_label(ns.model)} as {ns.dtype}"
    what += f" and reference {ns.reference} as fp32" if ns.reference is not None else ""
    with loading(f"{what}, then scoring {description}"):
        res = evaluate(
            ns.model,
            text,
            reference_path=ns.reference,
            window=ns.window,
            max_tokens=ns.max_tokens,
            dtype=ns.dtype if ns.dtype == "auto" else DTYPES[ns.dtype],
            quantize=ns.quantize,
            decode=ns.decode,
        )
    how = ns.dtype + (f", quantized to {ns.quantize}" if ns.quantize else "") + (", decode steps" if ns.decode else "")
    print(f"model        {model_name(ns.model)}, {how}")
    print(f"text         {description}")
    print(f"tokens       {res.tokens}  (window {ns.window}, stride {stride})")
    print(f"perplexity   {res.perplexity:.4f}")
    if res.kl is not None:
        print(f"mean KL      {res.kl:.6g} nats/token  (KL(reference || model), reference {ns.reference} in fp32)")
    return 0


def run_suite_command(ns: argparse.Namespace) -> int:
    import dataclasses

    from .._atomic import write_json_atomic
    from ..evaluation.suite import run_suite

    if ns.model is None:
        raise ValueError("--suite judges a converted model: give its folder (gqa eval DST --suite)")
    reference = ns.reference if ns.reference is not None else model_name(None)
    with loading(f"{ns.model} and reference {reference} as fp32", timed=False):
        res = run_suite(ns.model, ns.reference, conversations=ns.conversations)
    print(f"model        {ns.model}, fp32")
    print(f"reference    {reference}, fp32")
    print(f"answer KL    {res.answer_kl:.4f} nats/token  (KL(reference || model) on the answer tokens of "
          f"{res.conversations} held-out self-generated conversations)")  # fmt: skip
    print(f"agreement    greedy answers to those turns: common prefix {res.prefix_tokens:.1f} tokens, "
          f"identical {res.identical:.0%}, token F1 {res.token_f1:.3f}")  # fmt: skip
    print(f"questions    reference {res.correct_original}/{res.questions} right, model {res.correct_model}/"
          f"{res.questions}; keeps {res.kept:.0%} of the reference's right answers")  # fmt: skip
    for genre, (ref, mod) in res.perplexity.items():
        print(f"perplexity   {genre:<21} reference {ref:8.2f}  model {mod:8.2f}  ({mod / ref:.2f}x)")
    print(f"time         {res.seconds:.0f} s")
    if ns.show_answers:
        for question, ref_reply, reply in res.answers:
            print(f"\nQ: {question}\n  reference: {ref_reply.strip()}\n  model:     {reply.strip()}")
    if ns.json is not None:
        write_json_atomic(ns.json, dataclasses.asdict(res) | {"model": ns.model, "reference": reference})
        print(f"wrote        {ns.json}")
    return 0
