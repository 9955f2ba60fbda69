"""What rank 0 writes beside the weights and the config: the source's tokenizer (in the form every reader of an HF
folder takes), and after healing its loss curve (``heal_loss.png``) and log (``heal_log.json``)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from ..options.defaults import HEAL_LOG_NAME, HEAL_PLOT_NAME
from .data import HEAL_PROSE_SHARE
from .healing import HealResult, save_loss_curve
from .plan import ConversionPlan, Converted


def write_extras(folder: Path, plan: ConversionPlan, data: Converted, result: HealResult | None) -> None:
    """Rank 0: the tokenizer, and healing's loss curve and log."""
    if plan.tok is not None:
        plan.tok.save(folder)  # in the form transformers 4 and llama.cpp's converter read too
    if result is None:
        return
    cfg, chats, h = plan.source.config, data.chats, plan.heal
    save_loss_curve(result, folder / HEAL_PLOT_NAME, f"healing {cfg.num_kv_heads} -> {plan.kv_heads} KV heads "
                    f"({plan.method}), train={h.train}, lr={h.lr:g}")  # fmt: skip
    if plan.heal_text is not None or chats is None:
        text = "default_heal_text()" if plan.heal_text is None else f"{len(plan.heal_text)} characters given"
    else:
        text = (f"self-generated conversations + default_heal_text() ({len(chats.train)} conversations, "
                f"{HEAL_PROSE_SHARE:.0%} of windows prose)")  # fmt: skip
    log = {
        "config": dataclasses.asdict(result.config),
        "text": text,
        "seconds": result.seconds,
        "seconds_per_step": result.seconds_per_step,
        "cpu_seconds": result.cpu_seconds,
        "threads": torch.get_num_threads(),
        "processes": torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1,
        "sharding": result.sharding,
        "device": str(plan.device),
        "precision": result.precision,
        "tokens_per_step": result.tokens_per_step,
        "trained_parameters": result.trained_parameters,
        "losses": result.losses,
        "lrs": result.lrs,
        "local": None if result.local is None else dataclasses.asdict(result.local),
    }
    (folder / HEAL_LOG_NAME).write_text(json.dumps(log, indent=1) + "\n", encoding="utf-8")
