"""Self-generated conversations: data a chat model writes for its own conversion, without any download.

An instruct model can invent a user's request when it is given only its chat template's opening of a user turn, and
it answers that request through the template as it would answer a person. ``self_generated_conversations`` makes
``count`` such conversations with the source model:

1. **User turns**, sampled (``temperature``, ``top_p``) from the rendered opening of a user turn — the template's
   default system prompt included, as every chat with the model begins — after an ``OPENERS`` word that steers a share
   of the rows towards questions, explanations and writing tasks (the empty opener leaves the model free). Turns that
   do not end within ``QUESTION_TOKENS`` tokens, or have fewer than ``MIN_QUESTION_WORDS`` words, are dropped; the
   rest are deduplicated by their normalised text.
2. **Answers**, greedy (as ``gqa generate`` answers by default), to each user turn rendered with the chat template,
   up to ``ANSWER_TOKENS`` tokens.

Generation runs through the serving engine (``gqa.convert.bulk_generation``: continuous batching, the shared system
prompt read once) and is seeded per row: the same model, settings and seed give the same conversations. A fixed
share of them, chosen by a hash of the user turn (``is_held_out``), is **held out**: calibration and healing read only
``ConversationSet.train``; ``gqa eval --suite`` scores ``held_out``.
The set is cached as JSON under ``cache_dir()`` in a file named by the source model's content hash and the settings
other than the count (``cache_key``), so the next conversion of the same model reads it instead of generating again.
Row ``i`` of a run depends only on ``i`` and the settings, so the first ``n`` user turns of a larger set are the set of
``n``: a cached set serves every smaller count, and a larger count generates only the rows it lacks. Each step's
finished rows go to a journal beside the file (``gqa.convert.batch_journal``), kept after the set is written: an
interrupted run loses at most the rows in flight, and the next run, or a larger count, continues from there.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .._atomic import write_json_atomic
from .._paths import cache_root
from ..options.defaults import CALIBRATION_CONVERSATIONS, EVALUATION_CONVERSATIONS, HEALING_CONVERSATIONS
from .batch_journal import BatchJournal
from .bulk_generation import generate_many

if TYPE_CHECKING:
    from ..loaders.tokenizer import Tokenizer
    from ..models import CausalLM

__all__ = [
    "CALIBRATION_CONVERSATIONS",
    "EVALUATION_CONVERSATIONS",
    "HEALING_CONVERSATIONS",
    "OPENERS",
    "Conversation",
    "ConversationSet",
    "GenerationSettings",
    "cache_dir",
    "cache_key",
    "cached_file",
    "cached_path",
    "chat_stream",
    "end_of_turn_ids",
    "has_chat_template",
    "is_held_out",
    "model_content_hash",
    "read_cached",
    "self_generated_conversations",
    "stored_count",
    "user_turn_prompts",
]

# The first words of a steered user turn, cycled over the rows; "" leaves the turn to the model. Task kinds, not
# topics: the model picks what to ask about (no word here names a subject of the project's question set).
OPENERS = ("", "What", "How", "Why", "Can you explain", "Write", "Give me", "Who", "Which", "Tell me", "", "Is")
QUESTION_TOKENS = 48  # a user turn that has not ended by then is dropped
MIN_QUESTION_WORDS = 3
ANSWER_TOKENS = 128  # answers are cut here, as gqa generate cuts them by default
HELD_OUT_PER_MILLE = 100  # 10% of the conversations, by a hash of the user turn
# bump when the file's layout or the generation changes (3: the serving engine, a seed per row; 4: rows numbered, the
# count out of the key)
CACHE_FORMAT = 4
_BYTES = 1 << 20


@dataclass(frozen=True)
class GenerationSettings:
    """How a set is generated; all of it goes into the cache key.

    Attributes
    ----------
    count : user turns sampled (fewer conversations remain after dropping unfinished turns and duplicates); the only
        setting not in the cache key (a set of ``n`` is the first ``n`` rows of a larger one).
    seed : seeds the sampling of the user turns.
    temperature, top_p : sampling of the user turns (answers are greedy).
    batch_size : rows decoded together at most (the set does not depend on it, except through the fallback for models
        the serving engine does not take: ``gqa.convert.bulk_generation``).
    """

    count: int = CALIBRATION_CONVERSATIONS
    seed: int = 0
    temperature: float = 0.9
    top_p: float = 0.95
    batch_size: int = 128

    def __post_init__(self) -> None:
        for name in ("count", "seed", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"conversation {name} must be an int, got {value!r}")
        if self.count < 1 or self.batch_size < 1:
            raise ValueError(f"conversation count and batch_size must be >= 1, got {self.count}, {self.batch_size}")
        if not (self.temperature > 0 and 0 < self.top_p <= 1):
            raise ValueError(f"need temperature > 0 and top_p in (0, 1], got {self.temperature}, {self.top_p}")


@dataclass(frozen=True)
class Conversation:
    """One exchange: a user turn the model invented and its own answer.

    Attributes
    ----------
    question, answer : the two turns' texts (the answer without the end-of-turn token).
    prompt_ids : the chat rendered up to the assistant's turn (system prompt, user turn, assistant opening).
    answer_ids : the answer's tokens as generated, the end-of-turn token included when it came.
    row : the index of the sampled user turn it answers (``0 <= row < GenerationSettings.count``).
    """

    question: str
    answer: str
    prompt_ids: list[int]
    answer_ids: list[int]
    row: int = 0

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.answer_ids


@dataclass(frozen=True)
class ConversationSet:
    """Self-generated conversations, split: ``train`` for calibration and healing, ``held_out`` for evaluation only."""

    train: list[Conversation]
    held_out: list[Conversation]
    settings: GenerationSettings
    model_hash: str
    seconds: float = 0.0  # generation time (0 when read from the cache)
    path: Path | None = None  # the cache file

    def __len__(self) -> int:
        return len(self.train) + len(self.held_out)

    def first(self, count: int) -> ConversationSet:
        """The set ``count`` user turns give: the conversations of rows ``< count`` (what generating ``count`` rows
        with the same settings makes)."""
        if count >= self.settings.count:
            return self
        return dataclasses.replace(
            self, train=[c for c in self.train if c.row < count], held_out=[c for c in self.held_out if c.row < count],
            settings=dataclasses.replace(self.settings, count=count),
        )  # fmt: skip


def has_chat_template(tok: Tokenizer | None) -> bool:
    return tok is not None and bool(tok.chat_template)


def cache_dir() -> Path:
    """Where sets are cached: ``conversations/`` under ``gqa._paths.cache_root()`` (``$GQA_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/gqa``, else ``~/.cache/gqa``)."""
    return cache_root() / "conversations"


def model_content_hash(resolved: Path) -> str:
    """SHA-256 over a model's bytes: a GGUF file, or an HF folder's weight, config and tokenizer files (names and
    contents, in name order). Two copies of a model hash alike wherever they lie; any changed byte changes it."""
    if resolved.is_file():
        files = [resolved]
    else:
        wanted = (".safetensors", ".gguf", ".bin", ".json", ".txt", ".model", ".jinja")
        files = sorted(f for f in resolved.iterdir() if f.is_file() and f.name.endswith(wanted))
        files = [f for f in files if not f.name.startswith("heal_")]  # a healed folder's log is not the model
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode() + b"\0" if resolved.is_dir() else b"")
        with f.open("rb") as fh:
            while chunk := fh.read(_BYTES):
                digest.update(chunk)
    return digest.hexdigest()


def cache_key(model_hash: str, settings: GenerationSettings) -> str:
    """The cache file's stem: the model hash and a hash of the settings but the count, and of the generation recipe."""
    fields = {k: v for k, v in dataclasses.asdict(settings).items() if k != "count"}
    recipe = {
        "format": CACHE_FORMAT, "settings": fields, "openers": OPENERS,
        "question_tokens": QUESTION_TOKENS, "answer_tokens": ANSWER_TOKENS, "held_out": HELD_OUT_PER_MILLE,
    }  # fmt: skip
    return f"{model_hash[:32]}-{hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]}"


