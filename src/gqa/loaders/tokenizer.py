"""``Tokenizer``: text <-> token ids and chat prompts, read from a GGUF file or an HF checkpoint folder, never from
the network.

A GGUF file's byte-level BPE vocabulary is built directly with the ``tokenizers`` library
(``gqa.loaders.gguf_tokenizer``: no transformers import, the same ids as transformers' GGUF converter) and its chat
template rendered with jinja2 the way transformers renders it. An HF folder, or a GGUF tokenizer of another kind, goes
through transformers' ``AutoTokenizer``. Which of the two a model gets is the loader's choice
(``gqa.loaders.load_tokenizer``).
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jinja2 import Template
    from tokenizers import Tokenizer as BackendTokenizer
    from transformers import PreTrainedTokenizerBase

    from .gguf_reader import GGUFFile
    from .token_bytes import TokenBytes


class Tokenizer:
    """Text <-> token ids, and chat prompts through the model's chat template.

    Built either natively (``backend``: a ``tokenizers.Tokenizer``, with ``chat_template`` and the special tokens) or
    around a transformers tokenizer (``Tokenizer.from_hf``). ``hf`` is a transformers tokenizer either way (made on
    first use for a native one); ``save(folder)`` writes it out in the form every transformers version reads.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        chat_template: str | None = None,
        special_tokens: dict[str, str | None] | None = None,
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template or None
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self._hf: PreTrainedTokenizerBase | None = None
        self._token_bytes: TokenBytes | None = None

    @classmethod
    def from_hf(cls, hf: PreTrainedTokenizerBase) -> Tokenizer:
        """Around a transformers tokenizer: every call goes to it."""
        tok = cls(hf.backend_tokenizer, chat_template=getattr(hf, "chat_template", None))
        tok.special_tokens = dict(hf.special_tokens_map)
        tok._hf = hf
        return tok

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> Tokenizer:
        """Natively from an opened GGUF file (byte-level BPE only: ``ValueError`` otherwise)."""
        from .gguf_tokenizer import backend_from_gguf, special_tokens_from_gguf

        template = g.metadata.get("tokenizer.chat_template")
        return cls(
            backend_from_gguf(g),
            chat_template=template if isinstance(template, str) else None,
            special_tokens=special_tokens_from_gguf(g),
        )

    @classmethod
    def from_pretrained(cls, resolved: Path) -> Tokenizer:
        """Through transformers' ``AutoTokenizer`` from an HF checkpoint folder or a ``.gguf`` file (sentencepiece,
        unigram, ... GGUF tokenizers), local files only. (``gqa.load_tokenizer`` picks this or ``from_gguf``.)"""
        return cls.from_hf(_transformers_tokenizer(resolved))

    @property
    def hf(self) -> PreTrainedTokenizerBase:
        """The transformers tokenizer (built from ``backend`` on first use for a native one)."""
        if self._hf is None:
            from transformers import PreTrainedTokenizerFast

            self._hf = PreTrainedTokenizerFast(
                tokenizer_object=self.backend, chat_template=self.chat_template, **self.special_tokens
            )
        return self._hf

    def save(self, folder: Path) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` to ``folder`` as transformers 5 and 4 and llama.cpp's
        ``convert_hf_to_gguf.py`` (which loads the folder with transformers) all read them (``portable_config``)."""
        self.hf.save_pretrained(folder)
        portable_config(Path(folder))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (``add_special_tokens``: the BOS/EOS the tokenizer adds by default, if any)."""
        if self._hf is not None:
            return list(self._hf.encode(text, add_special_tokens=add_special_tokens))
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._hf is not None:
            return self._hf.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token: int) -> bytes:
        """The bytes ``token`` stands for, read from the vocabulary (``token_bytes.TokenBytes``): a piece of a
        multi-byte character is its bytes, not U+FFFD; joined in order, tokens' bytes are their text's UTF-8."""
        if self._token_bytes is None:
            from .token_bytes import TokenBytes

            self._token_bytes = TokenBytes(self.backend, self.decode)
        return self._token_bytes(token)

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
        """The chat template's text for ``messages`` (``[{"role": ..., "content": ...}, ...]``); ``tools``: function
        definitions (OpenAI's ``tools``) for a template that renders them."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template; encode the prompt with encode() instead")
        if self._hf is not None:
            return self._hf.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                                tokenize=False)  # fmt: skip
        return _compiled(self.chat_template).render(
            messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **self.special_tokens
        )

    def apply_chat(
        self,
        prompt_or_messages: str | list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> list[int]:
        """Token ids of a chat rendered with the chat template; a ``str`` is one user message."""
        messages = (
            [{"role": "user", "content": prompt_or_messages}]
            if isinstance(prompt_or_messages, str)
            else prompt_or_messages
        )
        text = self.render_chat(messages, add_generation_prompt, tools)
        return self.encode(text, add_special_tokens=False)  # the template writes any BOS itself

    def use_chat_template(self, template: str) -> None:
        """Render chats with ``template`` (jinja, as transformers renders chat templates) instead of the model's;
        ``ValueError`` when it does not compile."""
        _compiled(template)
        self.chat_template = template
        if self._hf is not None:
            self._hf.chat_template = template

    def token_id(self, token: str) -> int | None:
        """The id of a whole token (``"<|im_end|>"``), or ``None`` when the vocabulary has no such token."""
        return self.backend.token_to_id(token)

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self._id("eos_token")
        return [] if eos is None else [eos]

    @property
    def bos_token_id(self) -> int | None:
        return self._id("bos_token")

    @property
    def pad_token_id(self) -> int | None:
        """The padding id, or the (first) EOS id when the tokenizer has none."""
        pad = self._id("pad_token")
        return pad if pad is not None else next(iter(self.eos_token_ids), None)

    def _id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.backend.token_to_id(str(token))

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __repr__(self) -> str:
        kind = type(self._hf).__name__ if self._hf is not None else "native"
        return f"Tokenizer({kind}, vocab_size={self.vocab_size}, eos={self.eos_token_ids})"


# tokenizer classes only transformers 5 has -> the class transformers 4 reads the same files with
_NEW_CLASSES = {"TokenizersBackend": "PreTrainedTokenizerFast"}
_TEMPLATE, _MORE_TEMPLATES = "chat_template.jinja", "additional_chat_templates"


def portable_config(folder: Path) -> None:
    """Rewrite the ``tokenizer_config.json`` transformers 5 wrote in ``folder`` into the form transformers 4 reads too:
    ``tokenizer_class`` ``PreTrainedTokenizerFast`` for ``TokenizersBackend`` (a class 4 lacks: it cannot load the
    folder), the extra special tokens as ``additional_special_tokens`` (4 takes ``extra_special_tokens`` for a dict
    of named tokens and fails on 5's list), and the chat templates inside it, where every version looks, instead of
    in ``chat_template.jinja`` and ``additional_chat_templates/`` (files older versions do not read)."""
    file = folder / "tokenizer_config.json"
    cfg = json.loads(file.read_text(encoding="utf-8"))
    cfg["tokenizer_class"] = _NEW_CLASSES.get(cfg.get("tokenizer_class"), cfg.get("tokenizer_class"))
    extra = cfg.get("extra_special_tokens")
    if isinstance(extra, list):
        del cfg["extra_special_tokens"]
        cfg["additional_special_tokens"] = list(dict.fromkeys([*cfg.get("additional_special_tokens", []), *extra]))
    if (folder / _TEMPLATE).is_file():
        template = (folder / _TEMPLATE).read_text(encoding="utf-8")
        more = sorted((folder / _MORE_TEMPLATES).glob("*.jinja"))
        named = [{"name": f.stem, "template": f.read_text(encoding="utf-8")} for f in more]
        cfg["chat_template"] = [{"name": "default", "template": template}, *named] if named else template
        (folder / _TEMPLATE).unlink()
        for f in more:
            f.unlink()
        if more:
            (folder / _MORE_TEMPLATES).rmdir()
    file.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _transformers_tokenizer(resolved: Path) -> PreTrainedTokenizerBase:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    folder, extra = (resolved, {}) if resolved.is_dir() else (resolved.parent, {"gguf_file": resolved.name})
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True, **extra)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError, ... for unusable files
        raise ValueError(f"{resolved}: cannot load a tokenizer ({type(e).__name__}: {e})") from None


@lru_cache(maxsize=8)
def _compiled(template: str) -> Template:
    """``template`` compiled as transformers compiles chat templates: a sandbox, ``trim_blocks``/``lstrip_blocks``,
    loop controls, a ``tojson`` that keeps non-ASCII and HTML characters, ``raise_exception`` and ``strftime_now``."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not compile: {e}") from None
