"""Perplexity and KL divergence of a causal LM on a text: sliding windows, float64 sums, nothing downloaded.

The windows are HF transformers' "strided" perplexity (docs: *Perplexity of fixed-length models*): windows of up
to ``window`` tokens start every ``stride`` tokens, and each window scores only the tokens the previous window did
not, so every token but the first is predicted exactly once, with at least ``window - stride`` tokens of context
(fewer near the start). ``window >= len(ids)`` is one full-sequence forward.
"""

from __future__ import annotations

import math
import platform
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..decoding.steps import select_step
from ..options.defaults import DEFAULT_WINDOW


@dataclass(frozen=True)
class EvalResult:
    """What ``evaluate`` measured.

    Attributes
    ----------
    perplexity : ``exp(mean next-token negative log-likelihood)`` over the predicted tokens.
    tokens : length of the evaluated token sequence (after ``max_tokens``).
    kl : mean ``KL(reference || model)`` in nats per predicted token, or ``None`` without a reference.
    """

    perplexity: float
    tokens: int
    kl: float | None = None


def default_eval_text() -> tuple[str, str]:
    """CPython's ``LICENSE.txt``, shipped in the standard library folder: ``(text, description)``.

    Why this text: it is English prose (a history of Python's releases, then the licence terms), about 3,800
    SmolLM2 tokens; it is on every machine with a CPython build from python.org, pyenv, conda or uv, so nothing is
    downloaded; its wording barely changes between Python versions, so perplexities stay comparable; and it is
    plain text, not a chat transcript, so it measures language modelling rather than the chat format.
    Caveat: licence texts are repeated all over the web and very likely in any model's pre-training data, so
    the absolute perplexity is optimistic; use it to compare variants of one model (dtype, quantization,
    attention backend), not models trained on different data. Pass your own text (``gqa eval --text FILE``) for
    anything else.

    Raises
    ------
    FileNotFoundError: the Python installation has no ``LICENSE.txt`` (some Linux distributions move or drop it).
    """
    candidates = [
        Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt",  # POSIX: <prefix>/lib/pythonX.Y/LICENSE.txt
        Path(sys.base_prefix) / "LICENSE.txt",  # Windows
    ]
    for path in candidates:
        if path.is_file():
            return path.read_text(encoding="utf-8"), f"CPython {platform.python_version()} LICENSE.txt ({path})"
    raise FileNotFoundError(
        f"the default evaluation text, CPython's LICENSE.txt, is not in this Python installation "
        f"(looked at {', '.join(map(str, candidates))}); pass a text file instead (gqa eval --text FILE)"
    )


