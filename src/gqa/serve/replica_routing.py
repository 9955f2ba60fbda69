"""Which replica serves a request: the one most likely to hold its prompt's prefix in its prefix cache, else the least
loaded (what SGLang's cache-aware router and vLLM's production router do), or plain round-robin / least-loaded.

The front has no tokenizer and no model: a request's prompt is taken as text (``prompt_text``: the request body's
prompt-defining fields, serialized in order, so a conversation that grows keeps the earlier turns' text as a prefix),
cut into ``CHUNK_CHARS``-character chunks, each chunk's key a hash chained over the chunks before it (as the engine's
block hashes are chained over the blocks before). Each replica remembers the chunk keys of the prompts sent to it, the
least recently used forgotten past what its KV pool holds (``set_capacity``: its token slots at ``CHARS_PER_TOKEN``),
as its own prefix cache forgets them; a request's match on a replica is the number of its leading chunk keys that
replica holds.

    router = ReplicaRouter(2, policy="prefix")
    i = router.pick(chunk_keys(prompt_text(path, body)))   # replica index; router.sent(i, keys) is done by pick
    ...                                                     # the request runs on replica i
    router.done(i)

Prefix routing (SGLang's cache-aware policy, simplified): a prompt whose longest match covers at least ``min_share``
of its chunks goes to the replica holding that match, unless that replica is overloaded — its load (requests sent and
not yet done) above both twice the least loaded one's and the least plus ``balance_slack`` — and then to the least
loaded. A prompt no replica holds goes, while no replica is overloaded, to the one holding the fewest chunk keys (new
prefixes spread the cached text: a burst of requests placed by load alone gave one replica three of four prefixes),
else to the least loaded; a prompt shorter than a chunk goes to the least loaded, ties to the one sent fewer
requests. Keeping a prefix's requests together lets one replica's pool hold it while the other holds others; the
balance bound keeps a popular prefix from swamping its replica. Replicas marked down are never picked.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["BALANCE_SLACK", "CHARS_PER_TOKEN", "CHUNK_CHARS", "POLICIES", "ReplicaRouter", "chunk_keys", "prompt_text"]

CHUNK_CHARS = 64  # ~16 tokens of English: about one KV block of the default --block-size
POLICIES = ("prefix", "least-loaded", "round-robin")
MAX_KEYS = 1 << 16  # chunk keys remembered per replica until its capacity is known (~4 MiB of text's worth)
CHARS_PER_TOKEN = 4.0  # English text in a BPE vocabulary: what a pool of N token slots holds is ~4N characters
# How far a prefix's holder may run ahead of the least loaded replica (requests) before its prefix's requests go
# elsewhere. 2 broke affinity whenever 16 clients' random prefixes fell 11:5 between two replicas: each break copies a
# ~400-token prefix into the other pool, evicting what that pool held (hit rate 0.72 against 0.90 with 8 on the
# shared-prefix workload at 64 MiB; docs/performance.md). SGLang's router waits for an absolute gap of 32-64.
BALANCE_SLACK = 8

# the body fields that make a prompt, in the order they are rendered into it (tools and system first, as chat
# templates put them; then the turns)
_PROMPT_FIELDS = ("model", "tools", "instructions", "system", "messages", "input", "prompt")


def prompt_text(body: dict) -> str:
    """The text a request's prompt is made of: ``model``, ``tools``, ``instructions``, ``system``, then each message
    / input item / prompt, each serialized on a line of its own (keys sorted), so that a request extending an earlier
    one's conversation starts with the earlier one's text."""
    parts = []
    for name in _PROMPT_FIELDS:
        value = body.get(name)
        if value is None:
            continue
        items = value if name in ("messages", "input") and isinstance(value, list) else [value]
        parts += [f"{name}:{json.dumps(item, sort_keys=True, ensure_ascii=False)}\n" for item in items]
    return "".join(parts)


def chunk_keys(text: str, chunk: int = CHUNK_CHARS) -> list[bytes]:
    """One key per whole ``chunk``-character chunk of ``text``, each hashing its chunk and the key before (a chunk's
    key says its whole prefix)."""
    keys, previous = [], b""
    for start in range(0, len(text) - chunk + 1, chunk):
        previous = hashlib.blake2b(previous + text[start : start + chunk].encode(), digest_size=12).digest()
        keys.append(previous)
    return keys


class ReplicaRouter:
    """Picks a replica for each request (module docstring) and counts why."""

    def __init__(
        self, replicas: int, policy: str = "prefix", *, min_share: float = 0.5, balance_slack: int = BALANCE_SLACK,
        max_keys: int = MAX_KEYS,
    ) -> None:  # fmt: skip
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy, self.min_share, self.balance_slack = policy, min_share, balance_slack
        self.max_keys = [max_keys] * replicas
        self.load = [0] * replicas  # requests sent and not done
        self.sent_total = [0] * replicas
        self.by_prefix = [0] * replicas  # requests sent there because it held at least min_share of their prompt
        self.up = [True] * replicas
        self._keys: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(replicas)]
        self._next = 0

    def pick(self, keys: Sequence[bytes] = ()) -> int:
        """The replica for a request whose prompt has chunk ``keys``; counts it as sent there (``done`` when it
        ends) and remembers its keys there. ``RuntimeError`` when every replica is down."""
        live = [i for i, up in enumerate(self.up) if up]
        if not live:
            raise RuntimeError("no replica is up")
        choice, matched = None, 0
        if self.policy == "round-robin":
            while not self.up[self._next % len(self.up)]:
                self._next += 1
            choice, self._next = self._next % len(self.up), self._next + 1
        elif self.policy == "prefix" and keys:
            best = max(live, key=lambda i: (self.matched(i, keys), -self.load[i]))
            matched = self.matched(best, keys)
            lightest, heaviest = min(self.load[i] for i in live), max(self.load[i] for i in live)
            if matched >= self.min_share * len(keys) and not self._overloaded(self.load[best], lightest):
                choice = best
            else:
                matched = 0
                if not self._overloaded(heaviest, lightest):  # balanced: a new prefix where the least text is cached
                    choice = min(live, key=lambda i: (len(self._keys[i]), self.load[i], self.sent_total[i], i))
        if choice is None:  # the least loaded; ties: where the least text is cached (where fewest were sent)
            spread = (lambda i: len(self._keys[i])) if keys else (lambda i: self.sent_total[i])
            choice = min(live, key=lambda i: (self.load[i], spread(i), self.sent_total[i], i))
        self.load[choice] += 1
        self.sent_total[choice] += 1
        self.by_prefix[choice] += bool(matched)
        self._remember(choice, keys)
        return choice

    def _overloaded(self, load: int, lightest: int) -> bool:
        """A replica with ``load`` requests is too far ahead of the least loaded one (``lightest``) to take more."""
        return load > max(2 * lightest, lightest + self.balance_slack)

    def done(self, replica: int) -> None:
        """A request sent to ``replica`` has ended (answered, failed or cancelled)."""
        self.load[replica] -= 1

    def down(self, replica: int) -> None:
        """``replica`` is gone: never picked again, what it held forgotten."""
        self.up[replica] = False
        self._keys[replica].clear()

    def set_capacity(self, replica: int, tokens: int) -> None:
        """``replica``'s KV pool holds ``tokens`` token slots: remember as many chunk keys as that much text makes."""
        self.max_keys[replica] = max(1, int(tokens * CHARS_PER_TOKEN / CHUNK_CHARS))
        self._remember(replica, ())

    def matched(self, replica: int, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, ``replica`` holds."""
        held, n = self._keys[replica], 0
        for key in keys:
            if key not in held:
                break
            n += 1
        return n

    def _remember(self, replica: int, keys: Sequence[bytes]) -> None:
        held = self._keys[replica]
        for key in keys:
            held[key] = None
            held.move_to_end(key)
        while len(held) > self.max_keys[replica]:
            held.popitem(last=False)
