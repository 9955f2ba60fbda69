"""The log-probabilities of a prompt's own tokens (completions' ``echo`` with ``logprobs``; ``max_tokens: 0`` scores
a text without generating, as evaluation harnesses ask): each token's log-softmax under the model given the tokens
before it, with its ``top`` alternatives; the first token has none. The model's eager forward over the prompt in
chunks of ``CHUNK`` tokens with a cache, so the logits held at once are ``CHUNK x vocab``, whatever the prompt's
length. Runs in the engine thread (``AsyncEngine.run_in_engine``), between steps."""

from __future__ import annotations

import torch

CHUNK = 256
PromptLogprob = tuple[int, float | None, tuple[tuple[int, float], ...] | None]  # the first token's: (id, None, None)


@torch.inference_mode()
def prompt_logprobs(model: torch.nn.Module, ids: list[int], top: int) -> list[PromptLogprob]:
    """``(token, logprob, alternatives)`` for every token of ``ids``: ``(ids[0], None, None)``, then for ``ids[i]``
    its log-probability after ``ids[:i]`` and the ``top`` likeliest tokens there as ``(token, logprob)``, most likely
    first."""
    entries: list[PromptLogprob] = [(ids[0], None, None)]
    if len(ids) == 1:
        return entries
    caches = model.new_caches(1, len(ids) - 1)
    for s in range(0, len(ids) - 1, CHUNK):  # positions s .. e - 1 predict tokens s + 1 .. e
        e = min(s + CHUNK, len(ids) - 1)
        logits = model(torch.tensor([ids[s:e]], device=model.device), caches=caches)[0].float()  # (e - s, vocab)
        logprobs = torch.log_softmax(logits, -1)
        following = torch.tensor(ids[s + 1 : e + 1], device=logprobs.device)
        chosen = logprobs.gather(-1, following[:, None])[:, 0].tolist()
        values, tokens = logprobs.topk(top, -1) if top else (logprobs[:, :0], logprobs[:, :0].long())
        for j, (token, logprob) in enumerate(zip(ids[s + 1 : e + 1], chosen, strict=True)):
            entries.append((token, logprob, tuple(zip(tokens[j].tolist(), values[j].tolist(), strict=True))))
    return entries
