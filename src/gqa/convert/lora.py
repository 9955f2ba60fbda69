"""Low-rank adapters on the MLP while healing (``train="attention+mlp-lora"``), folded into the weights afterwards.

A merge changes only the attention blocks, but the MLPs after them may be able to absorb part of what the merge lost.
Training the MLP weights outright (``train="all"``) makes every step ~1.5x dearer (their weight gradients are full
matrix products: 1.45 s per step instead of 0.92 on docs/conversion.md's machine A). A LoRA adapter (Hu et al.,
arXiv 2106.09685) adds a trainable low-rank term to a frozen projection,

    y = W x + (alpha / r) B A x,        A (r, in), B (out, r), B = 0 at the start,

whose gradients cost thin products (SmolLM2 on a 2-core AVX2 CPU: 4.3 s per healing step instead of 3.7). The
adapters live on the ``nn.Linear`` modules themselves (parameters ``lora_a``/``lora_b`` and a forward hook), so the
model's ``named_parameters`` — and with them DDP and FSDP — carry them like any other parameter. ``fold_lora``
then adds ``(alpha / r) B A`` to each weight and removes the adapters: the healed model has the same tensors, names
and shapes as before, and runs at the same speed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MLP_LORA_ALPHA", "MLP_LORA_RANK", "MLP_PROJECTIONS", "add_lora", "fold_lora", "has_lora"]

MLP_LORA_RANK = 16  # r: 3.0M adapter parameters on SmolLM2 (30 layers x 3 projections), 2.2% of the model
MLP_LORA_ALPHA = 32.0  # the update is scaled by alpha / r
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _lora_hook(module: nn.Linear, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor:
    """``out + (alpha / r) B A x`` for ``x (*, in)``, ``out (*, out)``."""
    x = inputs[0]
    return out + module.lora_scale * F.linear(F.linear(x.to(module.lora_a.dtype), module.lora_a), module.lora_b).to(
        out.dtype
    )


def has_lora(module: nn.Module) -> bool:
    """Whether ``module`` carries an adapter from :func:`add_lora`."""
    return "lora_a" in module._parameters


def add_lora(
    model: nn.Module,
    names: Sequence[str] = MLP_PROJECTIONS,
    rank: int = MLP_LORA_RANK,
    alpha: float = MLP_LORA_ALPHA,
    seed: int = 0,
) -> list[nn.Parameter]:
    """Give every ``nn.Linear`` of ``model`` whose own name is in ``names`` a rank-``rank`` adapter; return them.

    ``A`` is drawn like ``nn.Linear``'s own weights (uniform in ``±1 / sqrt(in)``, from a generator seeded with
    ``seed``, so every process of a distributed run draws the same) and ``B`` is zero: the model computes exactly what
    it did until ``B`` trains. Both are float32 on the weight's device.
    """
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"LoRA rank must be an int >= 1, got {rank!r}")
    gen = torch.Generator().manual_seed(seed)
    params = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] not in names or not isinstance(module, nn.Linear):
            continue
        if has_lora(module):
            raise ValueError(f"{name} already has a LoRA adapter")
        out_features, in_features = module.weight.shape
        bound = 1.0 / math.sqrt(in_features)
        a = (torch.rand(rank, in_features, generator=gen) * 2 - 1) * bound
        module.register_parameter("lora_a", nn.Parameter(a.to(module.weight.device)))
        module.register_parameter("lora_b", nn.Parameter(torch.zeros(out_features, rank, device=module.weight.device)))
        module.lora_scale = alpha / rank
        module.register_forward_hook(_lora_hook)
        params += [module.lora_a, module.lora_b]
    if not params:
        raise ValueError(f"the model has no nn.Linear named {', '.join(names)} to adapt")
    return params


@torch.no_grad()
def fold_lora(model: nn.Module) -> int:
    """Add each adapter's ``(alpha / r) B A`` to its weight (in float32, then the weight's dtype) and remove the
    adapter and its hook; return how many were folded."""
    folded = 0
    for module in model.modules():
        if not has_lora(module):
            continue
        delta = module.lora_scale * (module.lora_b.float() @ module.lora_a.float())  # (out, in)
        module.weight.copy_((module.weight.float() + delta.to(module.weight.device)).to(module.weight.dtype))
        for key in [k for k, hook in module._forward_hooks.items() if hook is _lora_hook]:
            del module._forward_hooks[key]
        del module._parameters["lora_a"], module._parameters["lora_b"]
        del module.lora_scale
        folded += 1
    return folded
