"""``Tokenizer``: a small wrapper over a transformers fast tokenizer, read from a GGUF file (transformers converts its
vocabulary) or an HF checkpoint folder, never from the network."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .loaders import resolve_model_path

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class Tokenizer:
    """Text <-> token ids, and chat prompts through the model's chat template.

    ``hf`` is the wrapped transformers tokenizer (``hf.save_pretrained(folder)`` writes it out).
    """

    def __init__(self, hf: PreTrainedTokenizerBase) -> None:
        self.hf = hf

    @classmethod
    def from_path(cls, path: str | Path | None = None) -> Tokenizer:
        """From a ``.gguf`` file, an HF checkpoint folder, a folder with one ``.gguf`` file, or ``None`` (the default
        SmolLM2 GGUF); see ``gqa.loaders.resolve_model_path``."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoTokenizer

        resolved = resolve_model_path(path)
        folder, extra = (resolved, {}) if resolved.is_dir() else (resolved.parent, {"gguf_file": resolved.name})
        try:
            hf = AutoTokenizer.from_pretrained(folder, local_files_only=True, **extra)
        except Exception as e:  # transformers raises OSError, ValueError, KeyError, ... for unusable files
            raise ValueError(f"{resolved}: cannot load a tokenizer ({type(e).__name__}: {e})") from None
        return cls(hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (``add_special_tokens``: the BOS/EOS the tokenizer adds by default, if any)."""
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat(
        self, prompt_or_messages: str | list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of a chat rendered with the chat template; a ``str`` is one user message."""
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("this tokenizer has no chat template; encode the prompt with encode() instead")
        messages = (
            [{"role": "user", "content": prompt_or_messages}]
            if isinstance(prompt_or_messages, str)
            else prompt_or_messages
        )
        text = self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
        return self.encode(text, add_special_tokens=False)  # the template writes any BOS itself

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.hf.eos_token_id
        return [] if eos is None else [int(eos)]

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def pad_token_id(self) -> int | None:
        """The padding id, or the (first) EOS id when the tokenizer has none."""
        pad = self.hf.pad_token_id
        return pad if pad is not None else next(iter(self.eos_token_ids), None)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return len(self.hf)

    def __repr__(self) -> str:
        return f"Tokenizer({type(self.hf).__name__}, vocab_size={self.vocab_size}, eos={self.eos_token_ids})"