def sliding_windows(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """The windows over ``n`` tokens as ``(begin, first, end)``: feed ``ids[begin:end]``, score ``ids[first:end]``.

    Every position in ``1 .. n-1`` is scored exactly once (position 0 has no prediction), except that with
    ``stride == window`` (disjoint windows) the first token of each window has no context and is skipped too.
    """
    spans, prev_end = [], 0
    for begin in range(0, n, stride):
        end = min(begin + window, n)
        first = max(prev_end, begin + 1)
        if first < end:
            spans.append((begin, first, end))
        prev_end = end
        if end == n:
            break
    return spans


def check_windows(window: int, stride: int | None) -> int:
    """Validate ``window`` and ``stride`` (``None`` -> ``window // 2``) and return the stride."""
    if window < 2:
        raise ValueError(f"window must be >= 2 tokens (one to read, one to predict), got {window}")
    stride = window // 2 if stride is None else stride
    if not 1 <= stride <= window:
        raise ValueError(f"stride must be in [1, window={window}], got {stride}")
    return stride


def _as_ids(ids: list[int] | torch.Tensor) -> torch.Tensor:
    ids = torch.as_tensor(ids, dtype=torch.long, device="cpu")  # fed to each model on its device
    if ids.dim() != 1 or ids.numel() < 2:
        raise ValueError(f"ids must be a 1-D sequence of at least 2 token ids, got shape {tuple(ids.shape)}")
    return ids


def _check_context(model: nn.Module, n: int, window: int) -> None:
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if context is not None and min(window, n) > context:
        raise ValueError(f"window ({window}) exceeds the model's context of {context} tokens")


def _next_token_log_probs(
    model: nn.Module, ids: torch.Tensor, spans: list[tuple[int, int, int]]
) -> Iterator[torch.Tensor]:
    """Per window, float64 log-probabilities ``(T, vocab)`` of the next token at the positions predicting
    ``ids[first:end]``; a model loaded with a ``kv_dtype`` runs each window through such a cache (its K/V stored,
    then attended to, as llama.cpp's perplexity does with ``-ctk`` / ``-ctv``)."""
    device = next(model.parameters()).device
    cached = getattr(model, "kv_dtype", "auto") not in ("auto", None)  # a chosen KV cache type: run through it
    for begin, first, end in spans:
        caches = model.new_caches(1, end - begin) if cached else None
        logits = model(ids[None, begin:end].to(device), caches=caches)[0]  # (L, vocab), L = end - begin
        yield logits[first - 1 - begin : end - 1 - begin].double().log_softmax(-1).cpu()  # (T, vocab)


def _next_token_log_probs_decoded(
    model: nn.Module, ids: torch.Tensor, spans: list[tuple[int, int, int]]
) -> Iterator[torch.Tensor]:
    """As ``_next_token_log_probs``, but each scored position comes from a one-token decode step through a KV cache
    (the path generation takes: on CPU the native step, with its int8 inputs for quantized weights); the tokens of a
    window before its first scored position are one prefill."""
    device = next(model.parameters()).device
    for begin, first, end in spans:
        window = ids[begin:end].to(device)
        caches = model.new_caches(1, end - begin)
        head = first - 1 - begin  # tokens before the first one whose logits are scored
        if head > 0:
            model(window[None, :head], caches=caches, last_only=True)
        step = select_step(model, caches)
        rows = [step(window[None, t : t + 1], caches)[0, -1] for t in range(head, end - 1 - begin)]
        yield torch.stack(rows).double().log_softmax(-1).cpu()  # (T, vocab)


@torch.inference_mode()
def _score(
    model: nn.Module,
    ids: torch.Tensor,
    window: int,
    stride: int | None,
    reference: nn.Module | None = None,
    decode: bool = False,
) -> tuple[float, float, int]:
    """``(sum of next-token NLLs, sum of KL(reference || model), scored tokens)`` in one pass over the windows;
    ``decode``: the model's log-probabilities from one-token decode steps (``_next_token_log_probs_decoded``)."""
    stride = check_windows(window, stride)
    ids = _as_ids(ids)
    for m in (model, reference):
        if m is not None:
            _check_context(m, len(ids), window)
    spans = sliding_windows(len(ids), window, stride)
    nll = kl = 0.0
    count = sum(end - first for _, first, end in spans)
    ref_log_probs = _next_token_log_probs(reference, ids, spans) if reference is not None else None
    scored = (_next_token_log_probs_decoded if decode else _next_token_log_probs)(model, ids, spans)
    for (_, first, end), log_q in zip(spans, scored, strict=True):
        nll -= log_q.gather(-1, ids[first:end, None]).sum().item()
        if ref_log_probs is not None:
            log_p = next(ref_log_probs)
            if log_p.shape != log_q.shape:
                raise ValueError(
                    f"model and reference vocabularies differ: {log_q.shape[-1]} vs {log_p.shape[-1]} tokens"
                )
            kl += F.kl_div(log_q, log_p, log_target=True, reduction="sum").item()  # sum p (log p - log q)
    return nll, kl, count


def perplexity(
    model: nn.Module, ids: list[int] | torch.Tensor, *, window: int = DEFAULT_WINDOW, stride: int | None = None
) -> float:
    """Sliding-window perplexity of ``model`` on the token ids ``ids``.

    Parameters
    ----------
    model : ``model(input_ids (1, L)) -> logits (1, L, vocab)``.
    ids : ``(N,)`` token ids, ``N >= 2``.
    window : tokens per forward pass (at most the model's context).
    stride : tokens between window starts, in ``[1, window]``; default ``window // 2``.

    Returns
    -------
    float: ``exp(mean of -log p(ids[t] | ids[begin:t]))`` over the scored ``t`` (all of ``1 .. N-1`` when
    ``stride < window``), accumulated in float64.
    """
    nll, _, count = _score(model, ids, window, stride)
    return math.exp(nll / count)


def mean_kl(
    model: nn.Module,
    reference: nn.Module,
    ids: list[int] | torch.Tensor,
    *,
    window: int = DEFAULT_WINDOW,
    stride: int | None = None,
) -> float:
    """Mean over predicted positions of ``KL(reference || model)`` between next-token distributions, in nats.

    Parameters
    ----------
    model : the model under test, ``model(input_ids (1, L)) -> logits (1, L, vocab)``.
    reference : the model taken as the truth, with the same vocabulary (and tokenizer) as ``model``.
    ids, window, stride : as in ``perplexity``; both models see the same windows.

    Returns
    -------
    float: ``mean_t sum_v p(v) (log p(v) - log q(v))`` with ``p`` the reference's and ``q`` the model's next-token
    distribution at position ``t``, accumulated in float64; ``0`` when the two agree, ``> 0`` otherwise.
    """
    _, kl, count = _score(model, ids, window, stride, reference)
    return kl / count


def evaluate(
    model_path: str | Path | None,
    text: str,
    *,
    reference_path: str | Path | None = None,
    window: int = DEFAULT_WINDOW,
    stride: int | None = None,
    max_tokens: int | None = None,
    dtype: torch.dtype | str = torch.float32,
    quantize: str | None = None,
    decode: bool = False,
) -> EvalResult:
    """Load a model, tokenize ``text`` with its tokenizer, and measure perplexity (and KL against a reference).

    Parameters
    ----------
    model_path : GGUF file or HF directory; ``None`` is the embedded SmolLM2-135M-Instruct.
    text : the text, encoded with the tokenizer's default special tokens (as HF's perplexity recipe does).
    reference_path : a model with the same vocabulary, loaded in float32; adds ``kl`` to the result.
    window, stride : see ``perplexity``.
    max_tokens : evaluate only the first ``max_tokens`` tokens (``>= 2``).
    dtype, quantize : as in ``gqa.load_model`` (``"auto"`` keeps a GGUF's quantized blocks).
    decode : score each token through a one-token decode step with a KV cache, the path generation takes (slower:
        one step per token), instead of window forwards; what a quantized model's int8 decode inputs change shows
        only this way.
    """
    check_windows(window, stride)  # fail before the slow loading
    if max_tokens is not None and max_tokens < 2:
        raise ValueError(f"max_tokens must be >= 2, got {max_tokens}")
    from ..loaders.model import load_model

    model = load_model(model_path, dtype=dtype, quantize=quantize)
    ids = model.tokenizer.encode(text)[:max_tokens]
    if len(ids) < 2:
        raise ValueError(f"the text is {len(ids)} token(s) long; at least 2 are needed")
    # the KL reference in float32 whatever ``dtype`` is: the divergence measured is the model's, not the reference's
    reference = None if reference_path is None else load_model(reference_path, tokenizer=False, dtype=torch.float32)
    nll, kl, count = _score(model, _as_ids(ids), window, stride, reference, decode=decode)
    return EvalResult(math.exp(nll / count), len(ids), None if reference is None else kl / count)