def is_held_out(question: str) -> bool:
    """Whether a user turn belongs to the held-out split: a hash of its normalised text, so the split does not depend
    on the order or the number of conversations."""
    h = int.from_bytes(hashlib.sha256(_normalised(question).encode()).digest()[:4], "big")
    return h % 1000 < HELD_OUT_PER_MILLE


def _normalised(text: str) -> str:
    return re.sub(r"\W+", " ", text.lower()).strip()


def _user_opening(tok: Tokenizer) -> str:
    """The chat template's rendering of a conversation up to the first character of the user's text."""
    marker = "\u2063gqa\u2063"  # a string no template writes itself
    rendered = tok.render_chat([{"role": "user", "content": marker}], add_generation_prompt=False)
    if marker not in rendered:
        raise ValueError("the chat template does not render the user's text verbatim")
    return rendered[: rendered.index(marker)]


def user_turn_prompts(tok: Tokenizer, count: int) -> list[list[int]]:
    """The prompts of rows ``0..count-1``' user turns: the template's opening of a user turn, then the row's opener."""
    opening = _user_opening(tok)
    return [tok.encode(opening + OPENERS[i % len(OPENERS)], add_special_tokens=False) for i in range(count)]


def end_of_turn_ids(tok: Tokenizer, model: CausalLM) -> set[int]:
    ids = set(model.config.eos_token_id) | set(tok.eos_token_ids)
    for name in ("<|im_end|>", "<|eot_id|>", "<|end|>"):
        token = tok.token_id(name)
        if token is not None:
            ids.add(token)
    return ids


