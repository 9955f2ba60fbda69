"""Healing under torchrun: rank 0 converts and writes, then every rank heals the written model from the source
(``gqa.convert.healing.heal``, data-parallel) and rank 0 rewrites the weights. The ranks waiting on rank 0's
conversion wait in a group of their own, with a timeout long enough for it (``CONVERSION_WAIT_S``)."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from ..loaders import read_model
from .healing import HealResult, heal
from .plan import ConversionPlan, Converted
from .writer import remove_weights, write_weights

_WAITING = None
CONVERSION_WAIT_S = 6 * 3600.0


def waiting_group() -> Any:
    """A gloo group over every rank with ``CONVERSION_WAIT_S`` of timeout, for the ranks waiting on rank 0's
    conversion (which can take far longer than the training collectives' ``GQA_DIST_TIMEOUT``)."""
    global _WAITING
    if _WAITING is None:
        _WAITING = torch.distributed.new_group(backend="gloo", timeout=timedelta(seconds=CONVERSION_WAIT_S))
    return _WAITING


def forget_waiting_group() -> None:
    """Drop the waiting group: it goes with the process group it was made in."""
    global _WAITING
    _WAITING = None


def heal_folder(
    plan: ConversionPlan, folder: Path | None, data: Converted | None, world: int, progress: bool
) -> HealResult:
    """Every rank: heal the converted model written in rank 0's ``folder`` from the source; rank 0 then rewrites the
    weights there."""
    from ..models import CausalLM

    if world > 1:
        shared = [None if folder is None else (str(folder), data)]
        torch.distributed.broadcast_object_list(shared, src=0, group=waiting_group())
        folder, data = Path(shared[0][0]), shared[0][1]
    cfg = plan.source.config
    teacher = CausalLM.from_state(cfg, read_model(plan.resolved)[1], assign=True)
    student = CausalLM.from_state(data.cfg, read_model(folder)[1], assign=True)
    d = data.heal_data
    result = heal(
        student, teacher, d.ids, weights=d.weights, starts=d.starts, progress=progress, device=plan.device,
        **dataclasses.asdict(plan.heal),
    )  # fmt: skip  # under FSDP the models stay on the CPU and their shards go to the device
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return result
    remove_weights(folder)
    write_weights(folder, data.cfg, student.state_dict(), plan.dtype, plan.max_shard_size)
    return result
