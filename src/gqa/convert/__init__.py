"""Change a model's number of KV heads and write the result as an HF checkpoint folder.

``convert(src, dst, kv_heads=N)`` reads a GGUF file or HF folder, gives every layer ``N`` KV heads — exact
expansion when ``N`` is a multiple of ``H_kv``, a registered method (``mean``, ``first``, ...; see
``gqa.convert.methods``) when ``N`` divides ``H_kv`` — and writes ``config.json``, ``model.safetensors``,
``generation_config.json`` and the tokenizer to ``dst``, which loads in ``gqa.load_model`` and in transformers.
``convert(..., heal=HealConfig(steps=N))`` first distils the converted model from the source (``gqa.convert.healing``;
``heal(student, teacher, token_ids, steps=N)`` is the same on models in memory).

The package, a file per concept: ``run`` (``convert``, ``run_conversion``), ``plan`` (``check_conversion``: every
refusal first), ``state`` (``convert_state`` in memory), ``methods`` (the merges and their registry), ``streaming``
(a layer at a time), ``refit`` / ``value_refit`` / ``query_refit`` (least-squares refits), ``healing`` (distillation)
with ``shared_healing`` (across torchrun's ranks), ``conversations`` / ``data`` / ``calibration`` (what calibration and
healing read), ``extras`` (tokenizer and healing files), ``writer`` / ``shards`` (the safe, sharded folder).
"""

from __future__ import annotations

# ``name as name``: names gqa.convert held before its split into files, importable from here as they were (the CLI,
# the benchmarks and tests use them) though not in ``__all__``
from ..options.defaults import DEFAULT_METHOD, HEAL_LOG_NAME, HEAL_PLOT_NAME
from . import pca as _pca  # noqa: F401 - registers the "pca" method
from .calibration import default_calibration_text as default_calibration_text
from .calibration import default_heal_text as default_heal_text
from .conversations import CALIBRATION_CONVERSATIONS as CALIBRATION_CONVERSATIONS
from .conversations import HEALING_CONVERSATIONS as HEALING_CONVERSATIONS
from .conversations import ConversationSet as ConversationSet
from .conversations import GenerationSettings as GenerationSettings
from .healing import PRECISIONS, TRAINABLE, HealConfig, HealResult, heal, resolve_precision, save_loss_curve
from .methods import METHODS, AttentionWeights, Method, register_method
from .methods import check_kv_heads as check_kv_heads
from .plan import NEEDS_CALIBRATION as NEEDS_CALIBRATION
from .plan import ConversionPlan, check_conversion
from .plan import fits_in_memory as fits_in_memory
from .plan import resolve_device as resolve_device
from .refit import refit_convert_state
from .run import convert, run_conversion
from .shared_healing import CONVERSION_WAIT_S as CONVERSION_WAIT_S
from .state import _calibration_activations as _calibration_activations
from .state import convert_state

__all__ = [
    "DEFAULT_METHOD",
    "HEAL_LOG_NAME",
    "HEAL_PLOT_NAME",
    "METHODS",
    "PRECISIONS",
    "TRAINABLE",
    "AttentionWeights",
    "ConversionPlan",
    "HealConfig",
    "HealResult",
    "Method",
    "check_conversion",
    "convert",
    "convert_state",
    "heal",
    "refit_convert_state",
    "register_method",
    "resolve_precision",
    "run_conversion",
    "save_loss_curve",
]
