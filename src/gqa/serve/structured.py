"""Structured output: a response held to a JSON schema, any JSON object, a regular expression, one of a few strings or
an EBNF grammar, by setting the logits of every token the grammar does not allow next to -inf before the choice.

The grammars are compiled and matched by xgrammar (vLLM's and SGLang's default grammar engine: a token bitmask per
step from a pushdown automaton compiled against the vocabulary). One ``Grammars`` per engine compiles (and caches)
a request's ``StructuredOutput``; each request holds a ``GrammarState`` that masks its logits row and advances with its
tokens — a row's mask depends on its own tokens only, so batching does not change a response.

What is refused before compiling (a ``ValueError``; the server's 400 names the field that asked): a spec longer than
``MAX_SPEC_CHARS`` characters (a schema as JSON text), and a JSON schema with what xgrammar would not enforce or past
its bounds of size (``schema_check``: ``allOf`` of several schemas, ``not``, ``$ref`` outside the schema, ...). The
cache keeps the ``CACHE_GRAMMARS`` most recently used grammars within ``CACHE_BYTES`` (xgrammar's count of their size;
resident memory is ~2.5 times that); one that a request still holds is found there even after the cache dropped it.
The server compiles off its request-parsing threads, bounded in time (``grammar_compiles``).
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .schema_check import check_schema

if TYPE_CHECKING:
    import torch

__all__ = ["CACHE_BYTES", "CACHE_GRAMMARS", "KINDS", "MAX_SPEC_CHARS", "GrammarState", "Grammars", "StructuredOutput"]

# What a request can hold its output to; ``spec`` per kind: json_object — none; json_schema — the schema as JSON text;
# regex — a regular expression; choice — the strings allowed; grammar — EBNF (GBNF, as llama.cpp) with a rule "root"
KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")

MAX_SPEC_CHARS = 128 * 1024  # a spec's text at most (a schema as JSON, a choice's strings together)
CACHE_GRAMMARS = 64  # compiled grammars kept for the next request with the same spec (a small schema's: ~0.2 MiB)
CACHE_BYTES = 32 * 2**20  # and their size at most, as xgrammar counts it


@dataclass(frozen=True)
class StructuredOutput:
    """The shape a response must have (``KINDS``). A schema given as a dict is kept as its JSON text."""

    kind: str
    spec: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {KINDS}, got {self.kind!r}")
        spec = self.spec
        if self.kind == "json_object":
            if spec is not None:
                raise ValueError("json_object takes no spec")
        elif self.kind == "json_schema":
            if isinstance(spec, dict):
                try:
                    spec = json.dumps(spec)
                except RecursionError as e:
                    raise ValueError("json_schema nests too deeply") from e
            try:
                ok = isinstance(spec, str) and isinstance(json.loads(spec), (dict, bool))
            except RecursionError as e:
                raise ValueError("json_schema nests too deeply") from e
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"json_schema needs a JSON schema (an object), got {str(spec)[:80]!r}")
        elif self.kind == "choice":
            spec = tuple(spec) if isinstance(spec, (list, tuple)) else spec
            if not (isinstance(spec, tuple) and spec and all(isinstance(s, str) and s for s in spec)):
                raise ValueError(f"choice needs a list of non-empty strings, got {spec!r}")
        elif not (isinstance(spec, str) and spec):
            raise ValueError(f"{self.kind} needs a non-empty string, got {spec!r}")
        object.__setattr__(self, "spec", spec)


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as e:  # an optional dependency: everything but structured output works without it
        raise ValueError("structured output needs xgrammar: pip install 'gqa[structured]'") from e
    return xgrammar


class Grammars:
    """Compiles ``StructuredOutput``s for one tokenizer and a model's ``vocab_size`` logits (xgrammar), keeps the
    ``cache_grammars`` most recently used within ``cache_bytes``, and makes the per-request ``GrammarState``;
    ``stop_token_ids``: the tokens that end a response, the only ones allowed once the grammar is complete.
    Thread-safe: the server compiles on its own threads, the engine finds the grammar (cached, or held by the request)
    when it takes the request."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int], cache_grammars: int = CACHE_GRAMMARS,
        cache_bytes: int = CACHE_BYTES,
    ) -> None:  # fmt: skip
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, sorted(set(stop_token_ids))
        self.cache_grammars, self.cache_bytes = cache_grammars, cache_bytes
        self._compiler = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[StructuredOutput, tuple[Any, int]] = OrderedDict()  # least recently used first
        self._cached_bytes = 0
        self._held: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # every grammar still referenced

    @property
    def cached(self) -> tuple[int, int]:
        """``(grammars, bytes)`` in the cache."""
        with self._lock:
            return len(self._cache), self._cached_bytes

    def compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                xgr = _xgrammar()
                hf = getattr(self.tokenizer, "hf", self.tokenizer)
                info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids or None)  # fmt: skip
                # xgrammar's own cache never lets go of a grammar: this class keeps a bounded one instead
                self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
            return self._compiler

    def check(self, s: StructuredOutput) -> None:
        """``ValueError`` for a spec refused before compiling: longer than ``MAX_SPEC_CHARS``, or a JSON schema
        ``schema_check`` refuses (cheap: no compile)."""
        text = "".join(s.spec) if s.kind == "choice" else s.spec or ""
        if len(text) > MAX_SPEC_CHARS:
            raise ValueError(f"the {s.kind} is {len(text)} characters long, more than the {MAX_SPEC_CHARS} allowed")
        if s.kind == "json_schema":
            try:
                check_schema(json.loads(s.spec))
            except ValueError as e:
                raise ValueError(f"the json_schema is refused: {e}") from e

    def find(self, s: StructuredOutput) -> Any | None:
        """``s`` compiled, from the cache or a request that holds it; ``None`` where it must be compiled."""
        with self._lock:
            if s in self._cache:
                self._cache.move_to_end(s)
                return self._cache[s][0]
            grammar = self._held.get(s)
            if grammar is not None:
                self._keep(s, grammar)
            return grammar

    def compile(self, s: StructuredOutput) -> Any:
        """``s`` compiled (an ``xgrammar.CompiledGrammar``, found where it was compiled before); ``ValueError`` naming
        what is wrong with a spec that ``check`` refuses or that does not compile (a schema xgrammar cannot take, a
        bad regular expression, an EBNF syntax error)."""
        grammar = self.find(s)
        if grammar is not None:
            return grammar
        self.check(s)
        c = self.compiler()
        try:
            if s.kind == "json_object":  # any object, as OpenAI's JSON mode (xgrammar's built-in grammar: any value)
                grammar = c.compile_json_schema('{"type": "object"}', strict_mode=False)
            elif s.kind == "json_schema":
                grammar = c.compile_json_schema(s.spec)
            elif s.kind == "regex":
                grammar = c.compile_regex(s.spec)
            elif s.kind == "choice":
                grammar = c.compile_regex("|".join(re.escape(choice) for choice in s.spec))
            else:
                grammar = c.compile_grammar(s.spec)
        except Exception as e:  # xgrammar raises RuntimeError/ValueError subclasses with the parser's message
            raise ValueError(f"the {s.kind} does not compile: {e}") from e
        with self._lock:
            self._held[s] = grammar
            self._keep(s, grammar)
        return grammar

    def _keep(self, s: StructuredOutput, grammar: Any) -> None:
        """Cache ``grammar`` as the most recently used, dropping the least recently used past the bounds (a grammar
        larger than ``cache_bytes`` alone is not cached). Under the lock."""
        if s in self._cache:  # two threads compiled it at once
            self._cached_bytes -= self._cache.pop(s)[1]
        size = grammar.memory_size_bytes
        if size > self.cache_bytes:
            return
        self._cache[s] = (grammar, size)
        self._cached_bytes += size
        while len(self._cache) > self.cache_grammars or self._cached_bytes > self.cache_bytes:
            self._cached_bytes -= self._cache.popitem(last=False)[1][1]

    def state(self, s: StructuredOutput, stop_token_ids: Iterable[int] = ()) -> GrammarState:
        """A fresh matcher for one request; ``stop_token_ids``: the request's own, beside the engine's."""
        xgr = _xgrammar()
        stops = sorted(set(self.stop_token_ids) | set(stop_token_ids))
        grammar = self.compile(s)
        matcher = xgr.GrammarMatcher(grammar, override_stop_tokens=stops or None)
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        return GrammarState(matcher, bitmask, xgr.apply_token_bitmask_inplace, grammar)


