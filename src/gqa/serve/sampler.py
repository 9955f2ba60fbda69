"""Tokens for the sampled rows of a step: one ``sample_next`` call per distinct setting, each row inverting its own
request's next uniform number, so a row gets the token it would get alone."""

from __future__ import annotations

import torch

from ..decoding.sampling import sample_next
from .request import Request

__all__ = ["sample_rows"]


def sample_rows(rows: list[tuple[Request, torch.Tensor]]) -> list[int | Exception]:
    """A token for each ``(request, logits (vocab,))`` row. A row that cannot be sampled (NaN logits) gets its
    exception instead; the others are sampled."""
    out: list[int | Exception] = [0] * len(rows)
    settings: dict[tuple, list[int]] = {}
    for i, (r, _) in enumerate(rows):
        settings.setdefault((r.params.temperature, r.params.top_k, r.params.top_p), []).append(i)
    for (temperature, top_k, top_p), idx in settings.items():
        u = torch.cat([torch.rand(1, generator=rows[i][0].generator) for i in idx])  # (n,)
        x = torch.stack([rows[i][1] for i in idx])  # (n, vocab), on the runner's device
        u = u.to(x.device)
        how = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
        try:
            got: list[int | Exception] = sample_next(x, uniforms=u, **how).tolist()
        except Exception:  # a bad row: sample each alone, so only the bad ones fail
            got = []
            for k in range(len(idx)):
                try:
                    got.append(int(sample_next(x[k : k + 1], uniforms=u[k : k + 1], **how)))
                except Exception as e:
                    got.append(e)
        for i, token in zip(idx, got, strict=True):
            out[i] = token
    return out
