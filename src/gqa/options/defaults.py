"""The choices and defaults that gqa's command line shows in ``--help``, defined here, without torch, and imported
from here by the modules that use them: building the parser (``gqa --help``, ``gqa COMMAND --help``) then imports
no torch. A name is defined once, here; its users re-export it where it was defined before (``gqa.convert.HealConfig``,
``gqa.evaluation.perplexity.DEFAULT_WINDOW``, ...)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from decimal import Decimal

__all__ = [
    "BUILTIN_METHODS",
    "CALIBRATION_CONVERSATIONS",
    "DEFAULT_MAX_SHARD_SIZE",
    "DEFAULT_METHOD",
    "DEFAULT_WINDOW",
    "EVALUATION_CONVERSATIONS",
    "HEALING_CONVERSATIONS",
    "HEAL_LOG_NAME",
    "HEAL_PLOT_NAME",
    "HELD_OUT_CONVERSATIONS",
    "PRECISIONS",
    "QUANT_FORMATS",
    "SHARDINGS",
    "SIZE_UNITS",
    "TRAINABLE",
    "HealConfig",
    "parse_size",
]

# gqa.models.quantized.FORMATS: the block formats weights are quantized to
QUANT_FORMATS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")

# gqa.evaluation.perplexity and gqa.evaluation.suite (gqa eval)
DEFAULT_WINDOW = 512
HELD_OUT_CONVERSATIONS = 100  # of the held-out conversations, in their order

# gqa.convert (gqa convert)
DEFAULT_METHOD = "pca"  # calibrated, training-free; far better than the paper's mean-pooling (docs/conversion.md)
BUILTIN_METHODS = ("first", "mean", "pca")  # what gqa.convert.methods.METHODS holds before any register_method
HEAL_PLOT_NAME = "heal_loss.png"  # written inside DST when healing: the loss curve
HEAL_LOG_NAME = "heal_log.json"  # and the per-step losses, learning rates, settings and timing
# gqa.convert.conversations: user turns sampled for a conversion's calibration (the knee of the curve in
# docs/conversion.md, "The calibration budget": SmolLM2 3 -> 1 kept 18/18/22/21/23 of 38 right answers and answer KL
# 0.72/0.63/0.58/0.52/0.49 at 64/128/256/512/1400), when it also heals on them (not measured below 1400), and for
# gqa eval --suite's held-out set (100 of its ~120 held-out conversations)
CALIBRATION_CONVERSATIONS = 256
HEALING_CONVERSATIONS = 1400
EVALUATION_CONVERSATIONS = 1400

# gqa.convert.healing
TRAINABLE = ("attention", "attention+mlp-lora", "all")  # attention+mlp-lora: and LoRA adapters on the MLP
PRECISIONS = ("auto", "bf16", "fp32")  # bf16: the passes under bfloat16 autocast, float32 weights and optimizer
SHARDINGS = ("auto", "ddp", "fsdp")  # across processes: replicated models (DDP) or sharded ones (FSDP)

# gqa.convert.shards
DEFAULT_MAX_SHARD_SIZE = "5GB"  # transformers' save_pretrained default
# unit (upper case) -> bytes: every spelling parse_size takes. Bare K/M/G/T count powers of 1000 as KB/MB/GB/TB do
# (transformers' convert_file_size_to_int: "5GB" is 5 * 10**9); an "i" (Ki, KiB, Gi, GiB, ...) makes them powers of 1024
_UNITS = {"": 1, "B": 1} | {
    prefix + suffix: base ** (i + 1)
    for i, prefix in enumerate("KMGT")
    for suffix, base in (("", 1000), ("B", 1000), ("I", 1024), ("IB", 1024))
}
SIZE_UNITS = (
    "B; K, M, G, T or KB, MB, GB, TB (powers of 1000); Ki, Mi, Gi, Ti or KiB, MiB, GiB, TiB (powers of 1024); any case"
)


def parse_size(size: int | str) -> int:
    """Bytes from a positive int or a size as transformers writes them: ``"5GB"`` (5 * 10**9), ``"500MB"``,
    ``"2GiB"`` (2 * 2**30); also ``"500M"`` (bare K/M/G/T are decimal, as KB/MB/GB/TB), ``"2Gi"``, decimals
    (``"1.5GB"``), any case. ``ValueError`` naming the accepted units for anything else, or for less than a byte."""
    value = None
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    elif isinstance(size, str) and (m := re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", size, re.ASCII)):
        unit = _UNITS.get(m.group(2).upper())
        value = None if unit is None else int(Decimal(m.group(1)) * unit)  # exact: "4.35MB" is 4,350,000
    if value is None or value < 1:
        raise ValueError(
            f"max shard size must be a positive number of bytes, or a number and a unit ({SIZE_UNITS}) such as '5GB' "
            f"or '500MiB'; got {size!r}"
        )
    return value


END_TO_END_LR = 1e-4  # healing's peak learning rate from the merge (docs/conversion.md)
AFTER_LOCAL_LR = 2e-5  # after the layer-local phase, where 1e-4 undid it (answer KL 0.329 -> 0.286 in 10 minutes)


@dataclass(frozen=True)
class HealConfig:
    """The knobs of ``gqa.convert.healing.heal`` (see there), as one value for
    ``gqa.convert.convert(..., heal=HealConfig(...))`` and ``gqa convert --heal-*``. One default differs from
    ``heal()``'s own: ``local_share`` is 0.5 here (the measured recipe) and 0 there (end-to-end only). ``lr=None``
    (default) becomes ``END_TO_END_LR`` end-to-end only, ``AFTER_LOCAL_LR`` after a layer-local phase."""

    steps: int
    lr: float | None = None
    seq_len: int = 256
    batch_size: int = 1
    train: str = "attention"
    warmup: int | None = None
    seed: int = 0
    precision: str = "auto"
    minutes: float | None = None
    sharding: str = "auto"
    local_share: float = 0.5  # layer-local first: answer KL 0.323 -> 0.300 in 30 min (docs/conversion.md)

    def __post_init__(self) -> None:
        if self.lr is None:  # (frozen: set once, here)
            share = self.local_share
            local = not isinstance(share, bool) and isinstance(share, (int, float)) and share > 0
            object.__setattr__(self, "lr", AFTER_LOCAL_LR if local else END_TO_END_LR)
        for name in ("steps", "seq_len", "batch_size", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"heal {name} must be an int, got {value!r}")
        if self.steps < 1:
            raise ValueError(f"heal steps must be >= 1, got {self.steps}")
        if self.seq_len < 2:
            raise ValueError(f"heal seq_len must be >= 2 tokens, got {self.seq_len}")
        if self.batch_size < 1:
            raise ValueError(f"heal batch_size must be >= 1, got {self.batch_size}")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"heal lr must be a positive number, got {self.lr!r}")
        if self.train not in TRAINABLE:
            raise ValueError(f"heal train must be one of {', '.join(TRAINABLE)}; got {self.train!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"heal precision must be one of {', '.join(PRECISIONS)}; got {self.precision!r}")
        if self.sharding not in SHARDINGS:
            raise ValueError(f"heal sharding must be one of {', '.join(SHARDINGS)}; got {self.sharding!r}")
        if self.minutes is not None and not (
            isinstance(self.minutes, (int, float)) and not isinstance(self.minutes, bool)
            and math.isfinite(self.minutes) and self.minutes > 0
        ):  # fmt: skip
            raise ValueError(f"heal minutes must be a positive number or None, got {self.minutes!r}")
        if self.warmup is not None and not (isinstance(self.warmup, int) and 0 <= self.warmup <= self.steps):
            raise ValueError(f"heal warmup must be an int in [0, steps={self.steps}], got {self.warmup!r}")
        if isinstance(self.local_share, bool) or not (
            isinstance(self.local_share, (int, float)) and 0 <= self.local_share < 1
        ):
            raise ValueError(f"heal local_share must be a number in [0, 1), got {self.local_share!r}")
