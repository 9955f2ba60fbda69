"""A conversion checked before anything slow runs: ``check_conversion`` makes every refusal ``convert`` would make
(the arguments, the source's config, tensor headers and tokenizer, the destination, the device) and returns the
``ConversionPlan`` that ``run_conversion`` carries out and ``gqa convert --dry-run`` estimates from."""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..hardware import available_memory
from ..loaders import resolve_model_path
from ..loaders.lazy import LazyModel, open_lazy
from ..models.config import ModelConfig
from ..options.defaults import DEFAULT_METHOD
from .conversations import (
    CALIBRATION_CONVERSATIONS,
    HEALING_CONVERSATIONS,
    ConversationSet,
    GenerationSettings,
    has_chat_template,
)
from .data import HealData
from .healing import HealConfig
from .methods import METHODS, check_kv_heads
from .shards import DEFAULT_MAX_SHARD_SIZE, SAFETENSORS_DTYPES, parse_size
from .writer import check_destination

if TYPE_CHECKING:
    from ..loaders.tokenizer import Tokenizer

NEEDS_CALIBRATION = {"pca"}


@dataclasses.dataclass
class ConversionPlan:
    """A checked conversion (``check_conversion``): what ``convert`` was asked, resolved."""

    resolved: Path
    out: Path
    source: LazyModel
    kv_heads: int
    method: str
    calibration_text: str | None
    do_refit: bool
    calibrating: bool
    heal: HealConfig | None
    heal_text: str | None
    tok: Tokenizer | None
    chats_wanted: bool
    dtype: torch.dtype  # the config's: the one asked for, else the source's dominant (2-D weights') dtype
    device: torch.device
    max_shard_size: int | str
    cast: torch.dtype | None = None  # the dtype asked for, every tensor cast to it; None: each keeps its own
    calibration_conversations: int = CALIBRATION_CONVERSATIONS  # user turns the calibration reads

    @property
    def conversation_settings(self) -> GenerationSettings:
        """The conversations to generate (or read from the cache): the calibration's, or healing's if it reads more."""
        heals = self.heal is not None and self.heal_text is None
        count = max(self.calibration_conversations, HEALING_CONVERSATIONS if heals else 0)
        return GenerationSettings(count=count)


@dataclasses.dataclass
class Converted:
    """What rank 0's conversion hands to healing and to the extra files."""

    cfg: ModelConfig
    heal_data: HealData | None
    chats: ConversationSet | None


