"""Tokens for the sampled rows of a step: one ``sample_next`` call per distinct setting, each row inverting its own
request's next uniform number, so a row gets the token it would get alone."""

from __future__ import annotations

import math
from collections.abc import Collection

import torch

from ..decoding.sampling import sample_next
from .request import Request, TokenLogprob

__all__ = ["LOGPROB_FLOOR", "adjusted", "sample_rows", "token_logprob"]

LOGPROB_FLOOR = -9999.0  # OpenAI's logprob for "very unlikely": JSON has no -inf (vLLM clamps to it too)


def adjusted(r: Request, logits: torch.Tensor, eos: Collection[int] = ()) -> torch.Tensor:
    """``logits (vocab,)`` as ``r`` chooses from them, in float32 (a copy): its grammar's mask, ``min_tokens``' ban
    on the end-of-sequence tokens ``eos`` and its stop token ids (unless the grammar allows nothing else), the
    penalties and the bias (``SamplingParams``)."""
    p, x = r.params, logits.float().clone()
    if r.grammar is not None:
        r.grammar.mask(x)
    if len(r.outputs) < p.min_tokens:
        ends = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos))
        banned = torch.tensor(sorted(t for t in ends if t < x.shape[0]), dtype=torch.long, device=x.device)
        rest = torch.isfinite(x)
        rest[banned] = False
        if rest.any():
            x[banned] = -torch.inf
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(r.tokens)), dtype=torch.long, device=x.device)
        v = x[seen]
        x[seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
    if p.frequency_penalty or p.presence_penalty:
        out = torch.tensor(r.tokens[len(r.prompt) :], dtype=torch.long, device=x.device)
        counts = torch.bincount(out, minlength=x.shape[0])[: x.shape[0]].to(x.dtype)
        x -= counts * p.frequency_penalty + (counts > 0).to(x.dtype) * p.presence_penalty
    for token, bias in p.logit_bias:
        if token < x.shape[0]:
            x[token] += bias
    return x


def token_logprob(r: Request, logits: torch.Tensor, token: int) -> TokenLogprob:
    """``token``'s log-probability under the distribution ``r`` chose it from (``SamplingParams.logprobs``) and the
    ``r.params.logprobs`` most likely tokens', from its ``logits (vocab,)`` row (``adjusted`` where the request
    adjusts them) alone: batch-invariant. Tokens the distribution excludes (a grammar's mask: -inf) are not
    alternatives, so fewer may be listed; a logprob is never below ``LOGPROB_FLOOR``."""
    p, x = r.params, logits.float()
    if not p.greedy:
        x = x / p.temperature
    lp = torch.log_softmax(x, dim=-1)
    alternatives: tuple[tuple[int, float], ...] = ()
    if p.logprobs:
        top = lp.topk(p.logprobs)
        pairs = zip(top.indices.tolist(), top.values.tolist(), strict=True)
        alternatives = tuple((t, v) for t, v in pairs if v != -math.inf)
    return token, max(float(lp[token]), LOGPROB_FLOOR), alternatives


def sample_rows(rows: list[tuple[Request, torch.Tensor]]) -> list[int | Exception]:
    """A token for each ``(request, logits (vocab,))`` row (``adjusted`` where the request adjusts them). A row that
    cannot be sampled (NaN logits) gets its exception instead; the others are sampled."""
    out: list[int | Exception] = [0] * len(rows)
    settings: dict[tuple, list[int]] = {}
    for i, (r, _) in enumerate(rows):
        settings.setdefault((r.params.temperature, r.params.top_k, r.params.top_p, r.params.min_p), []).append(i)
    for (temperature, top_k, top_p, min_p), idx in settings.items():
        x = torch.stack([rows[i][1] for i in idx])  # (n, vocab), on the runner's device
        u = None  # greedy rows (here for their penalties) draw nothing
        if temperature > 0:
            u = torch.cat([torch.rand(1, generator=rows[i][0].generator) for i in idx]).to(x.device)  # (n,)
        how = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p}
        try:
            got: list[int | Exception] = sample_next(x, uniforms=u, **how).tolist()
        except Exception:  # a bad row: sample each alone, so only the bad ones fail
            got = []
            for k in range(len(idx)):
                try:
                    got.append(int(sample_next(x[k : k + 1], uniforms=None if u is None else u[k : k + 1], **how)))
                except Exception as e:
                    got.append(e)
        for i, token in zip(idx, got, strict=True):
            out[i] = token
    return out