def _generate(
    model: CausalLM, tok: Tokenizer, settings: GenerationSettings, progress: bool, journal: BatchJournal | None
) -> tuple[list[Conversation], dict[str, int]]:
    from tqdm.auto import tqdm

    end_ids = end_of_turn_ids(tok, model)
    openers = [OPENERS[i % len(OPENERS)] for i in range(settings.count)]
    prompts = user_turn_prompts(tok, settings.count)
    stats = {"sampled": settings.count}
    kw = {"file": sys.stderr, "dynamic_ncols": True, "disable": not progress}
    with tqdm(total=len(prompts), desc="user turns", unit="turn", **kw) as bar:
        turns = generate_many(
            model, prompts, max_new_tokens=QUESTION_TOKENS, end_ids=end_ids, batch_size=settings.batch_size,
            temperature=settings.temperature, top_p=settings.top_p, seed=settings.seed, bar=bar, journal=journal,
            phase="user turns",
        )  # fmt: skip
    questions, rows, seen = [], [], set()
    for row, (opener, ids) in enumerate(zip(openers, turns, strict=True)):
        if not ids or ids[-1] not in end_ids:
            continue  # did not end: cut off mid-sentence
        text = (opener + tok.decode(ids[:-1], skip_special_tokens=True)).strip()
        key = _normalised(text)
        if len(text.split()) < MIN_QUESTION_WORDS or key in seen:
            continue
        seen.add(key)
        questions.append(text)
        rows.append(row)
    stats["kept"] = len(questions)
    chats = [tok.apply_chat(q) for q in questions]
    with tqdm(total=len(chats), desc="answers", unit="answer", **kw) as bar:
        answers = generate_many(
            model, chats, max_new_tokens=ANSWER_TOKENS, end_ids=end_ids, batch_size=settings.batch_size, bar=bar,
            journal=journal, phase="answers",
        )  # fmt: skip
    convs = [
        Conversation(q, tok.decode([t for t in a if t not in end_ids]).strip(), p, a, row)
        for q, p, a, row in zip(questions, chats, answers, rows, strict=True)
    ]
    return convs, stats


