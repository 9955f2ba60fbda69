"""Structured output on the real SmolLM2 weights: every answer is checked by an independent judge — ``jsonschema`` for
JSON schemas, Python's ``json`` and ``re.fullmatch`` — greedy and sampled (a sampled 135M model leaves any format at
once unless the mask holds it), in a batch and alone."""

from __future__ import annotations

import gc
import json
import re

import pytest
import torch

from gqa import kernels
from gqa.serve import LLM, SamplingParams
from gqa.serve.engine import EngineError
from gqa.serve.structured import StructuredOutput

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")
pytestmark = pytest.mark.skipif(not kernels.vectorized(), reason="native SIMD kernels not built on this machine")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colours": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age", "colours"],
}
ASK = "Describe Ann, aged 31, who likes red and blue, as JSON."


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_mib=64, block_size=16)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_answers_validate_greedy_and_sampled(llm, temperature):
    """Six answers (seeded when sampled) all end by the grammar ("stop", not "length") and validate against the schema;
    the greedy one without the grammar is no such JSON (the test can fail)."""
    s = StructuredOutput("json_schema", PERSON)
    params = [SamplingParams(max_tokens=128, temperature=temperature, seed=i, structured=s) for i in range(6)]
    for c in llm.generate([ASK] * 6, params, chat=True):
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), PERSON)
    free = llm.generate([ASK], SamplingParams(max_tokens=96), chat=True)[0].text
    with pytest.raises((ValueError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(free), PERSON)


def test_json_object_regex_choice_and_grammar(llm):
    """Each kind, greedy and sampled: a phone-number regex (``re.fullmatch``), one of three strings and an EBNF grammar
    (a list of yes/no words) bound the answer, so every one ends by the grammar; any JSON object does not (a sampled
    135M model may write keys until ``max_tokens``): each that ends by the grammar parses, and most do."""
    bounded = [
        (StructuredOutput("regex", r"\d{3}-\d{4}"), lambda t: re.fullmatch(r"\d{3}-\d{4}", t)),
        (StructuredOutput("choice", ["red", "green", "blue"]), lambda t: t in ("red", "green", "blue")),
        (StructuredOutput("grammar", 'root ::= word (", " word){0,3}\nword ::= "yes" | "no"'),
         lambda t: re.fullmatch(r"(yes|no)(, (yes|no)){0,3}", t)),
    ]  # fmt: skip
    for s, ok in bounded:
        params = [SamplingParams(max_tokens=64, temperature=t, seed=i, structured=s) for t, i in [(0, 0), (1.5, 1)]]
        for c in llm.generate([ASK, ASK], params, chat=True):
            assert c.finish_reason == "stop" and ok(c.text), (s.kind, c.text)
    # (a question with a short answer: asked "What is 2+2?" greedy SmolLM2 may loop inside a string until max_tokens)
    ask = 'What is the capital of France? Answer as a JSON object like {"capital": ...}.'
    s = StructuredOutput("json_object")
    params = [SamplingParams(max_tokens=64, temperature=0.7 if i else 0.0, seed=i, structured=s) for i in range(6)]
    answers = llm.generate([ask] * 6, params, chat=True)
    ended = [c for c in answers if c.finish_reason == "stop"]
    assert answers[0] in ended and len(ended) >= 2, [c.text for c in answers]  # greedy and some sampled ones end
    assert all(isinstance(json.loads(c.text), dict) for c in ended)


def test_a_grammar_row_in_a_batch_is_the_row_alone_and_leaves_the_others_alone(llm):
    """Batch invariance: a constrained request beside plain and other constrained ones gives the tokens it gives
    alone, and the plain request gives its own tokens alone (the masks are per row)."""
    s = StructuredOutput("json_schema", PERSON)
    constrained, plain = SamplingParams(max_tokens=48, structured=s), SamplingParams(max_tokens=24)
    prompts = [ASK, "Name three colours.", ASK]
    together = llm.generate(prompts, [constrained, plain, SamplingParams(max_tokens=48, structured=s, seed=3,
                                                                         temperature=1.0)], chat=True)  # fmt: skip
    assert together[0].token_ids == llm.generate([ASK], constrained, chat=True)[0].token_ids
    assert together[1].token_ids == llm.generate(prompts[1], plain, chat=True)[0].token_ids


def test_logprobs_under_a_grammar_list_only_allowed_tokens(llm):
    """Chosen from the masked logits: under a choice of "yes" or "no", every first token with a finite logprob spells a
    start of one of them, and their probabilities sum to one."""
    s = StructuredOutput("choice", ["yes", "no"])
    out = llm.engine.add(llm.tokenizer.apply_chat(ASK), SamplingParams(max_tokens=4, structured=s, logprobs=20))
    while llm.engine.has_work:
        llm.engine.step()
    allowed = [(token, lp) for token, lp in out.logprobs[0][2] if lp > float("-inf")]
    assert 2 <= len(allowed) < 20
    starts = [llm.tokenizer.decode([token]) for token, _ in allowed]
    assert all(t and ("yes".startswith(t) or "no".startswith(t)) for t in starts), starts
    assert abs(sum(torch.tensor([lp for _, lp in allowed]).exp().tolist()) - 1) < 1e-4


def test_bad_specs_are_refused_by_name(llm):
    with pytest.raises(ValueError, match="kind must be one of"):
        StructuredOutput("yaml", "x")
    with pytest.raises(ValueError, match="json_schema needs a JSON schema"):
        StructuredOutput("json_schema", "{not json")
    with pytest.raises(ValueError, match="choice needs"):
        StructuredOutput("choice", [])
    with pytest.raises(ValueError, match="regex needs"):
        StructuredOutput("regex", "")
    prompt = llm.tokenizer.apply_chat(ASK)
    for s in (StructuredOutput("regex", "(unclosed"), StructuredOutput("grammar", "root ::= ")):
        with pytest.raises(EngineError, match=f"the {s.kind} does not compile"):
            llm.engine.add(prompt, SamplingParams(structured=s))
    assert not llm.engine.has_work


def test_the_kernels_greedy_token_when_allowed_is_the_masked_argmax(llm, monkeypatch):
    """A greedy constrained row takes the kernel's argmax when the grammar allows it (most steps here) and masks the
    logits only when it does not: the tokens equal those of masking every step (the shortcut turned off)."""
    from gqa.serve.engine import Engine

    s = StructuredOutput("json_schema", PERSON)
    params = [SamplingParams(max_tokens=48, structured=s), SamplingParams(max_tokens=24, structured=s)]
    prompts = [ASK, "Describe Bob, aged 40, who likes green, as JSON."]
    real, kept = Engine._grammar_keeps_greedy, []

    def counted(r, token):
        kept.append(real(r, token))
        return kept[-1]

    monkeypatch.setattr(Engine, "_grammar_keeps_greedy", staticmethod(counted))
    fast = [c.token_ids for c in llm.generate(prompts, params, chat=True)]
    assert 0 < sum(kept) < len(kept), (sum(kept), len(kept))  # both paths were taken
    monkeypatch.setattr(Engine, "_grammar_keeps_greedy", staticmethod(lambda r, token: False))
    assert [c.token_ids for c in llm.generate(prompts, params, chat=True)] == fast


def test_the_grammar_cache_is_bounded_and_a_grammar_it_dropped_compiles_again(llm):
    """400 distinct small schemas once grew the server by 94 MiB, never given back (xgrammar's own cache has no
    bound): 100 more schemas past the cache's bounds now leave resident memory level. A grammar the cache dropped is
    found while a request holds it, and compiled again (holding answers as before) once none does."""
    from pathlib import Path

    from gqa.serve.model_router import release_memory
    from gqa.serve.structured import Grammars

    statm = Path("/proc/self/statm")
    if not statm.exists():
        pytest.skip("reads resident memory from /proc")

    def resident() -> int:  # what is held, not what glibc keeps of freed heap (which other tests' frees leave about)
        release_memory()
        return int(statm.read_text().split()[1]) * 4096

    def schema(i: int) -> StructuredOutput:
        return StructuredOutput("json_schema", {"type": "object", "properties": {f"k{i}": {"type": "integer"},
                                "name": {"type": "string", "maxLength": 10}}, "required": [f"k{i}"]})  # fmt: skip

    V, stops = llm.engine.config.vocab_size, llm.engine.grammars.stop_token_ids
    grammars = Grammars(llm.tokenizer, V, stops)  # the engine's bounds
    for i in range(100):  # past the bounds: the cache is full
        grammars.compile(schema(i))
    before = resident()
    for i in range(100, 200):
        grammars.compile(schema(i))
    grown = resident() - before
    assert grown < 8 * 2**20, f"{grown / 2**20:.1f} MiB"  # 21 MiB per 100 schemas without a bound, 1 MiB here
    count, size = grammars.cached
    assert count <= grammars.cache_grammars and 0 < size <= grammars.cache_bytes

    small = Grammars(llm.tokenizer, V, stops, cache_grammars=2)
    colours, eos = StructuredOutput("choice", ["red", "green"]), stops[0]
    others = [StructuredOutput("choice", [f"{i}a", f"{i}b"]) for i in range(4)]
    held = small.compile(colours)
    small.compile(others[0])
    small.compile(others[1])
    assert small.cached[0] == 2 and small.find(colours) is held  # dropped from the cache, found held here
    small.compile(others[2])
    small.compile(others[3])
    del held
    gc.collect()
    assert small.find(colours) is None  # nothing holds it: it is gone
    for answer, ok in (("green", True), ("blue", False)):
        state = small.state(colours)  # compiled again
        assert state.matcher.accept_string(answer) is ok
        assert not ok or (state.accept(eos) and state.complete)
    assert small.cached[0] == 2 and small.find(colours) is not None


def test_a_forced_tool_calls_parameters_are_held_to_the_same_check(llm):
    """``tool_choice`` "required" or a named function holds the answer to the tools' parameters: a schema with what
    xgrammar would not enforce is refused as a ``response_format`` one is, and the error names ``tools``."""
    from gqa.loaders import load_tokenizer
    from gqa.serve.openai_api import parse_chat

    tokenizer = load_tokenizer(None)
    tokenizer.use_chat_template("{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}{{ m.content }}"
                                "{% endfor %}")  # fmt: skip
    parameters = {"type": "object", "properties": {"n": {"type": "integer", "not": {"const": 3}}}, "required": ["n"]}
    tools = [{"type": "function", "function": {"name": "pick", "parameters": parameters}}]
    for choice in ("required", {"type": "function", "function": {"name": "pick"}}):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": choice}
        parsed = parse_chat(body, tokenizer, ["m"], 8192)
        assert parsed.structured_field == "tools"
        with pytest.raises(EngineError, match="'not' is not supported"):
            llm.engine.compile(parsed.params)
