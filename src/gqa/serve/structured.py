"""Structured output: a response held to a JSON schema, any JSON object, a regular expression, one of a few strings or
an EBNF grammar, by setting the logits of every token the grammar does not allow next to -inf before the choice.

The grammars are compiled and matched by xgrammar (vLLM's and SGLang's default grammar engine: a token bitmask per
step from a pushdown automaton compiled against the vocabulary). One ``Grammars`` per engine compiles (and caches)
a request's ``StructuredOutput``; each request holds a ``GrammarState`` that masks its logits row and advances with its
tokens — a row's mask depends on its own tokens only, so batching does not change a response.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["KINDS", "GrammarState", "Grammars", "StructuredOutput"]

# What a request can hold its output to; ``spec`` per kind: json_object — none; json_schema — the schema as JSON text;
# regex — a regular expression; choice — the strings allowed; grammar — EBNF (GBNF, as llama.cpp) with a rule "root"
KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")


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
                spec = json.dumps(spec)
            try:
                ok = isinstance(spec, str) and isinstance(json.loads(spec), (dict, bool))
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
    """Compiles ``StructuredOutput``s for one tokenizer and a model's ``vocab_size`` logits (xgrammar, cached), and
    makes the per-request ``GrammarState``; ``stop_token_ids``: the tokens that end a response, the only ones allowed
    once the grammar is complete. Thread-safe: the server compiles while parsing a request, the engine again (from
    the cache) when it takes it."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, sorted(set(stop_token_ids))
        self._compiler = None
        self._lock = threading.Lock()

    def compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                xgr = _xgrammar()
                hf = getattr(self.tokenizer, "hf", self.tokenizer)
                info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids or None)  # fmt: skip
                self._compiler = xgr.GrammarCompiler(info, max_threads=2)
            return self._compiler

    def compile(self, s: StructuredOutput) -> Any:
        """``s`` compiled (an ``xgrammar.CompiledGrammar``); ``ValueError`` naming what is wrong with a spec that does
        not compile (a schema xgrammar cannot take, a bad regular expression, an EBNF syntax error)."""
        c = self.compiler()
        try:
            if s.kind == "json_object":  # any object, as OpenAI's JSON mode (xgrammar's built-in grammar: any value)
                return c.compile_json_schema('{"type": "object"}', strict_mode=False)
            if s.kind == "json_schema":
                return c.compile_json_schema(s.spec)
            if s.kind == "regex":
                return c.compile_regex(s.spec)
            if s.kind == "choice":
                return c.compile_regex("|".join(re.escape(choice) for choice in s.spec))
            return c.compile_grammar(s.spec)
        except Exception as e:  # xgrammar raises RuntimeError/ValueError subclasses with the parser's message
            raise ValueError(f"the {s.kind} does not compile: {e}") from e

    def state(self, s: StructuredOutput, stop_token_ids: Iterable[int] = ()) -> GrammarState:
        """A fresh matcher for one request; ``stop_token_ids``: the request's own, beside the engine's."""
        xgr = _xgrammar()
        stops = sorted(set(self.stop_token_ids) | set(stop_token_ids))
        matcher = xgr.GrammarMatcher(self.compile(s), override_stop_tokens=stops or None)
        return GrammarState(matcher, xgr.allocate_token_bitmask(1, self.vocab_size), xgr.apply_token_bitmask_inplace)


class GrammarState:
    """Where one response is in its grammar: ``mask`` a logits row, ``accept`` the token chosen."""

    def __init__(self, matcher: Any, bitmask: torch.Tensor, apply: Any) -> None:
        self.matcher, self.bitmask, self._apply = matcher, bitmask, apply
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
