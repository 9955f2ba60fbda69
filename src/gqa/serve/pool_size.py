"""The KV pool's default size, chosen from the model (no torch here: the rule alone, tested without a model).

Enough for ``max_running`` sequences of the model's full context — on CPU no more than the weights take, unless one
full-context sequence needs more — and at most a share of the memory available (of the free device memory on CUDA).
The embedded 135M model (8,192-token context, 96 MiB of quantized weights) so gets one full context, 0.18 GiB,
where a quarter of the free memory once gave it 3.2-5.5 GiB (seconds to zero at start, resident from then on); a
model whose weights outweigh a context gets up to their size; ``--kv-cache-mib`` sets any size. Requests beyond the
pool wait, or the latest is preempted (``scheduler``); one that fits the pool alone is never refused.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CPU_MEMORY_SHARE", "DEVICE_MEMORY_SHARE", "PoolSize", "default_pool_size"]

CPU_MEMORY_SHARE = 0.25  # of the memory available now, on CPU
DEVICE_MEMORY_SHARE = 0.5  # of the device memory free now, on CUDA


@dataclass(frozen=True)
class PoolSize:
    """A pool of ``nbytes``, and why that size (for the line ``gqa serve`` prints at start)."""

    nbytes: int
    reason: str


def default_pool_size(
    token_bytes: int, context: int, max_running: int, weight_bytes: int | None, memory: int, share: float
) -> PoolSize:
    """The default pool for a model whose K and V take ``token_bytes`` per token (every layer), ``context`` tokens at
    most per sequence and ``weight_bytes`` of weights, serving ``max_running`` sequences at once, with ``memory``
    bytes available of which it may take ``share``: ``max_running`` full contexts, at most the weights' bytes or one
    full context if that is more (``weight_bytes`` None: no such bound, for a GPU's memory, which serves nothing
    else), at most ``share * memory``."""
    for name, n in (("token_bytes", token_bytes), ("context", context), ("max_running", max_running)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} must be a positive int, got {n!r}")
    if not ((weight_bytes is None or weight_bytes >= 0) and memory >= 0 and 0 < share <= 1):
        raise ValueError(f"weight_bytes and memory must be >= 0 and share in (0, 1], got {weight_bytes}, {memory}, "
                         f"{share}")  # fmt: skip
    full = token_bytes * context
    if weight_bytes is None or max_running * full <= max(full, weight_bytes):
        size, reason = max_running * full, f"default: a full context for each of --max-running {max_running}"
    elif full >= weight_bytes:
        size, reason = full, "default: one full context, which outweighs the weights"
    else:
        size, reason = weight_bytes, "default: the weights' size"
    cap = int(memory * share)
    if size > cap:
        size, reason = cap, f"default: {share:.0%} of the {memory / 2**30:.1f} GiB of memory available"
    return PoolSize(size, reason)