class GrammarState:
    """Where one response is in its grammar: ``mask`` a logits row, ``accept`` the token chosen."""

    def __init__(self, matcher: Any, bitmask: torch.Tensor, apply: Any, grammar: Any = None) -> None:
        self.matcher, self.bitmask, self._apply = matcher, bitmask, apply
        self.grammar = grammar  # the compiled grammar, held while the request runs (``Grammars.find`` sees it)
        self._filled = False  # whether the bitmask holds the next token's mask

    def _fill(self) -> None:
        if not self._filled:
            self.matcher.fill_next_token_bitmask(self.bitmask)
            self._filled = True

    def allows(self, token: int) -> bool:
        """Whether the grammar allows ``token`` next (bit ``token`` of the mask)."""
        self._fill()
        return bool((int(self.bitmask[0, token >> 5]) >> (token & 31)) & 1)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits (vocab,)`` in float32 with every token the grammar does not allow next at -inf (in place;
        returned)."""
        self._fill()
        self._apply(logits, self.bitmask[0].to(logits.device))
        return logits

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False when the grammar does not allow it (then nothing changes)."""
        self._filled = False
        return bool(self.matcher.accept_token(token))

    @property
    def complete(self) -> bool:
        """Whether a stop token has been accepted: nothing more may follow."""
        return bool(self.matcher.is_terminated())
