"""The API layer without a server or a model: logprobs as JSON can carry them (no -inf alternatives, no NaN or
Infinity written anywhere), completions' logprobs of tokens that split a character, request fields that once
answered 500, and the model a request without ``model`` gets."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from gqa.loaders import load_tokenizer
from gqa.serve.openai_api import ApiError, TextOffsets, logprobs_body, parse_completion, to_json
from gqa.serve.sampler import token_logprob
from gqa.serve.sampling import SamplingParams

pytest.importorskip("starlette")


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_masked_tokens_are_no_alternatives_and_the_chosen_ones_logprob_is_its_entry(temperature):
    """A grammar's mask leaves 3 of 50 tokens: 5 alternatives asked, the 3 allowed listed (their probabilities sum to
    1 in float64), none at -inf; the chosen token's logprob is its entry among them."""
    logits = torch.full((50,), -torch.inf)
    logits[[4, 17, 30]] = torch.tensor([1.5, 0.25, -2.0])
    r = SimpleNamespace(params=SamplingParams(logprobs=5, temperature=temperature))
    _, logprob, alternatives = token_logprob(r, logits, 17)
    assert [t for t, _ in alternatives] == [4, 17, 30] and all(math.isfinite(v) for _, v in alternatives)
    assert dict(alternatives)[17] == logprob
    want = torch.log_softmax(logits.double()[[4, 17, 30]] / (temperature or 1.0), -1)
    assert torch.allclose(torch.tensor([v for _, v in alternatives], dtype=torch.float64), want, atol=1e-6)


def test_no_response_carries_nan_or_infinity_and_lone_surrogates_are_escaped():
    from gqa.serve.server import event, whole

    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError):
            to_json({"logprob": bad})
        answer = whole({"logprob": bad})
        assert answer.status_code == 500 and json.loads(answer.body)["error"]["type"] == "server_error"
        sent = event({"logprob": bad})
        assert sent.startswith("data: ") and json.loads(sent[6:])["error"]["type"] == "server_error"
    text = to_json({"message": "the model 'a\ud800' does not exist"})
    assert json.loads(text)["message"] == "the model 'a\ud800' does not exist" and text.encode("utf-8")


def test_completions_logprobs_of_split_characters_spell_the_text_at_the_tokenizers_offsets():
    """Tokens that are pieces of a character are named by their bytes (OpenAI's ``bytes:\\xNN``, so that two
    pieces are not one U+FFFD key): the tokens spell the text, and each ``text_offset`` is where ``tokenizers`` says
    the token starts."""
    tok = load_tokenizer()
    text = "Japanese: 日本語 😀🎉 means"
    encoded = tok.backend.encode(text, add_special_tokens=False)
    entries = [(t, -1.0, ((t, -1.0),)) for t in encoded.ids]
    body = logprobs_body(entries, tok, chat=False, offsets=TextOffsets(3))
    assert body["text_offset"] == [3 + start for start, _ in encoded.offsets]
    spelled = b"".join(_token_bytes(t) for t in body["tokens"])
    assert spelled == text.encode("utf-8") and any(t.startswith("bytes:") for t in body["tokens"])
    assert [list(top) for top in body["top_logprobs"]] == [[t] for t in body["tokens"]]


def _token_bytes(token: str) -> bytes:
    if token.startswith("bytes:"):
        return bytes(int(h, 16) for h in token[len("bytes:") :].split("\\x")[1:])
    return token.encode("utf-8")


def test_a_request_without_model_gets_the_only_served_one():
    assert parse_completion({"prompt": [1, 2]}, None, ["only"], 100).model == "only"
    with pytest.raises(ApiError, match="'model' is required") as e:
        parse_completion({"prompt": [1, 2]}, None, ["a", "b"], 100)
    assert e.value.param == "model" and e.value.status == 400
    with pytest.raises(ApiError, match="does not exist") as e:
        parse_completion({"prompt": [1, 2], "model": "c"}, None, ["a"], 100)
    assert e.value.status == 404


@pytest.mark.parametrize("key", ["²", "٣", "9" * 5000, "-1", "1.5", " 1"])
def test_logit_bias_keys_that_are_no_token_id_are_refused_by_name(key):
    with pytest.raises(ApiError, match="'logit_bias' must map token ids") as e:
        parse_completion({"prompt": [1, 2], "logit_bias": {key: 1}}, None, ["m"], 100)
    assert e.value.param == "logit_bias" and e.value.status == 400
