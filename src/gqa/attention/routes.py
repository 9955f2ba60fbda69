"""Routes: ``grouped_attention``'s checks and backend choice, made once per call signature and remembered.

An eager attention call on a GPU is a few microseconds of kernel and tens of microseconds of Python: validating the
inputs, choosing a backend and shaping its arguments cost more than the kernel launch itself, so a call that wraps
SDPA would lose to calling SDPA. Both depend only on what a call *is* — each tensor's type, shape, strides, dtype,
device and ``requires_grad``, the mask's, whether grad mode is on, the scalar arguments — never on the values in the
tensors. ``signature`` packs exactly that into a hashable key; the first call with a key validates and chooses as
before and stores a ``Route``; later calls with the same key go straight to the prepared backend call.

A route is only ever stored after its call passed every check, so an invalid call never hits the cache: it takes the
slow path and raises there, every time. Scalars are keyed with their types (``is_causal=1`` and ``True`` hash alike
but only one is valid). ``clear_routes()`` forgets every route (tests that change the policy call it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

Signature = tuple
MAX_ROUTES = 4096  # distinct call signatures kept; past this the table starts over (shapes that never repeat)


@dataclass(frozen=True)
class Route:
    """A checked call: the backend ``auto`` resolved to, and ``call(query, key, value, attn_mask)`` running it with
    every other argument bound, returning what ``grouped_attention`` returns."""

    backend: str
    call: Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]]


_routes: dict[Signature, Route] = {}


def _tensor_key(t: torch.Tensor) -> tuple:
    return type(t), t.shape, t.stride(), t.dtype, t.device, t.requires_grad


def signature(
    query: object,
    key: object,
    value: object,
    attn_mask: object,
    dropout_p: object,
    is_causal: object,
    scale: object,
    return_weights: object,
    backend: object,
) -> Signature | None:
    """The hashable key of a call (module docstring), or ``None`` for arguments that are not tensors where tensors
    are due (such a call takes the slow path, which says what is wrong)."""
    try:
        mask = None if attn_mask is None else _tensor_key(attn_mask)
        return (
            _tensor_key(query),
            _tensor_key(key),
            _tensor_key(value),
            mask,
            torch.is_grad_enabled(),
            type(dropout_p),
            dropout_p,
            type(is_causal),
            is_causal,
            type(scale),
            scale,
            return_weights,
            backend,
        )
    except (AttributeError, TypeError):  # not a tensor (no .stride), or an unhashable scalar
        return None


def find_route(sig: Signature | None) -> Route | None:
    if sig is None:
        return None
    try:
        return _routes.get(sig)
    except TypeError:  # an unhashable argument (a list for a scalar): the slow path refuses it
        return None


def remember_route(sig: Signature | None, route: Route) -> None:
    if sig is None:
        return
    if len(_routes) >= MAX_ROUTES:
        _routes.clear()
    with contextlib.suppress(TypeError):  # an unhashable argument: not remembered
        _routes[sig] = route


def clear_routes() -> None:
    """Forget every remembered route: the next call of each signature is checked and routed again."""
    _routes.clear()


def route_count() -> int:
    """How many call signatures have a route (for tests and ``gqa bench``)."""
    return len(_routes)