def self_generated_conversations(
    model: CausalLM,
    tok: Tokenizer,
    model_hash: str,
    settings: GenerationSettings | None = None,
    *,
    cache: bool = True,
    progress: bool = True,
) -> ConversationSet:
    """The conversations ``model`` writes for itself (module docstring), from the cache when it has them.

    Parameters
    ----------
    model : the source model, in float32 (its greedy answers are the reference the converted model is judged by).
    tok : its tokenizer; must have a chat template.
    model_hash : ``model_content_hash`` of the model's files: the cache key.
    settings : ``GenerationSettings()`` by default.
    cache : read and write the cache (``cache_dir()``).
    progress : tqdm bars on stderr while generating.

    Raises
    ------
    ValueError : the tokenizer has no chat template.
    """
    import time

    if not has_chat_template(tok):
        raise ValueError("self-generated conversations need a chat template; this tokenizer has none")
    settings = settings or GenerationSettings()
    path = cached_path(model_hash, settings)
    if cache:
        try:
            return read_cached(model_hash, settings)
        except (OSError, ValueError, KeyError, TypeError):
            pass  # none, unreadable or too few rows: generate (the journal keeps the rows made before)
    start = time.perf_counter()
    journal = BatchJournal(path.with_suffix(".rows.jsonl")) if cache else None  # the rows made so far
    with torch.random.fork_rng(devices=[]):
        convs, stats = _generate(model, tok, settings, progress, journal)
    seconds = time.perf_counter() - start
    result = ConversationSet(*_split(convs), settings, model_hash, seconds, path if cache else None)
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        stored = cached_file(model_hash, settings)
        if stored is None or stored_count(stored) <= settings.count:  # never replace a larger set with a smaller one
            write_json_atomic(path, {
                "format": CACHE_FORMAT, "model_hash": model_hash, "settings": dataclasses.asdict(settings),
                "seconds": seconds, "stats": stats, "conversations": [dataclasses.asdict(c) for c in convs],
            })  # fmt: skip
    return result


def cached_path(model_hash: str, settings: GenerationSettings) -> Path:
    """The cache file that holds (or will hold) ``settings``' conversations of the model ``model_hash``."""
    return cache_dir() / f"{cache_key(model_hash, settings)}.json"


def cached_file(model_hash: str, settings: GenerationSettings) -> dict | None:
    """The cache file of this model and these settings (any count), parsed; ``None`` when there is none of this
    format and model that reads."""
    try:
        data = json.loads(cached_path(model_hash, settings).read_text(encoding="utf-8"))
        if data["format"] == CACHE_FORMAT and data["model_hash"] == model_hash:
            stored_count(data)
            return data
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def stored_count(data: dict) -> int:
    """User turns a parsed cache file holds."""
    return int(data["settings"]["count"])


def read_cached(model_hash: str, settings: GenerationSettings) -> ConversationSet:
    """The cached set of ``settings.count`` user turns of the model ``model_hash``: the conversations of the first
    rows of the cached file. ``ValueError`` when the cache holds no such file or fewer rows."""
    path = cached_path(model_hash, settings)
    data = cached_file(model_hash, settings)
    if data is None:
        raise ValueError(f"{path}: no readable set of this format and model")
    if stored_count(data) < settings.count:
        raise ValueError(f"{path}: {stored_count(data)} user turns, {settings.count} wanted")
    convs = [Conversation(**c) for c in data["conversations"]]
    stored = dataclasses.replace(settings, count=stored_count(data))
    return ConversationSet(*_split(convs), stored, model_hash, 0.0, path).first(settings.count)


def _split(convs: list[Conversation]) -> tuple[list[Conversation], list[Conversation]]:
    """``(train, held_out)`` by ``is_held_out``."""
    held = [is_held_out(c.question) for c in convs]
    return [c for c, h in zip(convs, held, strict=True) if not h], [c for c, h in zip(convs, held, strict=True) if h]


def chat_stream(convs: Sequence[Conversation], answer_weight: float = 1.0) -> tuple[list[int], list[float], list[int]]:
    """Conversations laid end to end for calibration and healing: ``(ids (N,), weights (N,), starts)``.

    ``weights[t]`` weighs the prediction made at position ``t`` (of token ``t + 1``): ``answer_weight`` where that
    token belongs to an answer, else 1, and 0 at each conversation's last position (it would predict the next
    conversation's first token). ``starts`` are the offsets where conversations begin.
    """
    ids: list[int] = []
    weights: list[float] = []
    starts: list[int] = []
    for c in convs:
        starts.append(len(ids))
        ids += c.ids
        n_prompt, n = len(c.prompt_ids), len(c.ids)
        weights += [answer_weight if t + 1 >= n_prompt else 1.0 for t in range(n - 1)] + [0.0]
    return ids, weights, starts
