"""Sampling the next token: greedy, or from the temperature-scaled distribution cut by min-p (the tokens at least
``min_p`` times as likely as the likeliest), to the top-k tokens and then to the nucleus (top-p), each row inverting
its own uniform number, so a row's token depends on its logits and number alone — not on the rows beside it (the
serving engine samples a batch's rows in one call and relies on it)."""

from __future__ import annotations

import math

import torch

__all__ = ["SEED_RANGE", "check_sampling", "sample_next"]

# The seeds torch.Generator.manual_seed takes: [-2**63, 2**64) (a negative seed is taken modulo 2**64)
SEED_RANGE = (-(2**63), 2**64)


def check_sampling(temperature: float, top_k: int | None, top_p: float | None, min_p: float | None = None) -> None:
    """Raise ``ValueError`` for a temperature that is not a finite number >= 0 (NaN included), ``top_k < 1``,
    ``top_p`` outside ``(0, 1]`` or ``min_p`` outside ``[0, 1]``."""
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be an int >= 1, got {top_k!r}")
    if top_p is not None and not 0.0 < top_p <= 1.0:  # NaN fails the comparison too
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if min_p is not None and not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {min_p}")


def sample_next(
    logits: torch.Tensor,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
) -> torch.Tensor:
    """Next tokens ``(B,)`` from ``logits (B, vocab)``: argmax when ``temperature == 0``, else a sample from the
    temperature-scaled distribution restricted to the tokens at least ``min_p`` times as likely as the likeliest one
    (vLLM's and llama.cpp's min-p, applied after the temperature as vLLM does; 0 or ``None``: off), then to the
    ``top_k`` most likely and then to the smallest set whose probability reaches ``top_p``.

    A row's sample inverts its cumulative distribution at its own number of ``uniforms (B,)`` in [0, 1) (drawn from
    ``generator`` when not given): it depends on that row's logits and number alone, not on the rows beside it.

    Raises
    ------
    ValueError : a row whose logits hold a NaN or are all -inf (no distribution to sample from).
    """
    check_sampling(temperature, top_k, top_p, min_p)
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if min_p:  # p < min_p * p_max, i.e. logit < max + log(min_p): out (the likeliest always stays)
        logits = logits.masked_fill(logits < logits.amax(-1, keepdim=True) + math.log(min_p), float("-inf"))
    V = logits.shape[-1]
    limit = V if top_k is None else min(top_k, V)
    if uniforms is None:
        uniforms = torch.rand(logits.shape[:-1], generator=generator, device=logits.device)
    order = None  # candidates in vocabulary order: all of them
    if top_p is not None and top_p < 1.0:
        values, order = _nucleus(logits, top_p, limit)
    elif limit < V:
        values, order = logits.topk(limit, dim=-1)
    else:
        values = logits
    cdf = (values - values.amax(-1, keepdim=True)).exp().cumsum(-1)  # (B, n), unnormalised
    total = cdf[..., -1:]
    if not bool(((total > 0) & (total < math.inf)).all()):  # NaN fails both
        raise ValueError("logits must hold finite values in every row to sample from; got NaN or all -inf")
    target = torch.minimum(uniforms[..., None].to(cdf.dtype) * total, total.nextafter(torch.zeros_like(total)))
    picked = torch.searchsorted(cdf, target, right=True)  # first token whose cumulative mass exceeds the target
    return (picked if order is None else order.gather(-1, picked)).squeeze(-1)


# The most likely tokens looked at first, then, for the rows whose nucleus does not end among them, NUCLEUS_GROWTH times
# as many, and so on: most nuclei are small and a few are very large, so only the rows that need it grow
# (docs/performance.md, "Sampling": the nucleus sizes and the cost of growing every row).
NUCLEUS_CANDIDATES = 128
NUCLEUS_GROWTH = 8


def _nucleus(logits: torch.Tensor, top_p: float, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The nucleus of each row among its ``limit`` most likely tokens (probabilities renormalised over those):
    ``(values, order)``, both ``(B, n)``, the ``n`` largest logits in descending order and their token ids, with -inf
    for the tokens outside the nucleus (a token stays while the tokens before it hold less than ``top_p``) and for
    the padding of rows whose candidates were fewer than ``n``.

    Only the largest logits are sorted (``topk``): ``NUCLEUS_CANDIDATES`` of every row, then ``NUCLEUS_GROWTH``
    times as many of the rows whose nucleus did not end among them, until every row's did: the set a sort of the
    whole vocabulary gives, at a fraction of its cost (sorting 64 x 49,152 logits took as long as a decode step of
    SmolLM2). A row's result does not depend on the rows beside it (its candidates are a prefix of its own order).
    """
    top = logits.topk(limit, dim=-1) if limit < logits.shape[-1] else None  # top-k first: sorted once, sliced below
    log_total = (logits if top is None else top.values).logsumexp(-1, keepdim=True)  # (B, 1)
    rows = torch.arange(logits.shape[0], device=logits.device)
    n = min(NUCLEUS_CANDIDATES, limit)
    parts = []  # (rows, values, order) of the rows settled with n candidates
    while True:
        every = not parts  # the first pass reads every row as it is, without gathering them
        if top is None:
            values, order = (logits if every else logits[rows]).topk(n, dim=-1)
        else:
            values, order = (
                (top.values[:, :n], top.indices[:, :n]) if every else (top.values[rows, :n], top.indices[rows, :n])
            )
        probs = (values - (log_total if every else log_total[rows])).exp()
        reached = probs.cumsum(-1)
        values = values.masked_fill(reached - probs >= top_p, float("-inf"))
        short = (reached[:, -1] < top_p) & (n < limit)  # (rows,) whose nucleus goes on past the n candidates
        if not bool(short.any()):
            parts.append((rows, values, order))
            break
        parts.append((rows[~short], values[~short], order[~short]))
        rows, n = rows[short], min(NUCLEUS_GROWTH * n, limit)
    if len(parts) == 1:
        return parts[0][1], parts[0][2]
    out_values = logits.new_full((logits.shape[0], n), float("-inf"))
    out_order = torch.zeros((logits.shape[0], n), dtype=torch.long, device=logits.device)
    for r, v, o in parts:
        out_values[r, : v.shape[1]] = v
        out_order[r, : o.shape[1]] = o
    return out_values, out_order
