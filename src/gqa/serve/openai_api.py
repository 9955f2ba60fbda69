"""OpenAI's request and response shapes for ``/v1/completions`` and ``/v1/chat/completions``: fields read and checked
(a bad one is an ``ApiError`` naming it, answered as a 4xx in OpenAI's error shape), responses and stream chunks
built. No HTTP here (``server`` does that)."""

from __future__ import annotations

import codecs
import dataclasses
import json
import math
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

from .sampling import MAX_LOGPROBS, SEED_RANGE, SamplingParams
from .structured import StructuredOutput
from .tools import ToolError, ToolRequest, assistant_message, parse_tools

__all__ = ["ApiError", "ParsedRequest", "error_body", "logprobs_body", "parse_chat", "parse_completion", "to_json"]


class ApiError(Exception):
    """A request the API refuses: HTTP ``status`` with OpenAI's error body."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        kind: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code
        self.kind = kind or {401: "authentication_error", 429: "rate_limit_error"}.get(
            status, "invalid_request_error" if status < 500 else "server_error"
        )


def error_body(e: ApiError) -> dict[str, Any]:
    return {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}}


def to_json(body: object) -> str:
    """``body`` as JSON text, what every response and stream event is sent as: ``ValueError`` for a NaN or an
    infinity (JSON has none: Python would write ``NaN``/``-Infinity``, which clients' parsers refuse); a lone
    surrogate (a client's text echoed in an error, which UTF-8 cannot carry) is escaped."""
    text = json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(body, allow_nan=False, separators=(",", ":"))
    return text


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's (its deprecated "function": no functions)
GREEDY_BELOW = 1e-5  # a temperature under this is greedy decoding (as vLLM)
MAX_CHOICES = 16  # the most answers (``n``) one request asks for
MAX_ID_DIGITS = 18  # a token id written out (``logit_bias``' keys): any larger is no vocabulary's
# OpenAI / vLLM request fields gqa does not implement yet, with the values that mean "off": a request that sets one to
# anything else is refused with a 400 naming it, never served as if it had not asked
NOT_IMPLEMENTED: dict[str, tuple] = {
    "suffix": ("",),
    "best_of": (1,),  # completions serve it (``parse_completion``); chat refuses it
    "echo": (False,),  # completions serve it; chat (vLLM's echo of the last message) refuses it
    "functions": ([],),
    # vLLM's and llama-server's sampling and prompt fields that change the answer
    "typical_p": (1, 1.0),
    "use_beam_search": (False,),
    "length_penalty": (1, 1.0),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "truncate_prompt_tokens": (),
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
    "chat_template": (),
    "chat_template_kwargs": ({},),
    "mirostat": (0,),
    "tfs_z": (1, 1.0),
}
# vLLM's structured_outputs keys (the kind of StructuredOutput each means), and its older one-key fields for them
STRUCTURED_KEYS = {"json": "json_schema", "json_object": "json_object", "regex": "regex", "choice": "choice",
                   "grammar": "grammar"}  # fmt: skip
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _refuse_not_implemented(body: dict, served: tuple[str, ...] = ()) -> None:
    for name, off in NOT_IMPLEMENTED.items():
        if name in served:
            continue
        value = body.get(name)
        if value is not None and not any(value == o and type(value) is type(o) for o in off):
            raise ApiError(f"'{name}' is not supported by this server (got {json.dumps(value)[:80]})", param=name)


@dataclass
class ParsedRequest:
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    model: str
    structured_field: str | None = None  # the field that asked for structured output (its errors name it)
    n: int = 1  # choices: answers to the same prompt
    tools: ToolRequest | None = None  # a chat request's functions and tool_choice
    echo: str = ""  # text that precedes each answer (completions' ``echo``: the prompt)
    prompt_logprobs: int | None = None  # echo with logprobs: the prompt's own, with this many alternatives
    best_of: int | None = None  # of the ``n`` answers generated, return this many with the best mean logprob
    hide_logprobs: bool = False  # the logprobs were asked for the ranking (best_of), not by the client
    score_only: bool = False  # echo with max_tokens 0: the prompt alone (and its logprobs), nothing generated


JSON_TYPES = {
    "a string": lambda v: isinstance(v, str),
    "a boolean": lambda v: isinstance(v, bool),
    "an integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    # finite, and within a float's range (a 400-digit integer would overflow float() later)
    "a number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) <= sys.float_info.max,
    "an array": lambda v: isinstance(v, list),
    "an object": lambda v: isinstance(v, dict),
}


def _get(body: dict, name: str, kind: str, default: Any = None, *, required: bool = False) -> Any:
    """``body[name]`` if it is ``kind`` (a key of ``JSON_TYPES``); ``default`` when absent or null."""
    value = body.get(name)
    if value is None:
        if required:
            raise ApiError(f"'{name}' is required", param=name)
        return default
    if not JSON_TYPES[kind](value):
        raise ApiError(f"'{name}' must be {kind}, got {json_type(value)}", param=name)
    return value


def json_type(value: object) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if type(value) is int and abs(value) > sys.float_info.max:
        return f"an integer of {len(str(abs(value)))} digits, beyond a number's range"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(value), type(value).__name__)  # fmt: skip


@dataclass(frozen=True)
class Room:
    """Where a request's tokens must fit: the model's context and the KV pool's token slots (``None``: unbounded),
    and the prompt's length and field name."""

    context: int
    pool: int | None
    prompt: int
    field: str

    def left(self) -> int:
        """The most new tokens a request of this prompt can ask for."""
        return min(self.context, self.pool if self.pool is not None else self.context) - self.prompt


def _logit_bias(bias: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` (token id as a string -> a number in [-100, 100]) as ``(id, bias)`` pairs."""
    pairs = []
    for key, value in bias.items():
        id_ = isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= MAX_ID_DIGITS  # not "²"
        if not id_ or not JSON_TYPES["a number"](value) or abs(value) > 100:
            raise ApiError(f"'logit_bias' must map token ids to numbers in [-100, 100], got {key!r}: {value!r}",
                           param="logit_bias")  # fmt: skip
        pairs.append((int(key), float(value)))
    return tuple(pairs)


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives each token's logprobs list (``SamplingParams.logprobs``; ``None``: no logprobs). Chat:
    ``logprobs`` (a boolean) and ``top_logprobs``; completions: ``logprobs`` (an integer)."""
    if not chat:
        n = _get(body, "logprobs", "an integer", None)
        if n is not None and not 0 <= n <= MAX_LOGPROBS:
            raise ApiError(f"'logprobs' must be in [0, {MAX_LOGPROBS}], got {n}", param="logprobs")
        return n
    wanted = _get(body, "logprobs", "a boolean", False)
    top = _get(body, "top_logprobs", "an integer", None)
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise ApiError(f"'top_logprobs' must be in [0, {MAX_LOGPROBS}], got {top}", param="top_logprobs")
    if top and not wanted:
        raise ApiError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return (top or 0) if wanted else None


def logprobs_body(entries: list, tokenizer, chat: bool, offsets: TextOffsets | None = None) -> dict:
    """A choice's (or a stream chunk's) ``logprobs`` for ``entries`` (``TokenLogprob``: id, logprob, alternatives):
    chat's ``content`` list, or the completions' arrays, ``text_offset`` counted by ``offsets`` (a stream's chunks
    share one, so they go on where the chunk before ended; ``None``: from 0) (an
    echoed prompt's first token has no logprob and no alternatives: ``null`` in both, as OpenAI sends it). A token's
    ``bytes`` are its own (``Tokenizer.token_bytes``): joined, they are the text's UTF-8; its text is those bytes, or
    for a piece of a multi-byte character OpenAI's ``bytes:\\xNN`` naming them (``token_text``), and its offset is
    where the character it belongs to starts."""
    raw = tokenizer.token_bytes
    if chat:

        def item(token: int, logprob: float) -> dict:
            b = raw(token)
            return {"token": token_text(b), "logprob": logprob, "bytes": list(b)}

        content = [item(t, lp) | {"top_logprobs": [item(a, alp) for a, alp in top]} for t, lp, top in entries]
        return {"content": content, "refusal": None}
    pieces = [raw(t) for t, _, _ in entries]
    top = [None if alts is None else {token_text(raw(a)): alp for a, alp in alts} for _, _, alts in entries]
    return {
        "tokens": [token_text(b) for b in pieces],
        "token_logprobs": [lp for _, lp, _ in entries],
        "top_logprobs": top,
        "text_offset": (offsets or TextOffsets()).of(pieces),
    }


def token_text(raw: bytes) -> str:
    """A token's text in the logprobs: its bytes as UTF-8, or where they are not whole characters, OpenAI's
    ``bytes:\\xe2\\x80`` (the bytes written out; U+FFFD would hide which they are)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class TextOffsets:
    """Completions' ``text_offset``: where each token starts in the text, in characters from ``start``, counted by one
    UTF-8 decoder over all of an answer's tokens — a token that continues a character starts where that character
    does, also when the character's pieces come in different chunks of a stream."""

    def __init__(self, start: int = 0) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.at = start

    def of(self, pieces: list[bytes]) -> list[int]:
        """The offsets of the next tokens, ``pieces`` (their bytes), in order."""
        offsets = []
        for piece in pieces:
            offsets.append(self.at)
            self.at += len(self._decoder.decode(piece))
        return offsets


def _structured(body: dict) -> tuple[StructuredOutput | None, str | None]:
    """The output's required shape and the field that gave it: OpenAI's ``response_format`` (``json_object``,
    ``json_schema``), vLLM's ``structured_outputs`` (one of ``json``, ``json_object``, ``regex``, ``choice``,
    ``grammar``) or its older ``guided_json``/``guided_regex``/``guided_choice``/``guided_grammar``; at most one."""
    given = []
    response_format = _get(body, "response_format", "an object", None)
    if response_format is not None and response_format.get("type") != "text":
        given.append(("response_format", response_format))
    outputs = _get(body, "structured_outputs", "an object", None)
    if outputs:
        given.append(("structured_outputs", outputs))
    given += [(name, {key: body[name]}) for name, key in GUIDED_FIELDS.items() if body.get(name) is not None]
    if len(given) > 1:
        names = " and ".join(f"'{name}'" for name, _ in given)
        raise ApiError(f"{names} each ask for structured output: give one", param=given[1][0])
    if not given:
        return None, None
    name, value = given[0]
    try:
        if name == "response_format":
            kind = value.get("type")
            if kind == "json_object":
                return StructuredOutput("json_object"), name
            schema = value.get("json_schema")
            if kind != "json_schema":
                raise ValueError(f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}")
            if not (isinstance(schema, dict) and isinstance(schema.get("schema"), dict)):
                raise ValueError("'response_format.json_schema' must be an object with a 'schema' object")
            return StructuredOutput("json_schema", schema["schema"]), name
        keys = [key for key, v in value.items() if v is not None and v is not False]
        if len(keys) != 1 or keys[0] not in STRUCTURED_KEYS:
            raise ValueError(f"'{name}' must name exactly one of {sorted(STRUCTURED_KEYS)}, got {sorted(value)}")
        kind = STRUCTURED_KEYS[keys[0]]
        return StructuredOutput(kind, None if kind == "json_object" else value[keys[0]]), name
    except ValueError as e:
        raise ApiError(str(e), param=name) from e


def _stop_token_ids(body: dict) -> tuple[int, ...]:
    ids = _get(body, "stop_token_ids", "an array", None) or []
    if not all(JSON_TYPES["an integer"](t) and t >= 0 for t in ids):
        raise ApiError("'stop_token_ids' must be an array of token ids >= 0", param="stop_token_ids")
    return tuple(ids)


def _common(
    body: object, models: list[str], room: Room, default_max_tokens: int | None, forced: StructuredOutput | None = None,
    served: tuple[str, ...] = (),
) -> dict[str, Any]:  # fmt: skip
    """The fields both endpoints share, checked; ``forced``: the structured output a forced ``tool_choice`` needs;
    ``served``: fields of ``NOT_IMPLEMENTED`` the endpoint serves itself."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    model = _get(body, "model", "a string", None)
    if model is None:  # the served model, when there is only one (as llama-server and ollama take it)
        if len(models) != 1:
            raise ApiError(f"'model' is required: this server has {models}", param="model")
        model = models[0]
    if model not in models:
        raise ApiError(f"the model '{model}' does not exist; this server has {models}", 404, "model",
                       code="model_not_found")  # fmt: skip
    _refuse_not_implemented(body, served)
    n = _get(body, "n", "an integer", 1)
    if not 1 <= n <= MAX_CHOICES:
        raise ApiError(f"'n' must be in [1, {MAX_CHOICES}], got {n}", param="n")
    max_tokens = _get(body, "max_tokens", "an integer", None)
    max_tokens = _get(body, "max_completion_tokens", "an integer", max_tokens)  # the newer name wins (as vLLM)
    max_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if max_tokens is None:
        if room.left() < 1:
            where, limit = ("context", room.context) if room.prompt >= room.context else ("KV cache", room.pool)
            raise ApiError(f"the prompt's {room.prompt} tokens exceed the model's {where} of {limit} tokens",
                           param=room.field)  # fmt: skip
        max_tokens = min(default_max_tokens or room.left(), room.left())
    if max_tokens < 1:
        raise ApiError(f"'{max_field}' must be >= 1, got {max_tokens}", param=max_field)
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        if not stop:
            raise ApiError("'stop' must not be an empty string", param="stop")
        stop = (stop,)
    elif not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)) or len(stop) > 4:
        raise ApiError("'stop' must be a string or an array of up to 4 non-empty strings", param="stop")
    temperature = float(_get(body, "temperature", "a number", 1.0))
    top_p = _get(body, "top_p", "a number", None)
    top_k = _get(body, "top_k", "an integer", None)
    min_p = _get(body, "min_p", "a number", None)  # vLLM's and llama-server's
    if not 0 <= temperature <= 2:
        raise ApiError(f"'temperature' must be in [0, 2], got {temperature}", param="temperature")
    if temperature < GREEDY_BELOW:
        temperature = 0.0
    if top_p is not None and not 0 < top_p <= 1:
        raise ApiError(f"'top_p' must be in (0, 1], got {top_p}", param="top_p")
    if min_p is not None and not 0 <= min_p <= 1:
        raise ApiError(f"'min_p' must be in [0, 1], got {min_p}", param="min_p")
    if top_k is not None and top_k < 1 and top_k != -1:
        raise ApiError(f"'top_k' must be >= 1 (or -1: off), got {top_k}", param="top_k")
    seed = _get(body, "seed", "an integer", None)
    if seed is not None and not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
        raise ApiError(f"'seed' must be in [-2**63, 2**64), got {seed}", param="seed")
    stream = _get(body, "stream", "a boolean", False)
    options = _get(body, "stream_options", "an object", {})
    penalties: dict[str, Any] = {}
    for name, default in (("frequency_penalty", 0.0), ("presence_penalty", 0.0), ("repetition_penalty", 1.0)):
        value = float(_get(body, name, "a number", default))
        repetition = name == "repetition_penalty"
        if not (value > 0 if repetition else -2 <= value <= 2):
            raise ApiError(f"'{name}' must be {'> 0' if repetition else 'in [-2, 2]'}, got {value:g}", param=name)
        penalties[name] = value
    penalties["logit_bias"] = _logit_bias(_get(body, "logit_bias", "an object", None) or {})
    penalties["logprobs"] = _logprobs(body, chat=room.field == "messages")
    min_tokens = _get(body, "min_tokens", "an integer", 0)
    if not 0 <= min_tokens <= max_tokens:
        raise ApiError(f"'min_tokens' must be in [0, max_tokens={max_tokens}], got {min_tokens}", param="min_tokens")
    structured, structured_field = _structured(body)
    if forced is not None:
        if structured is not None:
            raise ApiError(f"'{structured_field}' and a forced 'tool_choice' each ask for structured output: give one",
                           param=structured_field)  # fmt: skip
        structured, structured_field = forced, "tools"
    try:
        params = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=None if top_p is None else float(top_p),
            top_k=None if top_k in (None, -1) else top_k, min_p=None if min_p is None else float(min_p),
            stop=tuple(stop), seed=seed,
            ignore_eos=bool(_get(body, "ignore_eos", "a boolean", False)), min_tokens=min_tokens,
            stop_token_ids=_stop_token_ids(body), structured=structured, **penalties,
        )  # fmt: skip
    except ValueError as e:  # what the fields above do not check themselves: never past this point
        raise ApiError(str(e)) from e
    return {"params": params, "stream": stream, "include_usage": bool(options.get("include_usage")), "model": model,
            "structured_field": structured_field, "n": n}  # fmt: skip


def parse_completion(
    body: object, tokenizer, models: list[str], context: int, pool: int | None = None
) -> ParsedRequest:
    """``/v1/completions``: ``prompt`` is a string or token ids (one prompt); ``max_tokens`` defaults to 16 (or what
    fits). ``pool``: the KV cache's token slots."""
    if isinstance(body, dict):
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            try:
                ids = tokenizer.encode(prompt)
            except (UnicodeError, ValueError, TypeError) as e:  # e.g. a lone surrogate, which no UTF-8 holds
                raise ApiError(f"'prompt' cannot be tokenized: {e}", param="prompt") from e
        elif isinstance(prompt, list) and prompt and all(JSON_TYPES["an integer"](t) for t in prompt):
            ids = list(prompt)
        elif prompt is None:
            raise ApiError("'prompt' is required", param="prompt")
        else:
            raise ApiError("'prompt' must be a string or an array of token ids (one prompt)", param="prompt")
        if not ids:
            raise ApiError("'prompt' is empty", param="prompt")
    else:
        ids = []
    echo = isinstance(body, dict) and _get(body, "echo", "a boolean", False)
    score_only = echo and type(body.get("max_tokens")) is int and body["max_tokens"] == 0
    score_only = score_only and body.get("max_completion_tokens") is None
    if score_only:  # the prompt scored, nothing generated (evaluation harnesses): checked as one new token would be
        body = body | {"max_tokens": 1}
    fields = _common(body, models, Room(context, pool, len(ids), "prompt"), 16, served=("best_of", "echo"))
    ranking = _best_of(body, fields)
    if not echo:
        return ParsedRequest(ids, **fields, **ranking)
    try:
        text = prompt if isinstance(prompt, str) else tokenizer.decode(ids)
    except (OverflowError, ValueError, TypeError) as e:  # an id no tokenizer has (the engine's check comes later)
        raise ApiError(f"'prompt' has token ids the tokenizer cannot decode: {e}", param="prompt") from e
    asked = None if ranking.get("hide_logprobs") else fields["params"].logprobs
    return ParsedRequest(ids, **fields, echo=text, prompt_logprobs=asked, score_only=score_only, **ranking)


def _best_of(body: dict, fields: dict) -> dict[str, Any]:
    """Completions' ``best_of``: ``best_of`` answers are generated (``fields`` changed to ask for them, and for the
    chosen tokens' logprobs) and the ``n`` with the highest mean token logprob returned; not streamed (as OpenAI)."""
    n = fields["n"]
    best_of = _get(body, "best_of", "an integer", None)
    if best_of is None or best_of == n == 1:
        return {}
    if not n <= best_of <= MAX_CHOICES:
        raise ApiError(f"'best_of' must be in [n={n}, {MAX_CHOICES}], got {best_of}", param="best_of")
    if fields["stream"]:
        raise ApiError("'best_of' cannot be streamed (the best answers are known at the end)", param="best_of")
    params = fields["params"]
    fields["n"] = best_of
    if params.logprobs is None:
        fields["params"] = dataclasses.replace(params, logprobs=0)
    return {"best_of": n, "hide_logprobs": params.logprobs is None}


def parse_chat(
    body: object, tokenizer, models: list[str], context: int, pool: int | None = None, prefill: str = ""
) -> ParsedRequest:
    """``/v1/chat/completions``: ``messages`` rendered with the model's chat template; ``max_tokens`` defaults to
    what is left of the context and of the KV cache's ``pool`` token slots. ``prefill``: text the answer begins with
    (rendered after the template's assistant turn; the answer is what follows it)."""
    ids, tools = chat_prompt(body, tokenizer, prefill) if isinstance(body, dict) else ([], None)
    try:
        forced = None if tools is None else tools.structured()
    except ValueError as e:  # parameters too deep to hold as JSON text
        raise ApiError(str(e), param="tools") from e
    fields = _common(body, models, Room(context, pool, len(ids), "messages"), None, forced)
    if forced is not None:  # a forced call is the grammar's JSON to its end: a stop string could only cut it (tools)
        fields["params"] = dataclasses.replace(fields["params"], stop=())
    return ParsedRequest(ids, **fields, tools=tools)


def chat_prompt(body: dict, tokenizer, prefill: str = "") -> tuple[list[int], ToolRequest | None]:
    """A chat request's prompt: its ``messages`` (and ``tools``) rendered by the chat template and tokenized, then
    ``prefill``; and its tools."""
    messages = _get(body, "messages", "an array", required=True)
    if not messages:
        raise ApiError("'messages' must not be empty", param="messages")
    plain = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(f"messages[{i}] must be an object with a 'role'", param="messages")
        if m["role"] not in CHAT_ROLES:
            raise ApiError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {m['role'][:40]!r}",
                           param="messages")  # fmt: skip
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = m["tool_calls"]
            objects = isinstance(calls, list) and all(isinstance(c, dict) for c in calls)
            if not (objects and all(isinstance(c.get("function") or {}, dict) for c in calls)):
                raise ApiError(f"messages[{i}].tool_calls must be an array of objects with a 'function' object",
                               param="messages")  # fmt: skip
            plain.append(assistant_message(m))
            continue
        content = m.get("content")
        if isinstance(content, list):  # content parts: the text ones
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise ApiError(f"messages[{i}].content: only text parts are supported", param="messages")
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            raise ApiError(f"messages[{i}].content must be a string", param="messages")
        plain.append({"role": m["role"], "content": content})
        if m["role"] == "tool" and isinstance(m.get("tool_call_id"), str):
            plain[-1]["tool_call_id"] = m["tool_call_id"]
    try:
        tools = parse_tools(body, tokenizer.chat_template)
    except ToolError as e:
        raise ApiError(str(e), param=e.param) from e
    try:
        text = tokenizer.render_chat(plain, tools=None if tools is None else tools.tools)
    except Exception as e:  # a template that raises on these messages (e.g. roles out of order)
        raise ApiError(f"the chat template refused the messages: {e}", param="messages") from e
    try:
        return tokenizer.encode(text + prefill, add_special_tokens=False), tools  # the template writes any BOS itself
    except (UnicodeError, ValueError, TypeError) as e:  # e.g. a lone surrogate, which no UTF-8 holds
        raise ApiError(f"'messages' cannot be tokenized: {e}", param="messages") from e


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip


def completion_body(
    rid: str,
    model: str,
    text: str,
    reason: str | None,
    use: dict | None,
    chat: bool,
    created: int | None = None,
    logprobs: dict | None = None,
) -> dict:
    """A whole response (``use`` given) or one stream chunk (``use`` None; ``text`` the new piece); ``created``: the
    request's time, the same in every chunk of a stream; ``logprobs``: the choice's (``logprobs_body``)."""
    created = int(time.time()) if created is None else created
    if chat:
        if use is not None:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
        else:
            choice = {"index": 0, "delta": {"content": text} if text or reason is None else {}, "finish_reason": reason}
        kind = "chat.completion" if use is not None else "chat.completion.chunk"
        choice["logprobs"] = logprobs
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}
        kind = "text_completion"
    body = {"id": rid, "object": kind, "created": created, "model": model, "choices": [choice]}
    if use is not None:
        body["usage"] = use
    return body
