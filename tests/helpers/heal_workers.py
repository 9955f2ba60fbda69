"""What the distributed-healing tests run on every rank (``gqa.parallel.distributed.launch_local`` spawns the ranks,
so it lives in an importable module): heal a tiny model and return the losses and the healed weights."""

from __future__ import annotations

import dataclasses

import torch

from gqa.convert import heal


def heal_tiny(teacher_state: dict, student_state: dict, cfgs: tuple, ids: torch.Tensor, weights: torch.Tensor,
              kwargs: dict) -> dict:  # fmt: skip
    """Heal ``student`` from ``teacher`` (``CausalLM`` states with configs ``cfgs``) on ``ids`` with loss weights."""
    from gqa.models import CausalLM

    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # its first use imports torch._dynamo (seconds): not
    # inside a time budget
    teacher = CausalLM.from_state(cfgs[0], teacher_state)
    student = CausalLM.from_state(cfgs[1], student_state)
    result = heal(student, teacher, ids, weights=weights, progress=False, **kwargs)
    local = None if result.local is None else dataclasses.asdict(result.local)
    return {"losses": result.losses, "lrs": result.lrs, "state": student.state_dict(), "sharding": result.sharding,
            "local": local}  # fmt: skip