def check_conversion(
    src: str | Path | None = None,
    dst: str | Path | None = None,
    *,
    kv_heads: int,
    method: str = DEFAULT_METHOD,
    force: bool = False,
    calibration_text: str | None = None,
    refit: bool | None = None,
    heal: HealConfig | None = None,
    heal_text: str | None = None,
    conversations: bool | None = None,
    calibration_conversations: int | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "auto",
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> ConversionPlan:
    """Every refusal ``convert`` makes with the same arguments, made first: the arguments, then the source's config,
    tensor headers and tokenizer (no weights), ``dst`` and the device. Writes nothing; the checked plan it returns is
    what ``gqa convert --dry-run`` estimates from. ``convert`` calls it before anything slow."""
    if dst is None:
        raise TypeError("convert() needs a destination folder dst")
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; known methods: {', '.join(sorted(METHODS))}")
    if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads < 1:
        raise ValueError(f"kv_heads must be a positive int, got {kv_heads!r}")
    if refit is not None and not isinstance(refit, bool):
        raise TypeError(f"refit must be a bool or None, got {type(refit).__name__}")
    if heal is not None and not isinstance(heal, HealConfig):
        raise TypeError(f"heal must be a HealConfig or None, got {type(heal).__name__}")
    if heal_text is not None and heal is None:
        raise ValueError("heal_text is only used when healing: pass heal=HealConfig(steps=...)")
    given_count = calibration_conversations is not None
    if calibration_conversations is None:
        calibration_conversations = CALIBRATION_CONVERSATIONS
    elif isinstance(calibration_conversations, bool) or not isinstance(calibration_conversations, int):
        raise TypeError(f"calibration_conversations must be an int or None, got {calibration_conversations!r}")
    elif calibration_conversations < 1:
        raise ValueError(f"calibration_conversations must be >= 1, got {calibration_conversations}")
    if dtype is not None and dtype not in SAFETENSORS_DTYPES:
        raise TypeError(f"dtype must be None or one of {', '.join(map(str, SAFETENSORS_DTYPES))}, got {dtype!r}")
    parse_size(max_shard_size)
    if src is not None and not Path(src).expanduser().exists():
        raise FileNotFoundError(f"source model {src} does not exist")
    resolved = resolve_model_path(None if src is None else Path(src).expanduser())
    sources = [resolved] if src is None else [Path(src), resolved]
    out = check_destination(sources, Path(dst), force)  # fail before the slow part
    source = open_lazy(resolved)
    cfg = source.config
    check_kv_heads(cfg, kv_heads, method)
    if heal is not None and kv_heads >= cfg.num_kv_heads:
        raise ValueError(
            f"healing only applies when merging KV heads (kv_heads < {cfg.num_kv_heads}); going to {kv_heads} is exact"
        )
    tok = _source_tokenizer(resolved)
    if heal is not None and tok is None:
        raise ValueError(f"{resolved}: healing reads a text, which needs the source's tokenizer, and it has none")
    merging = kv_heads < cfg.num_kv_heads
    do_refit = merging and (method in NEEDS_CALIBRATION if refit is None else refit)
    calibrating = merging and (calibration_text is not None or method in NEEDS_CALIBRATION or do_refit)
    if calibrating and tok is None:
        raise ValueError(
            f"{resolved}: method {method!r} calibrates on text, which needs the source's tokenizer, and it has "
            "none; use method 'mean' or 'first' without the refit, or add the tokenizer files"
        )
    wanted = (calibrating and calibration_text is None) or (heal is not None and heal_text is None)
    chats = _use_conversations(conversations, tok, wanted)
    if chats and conversations is None and not fits_in_memory(source):
        warnings.warn(f"{resolved}: too large to write its own calibration conversations in memory; calibrating on "
                      "the built-in prose (pass conversations=True to insist)", stacklevel=3)  # fmt: skip
        chats = False
    if given_count and not (chats and calibrating and calibration_text is None):
        if not calibrating:
            how = "does not calibrate"
        elif calibration_text is not None:
            how = "calibrates on the given text"
        else:
            how = "calibrates on the built-in prose"
        raise ValueError(
            "calibration_conversations (--calibration-conversations) only applies when the calibration reads "
            f"self-generated conversations; this conversion {how}"
        )
    return ConversionPlan(resolved, out, source, kv_heads, method, calibration_text, do_refit, calibrating, heal,
                          heal_text, tok, chats, source.dtype if dtype is None else dtype, resolve_device(device),
                          max_shard_size, cast=dtype,
                          calibration_conversations=calibration_conversations)  # fmt: skip


def fits_in_memory(source: LazyModel, share: float = 0.5) -> bool:
    """Whether ``source`` in float32 takes at most ``share`` of the memory available now (``True`` where that is
    unknown)."""
    need = sum(int(torch.Size(s).numel()) * 4 for s in source.shapes.values())
    available = available_memory()
    return available is None or need <= share * available


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"``: the local CUDA GPU when there is one (under torchrun, this rank's), else the CPU; else as given."""
    if isinstance(device, str) and device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} was asked for, but torch sees no CUDA GPU")
    if device.type == "cuda" and device.index is None:  # under torchrun: this rank's GPU
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return device


def _source_tokenizer(resolved: Path) -> Tokenizer | None:
    from ..loaders import load_tokenizer

    try:
        return load_tokenizer(resolved)
    except ValueError as e:
        warnings.warn(f"{resolved}: no usable tokenizer, the converted model will have none ({e})", stacklevel=3)
        return None


def _use_conversations(conversations: bool | None, tok: Tokenizer | None, wanted: bool) -> bool:
    """Whether calibration or healing (``wanted``: one of them has no text given) reads conversations."""
    if conversations is not None and not isinstance(conversations, bool):
        raise TypeError(f"conversations must be a bool or None, got {type(conversations).__name__}")
    if conversations and not has_chat_template(tok):
        raise ValueError("conversations=True needs a source whose tokenizer has a chat template; this one has none")
    return wanted and conversations is not False and has_chat_template(tok)
