"""``gqa eval``: perplexity of a model on a text, and its KL divergence from a reference model; with ``--suite`` the
measures that judge a converted chat model."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..options.common import loading, model_label
from ..options.defaults import DEFAULT_WINDOW, HELD_OUT_CONVERSATIONS, QUANT_FORMATS
from ..options.dtypes import add_dtype_argument

HELP = "perplexity on a text, and mean KL divergence from a reference"
DESCRIPTION = HELP

EVAL_DTYPES = ("fp32", "bf16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``gqa eval`` on ``parser``."""
    parser.add_argument("model", nargs="?", default=None, help="GGUF file or HF directory (default: embedded SmolLM2)")
    parser.add_argument("--text", default=None, metavar="FILE", help="UTF-8 text file (default: CPython's LICENSE.txt)")
    parser.add_argument(
        "--reference",
        default=None,
        metavar="MODEL",
        help="model to report mean KL(reference || model) against, loaded in fp32",
    )
    parser.add_argument("--window", type=int, default=DEFAULT_WINDOW, help="tokens per forward pass")
    parser.add_argument(
        "--max-tokens", type=int, default=None, metavar="N", help="evaluate only the first N tokens (default: all)"
    )
    add_dtype_argument(
        parser, "--dtype", choices=EVAL_DTYPES, keywords=("auto",), default="fp32",
        help="weight dtype; auto: as gqa generate's default (bf16 where native, a GGUF's q8_0/q4_*/q5_* blocks kept)",
    )  # fmt: skip
    parser.add_argument(
        "--quantize",
        choices=sorted(QUANT_FORMATS),
        default=None,
        help="quantize the layers' weights to this block format",
    )
    parser.add_argument(
        "--decode", action="store_true",
        help="score every token through a one-token decode step with a KV cache, as generation runs the model "
        "(slower); a quantized model's int8 decode inputs only show this way",
    )  # fmt: skip
    suite = parser.add_argument_group(
        "suite", "judge a converted chat model against its original (--reference, default the embedded SmolLM2) on "
        "answers and prose: KL on held-out self-generated answers, agreement of greedy answers, the question set, "
        "and perplexity on three genres (both models in fp32; --text, --window, --max-tokens and --dtype do not apply)",
    )  # fmt: skip
    suite.add_argument("--suite", action="store_true", help="run the four measures instead of one perplexity")
    suite.add_argument(
        "--conversations", type=int, default=HELD_OUT_CONVERSATIONS, metavar="N",
        help="held-out conversations to score",
    )  # fmt: skip
    suite.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write the results as JSON")
    suite.add_argument("--show-answers", action="store_true", help="print both models' replies to every question")


def load_text(path: str | None) -> tuple[str, str]:
    """``(text, description)`` of a text file, or of the default evaluation text when ``path`` is ``None``."""
    if path is None:
        from ..evaluation.perplexity import default_eval_text

        return default_eval_text()
    return Path(path).read_text(encoding="utf-8"), path


def model_name(path: str | None) -> str:
    if path is not None:
        return path
    from ..loaders import default_model_path

    return f"{default_model_path().name} (default)"


def run(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> int:
    from ..evaluation.perplexity import check_windows, evaluate
    from ..options.dtypes import DTYPES

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
