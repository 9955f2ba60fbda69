"""The attention benchmark's workloads and the forms a prefill's causal pattern is given in, by name and without
torch: ``gqa bench attention --help`` offers them, ``cases`` builds its grid from them."""

from __future__ import annotations

__all__ = ["KINDS", "MASKS"]

KINDS = ("decode", "prefill")
MASKS = ("causal", "bool", "additive")  # how the causal pattern of a prefill is given
