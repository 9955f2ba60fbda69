"""Layer-local healing: each converted attention block learns to reproduce the source block's output on its own.

End-to-end healing (``gqa.convert.healing``) pays, per step, a forward pass of two whole models and a backward pass
of one, lm_head included, for a signal that reaches each merged attention block only through every layer above it.
But the conversion changed nothing except the attention blocks, and each block's job is known exactly: given the
source model's hidden states ``X_l (L, E)`` (after ``input_layernorm``) it should return the source block's output
``Y_l (L, E)``. So, as LoLCATs' "attention transfer" (arXiv 2410.10254) does before its short end-to-end pass:

1. ``capture``: run the teacher once over ``windows`` and keep, for every layer, its attention input and output
   (bfloat16, ``2 * layers * tokens * E`` values).
2. ``train_blocks``: AdamW on the student's q/k/v/o projections, each step a batch of windows through **every**
   layer's attention block alone (layers are independent, so one backward serves them all), minimising the sum over
   layers of the block's relative squared error ``||attn_l(X_l) - Y_l||^2 / ||Y_l||^2`` (each layer counts alike,
   whatever the scale of its output). A step costs the attention projections of every layer, not the MLPs nor
   the 49k-row lm_head: many more tokens per second than an end-to-end step.

Across processes (a torch.distributed process group of ``N > 1`` ranks, e.g. under torchrun) the layers are dealt
out: rank ``r`` captures and trains layers ``r, r + N, ...`` only, and each layer's weights are then broadcast from
the rank that trained it. Layers do not interact in this phase, so that is the same training as one process's, in
about ``1 / N`` of the step time and memory (the teacher's forward for the capture still runs on every rank).

Shapes: ``windows (N, L)`` token ids; per layer ``inputs``/``outputs`` ``(N, L, E)``.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["BlockTargets", "LocalResult", "block_errors", "capture", "heal_blocks", "train_blocks", "windows_that_fit"]

STORE_DTYPE = torch.bfloat16  # captured activations: half the memory of float32, ~3 significant digits
LOCAL_WINDOWS = 384  # windows captured from the teacher at most (x seq_len tokens; 8 held out to measure the error)
HELD_OUT_WINDOWS = 8
MIN_WINDOWS = 32  # captured whatever the time budget says
CAPTURE_SHARE = 0.25  # of the phase's time budget the capture may take (then it stops at fewer windows)
MEMORY_SHARE = 0.5  # of the memory available when the phase starts the captured activations may take
LOCAL_LR = 3e-4  # peak AdamW learning rate of the layer-local phase
LOCAL_BATCH = 4  # windows per layer-local step
_clock = time.perf_counter  # the wall clock of a ``minutes`` budget (tests replace it, as healing._clock)


@dataclass
class BlockTargets:
    """The source model's attention inputs and outputs on some windows, per layer.

    Attributes
    ----------
    inputs, outputs : per captured layer ``(N, L, E)`` in ``STORE_DTYPE``: the block's input (after
        ``input_layernorm``) and its output (before the residual sum).
    energy : per captured layer, the mean squared value of ``outputs`` (the relative error's denominator).
    layers : the model's layer index of each entry (default: all of them, in order).
    """

    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    energy: list[float] = field(default_factory=list)
    layers: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.layers:
            self.layers = list(range(len(self.inputs)))

    @property
    def windows(self) -> int:
        return self.inputs[0].shape[0]

    def split(self, held_out: int) -> tuple[BlockTargets, BlockTargets]:
        """``(train, held_out)``: the last ``held_out`` windows apart."""
        n = self.windows - held_out
        first = BlockTargets([x[:n] for x in self.inputs], [y[:n] for y in self.outputs], self.energy, self.layers)
        last = BlockTargets([x[n:] for x in self.inputs], [y[n:] for y in self.outputs], self.energy, self.layers)
        return first, last


def _layers(model: nn.Module) -> nn.ModuleList:
    return model.model.layers


def _owner(layer: int, world: int) -> int:
    """The rank that trains ``layer`` (and broadcasts its weights) when ``world`` ranks share the phase."""
    return layer % world


def _own_layers(count: int, rank: int, world: int) -> list[int]:
    """The layers ``rank`` captures and trains: its own (``_owner``), or, with more ranks than layers, a copy of one it
    trains only to keep in step with the others (its weights are not kept)."""
    return list(range(rank, count, world)) or [rank % count]


def slowest_seconds(seconds: float, device: torch.device, distributed: bool) -> float:
    """``seconds``, or with ``distributed`` the largest of every rank's (the same on all of them)."""
    if not distributed:
        return seconds
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


@torch.no_grad()
def capture(
    teacher: nn.Module,
    windows: torch.Tensor,
    batch_size: int = 8,
    layers: list[int] | None = None,
    *,
    seconds: float | None = None,
    distributed: bool = False,
) -> BlockTargets:
    """Run ``teacher`` (a ``gqa.models.CausalLM``) over ``windows (N, L)`` and keep the attention input and output of
    ``layers`` (indices; default every layer).

    ``seconds``: stop after the batch that reaches this wall time (at least ``MIN_WINDOWS`` windows are captured), so
    the targets hold the first ``n <= N`` windows; with ``distributed``, on the slowest rank's clock, so that every
    rank stops at the same window. The teacher runs under whatever autocast the caller set."""
    if windows.dim() != 2 or windows.shape[0] < 1:
        raise ValueError(f"windows must be token ids (N, L) with N >= 1, got shape {tuple(windows.shape)}")
    count = len(_layers(teacher))
    layers = list(range(count)) if layers is None else list(layers)
    if not layers or not all(0 <= i < count for i in layers):
        raise ValueError(f"layers must be a non-empty list of indices below {count}, got {layers}")
    n, length = windows.shape
    e = teacher.config.hidden_size
    inputs = [torch.empty(n, length, e, dtype=STORE_DTYPE) for _ in layers]
    outputs = [torch.empty(n, length, e, dtype=STORE_DTYPE) for _ in layers]
    rows = slice(0, 0)

    def keep(i: int) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict, out: torch.Tensor) -> None:
            inputs[i][rows] = args[0].to(STORE_DTYPE).cpu()
            outputs[i][rows] = out.to(STORE_DTYPE).cpu()

        return hook

    modules = _layers(teacher)
    handles = [modules[i].self_attn.register_forward_hook(keep(j), with_kwargs=True) for j, i in enumerate(layers)]
    device = next(teacher.parameters()).device
    begin = _clock()
    try:
        for start in range(0, n, batch_size):
            rows = slice(start, min(start + batch_size, n))
            teacher(windows[rows].to(device))
            enough = seconds is not None and rows.stop >= min(MIN_WINDOWS, n)  # the same on every rank
            if enough and slowest_seconds(_clock() - begin, device, distributed) >= seconds:
                break
    finally:
        for h in handles:
            h.remove()
    if rows.stop < n:  # stopped early: views of the first windows (pages never written were never allocated)
        inputs, outputs = [x[: rows.stop] for x in inputs], [y[: rows.stop] for y in outputs]
    energy = [float(y.float().pow(2).mean()) for y in outputs]
    return BlockTargets(inputs, outputs, energy, layers)


def windows_that_fit(layers: int, length: int, hidden: int, share: float = MEMORY_SHARE) -> int | None:
    """How many windows of ``length`` tokens ``capture`` may keep for ``layers`` layers of width ``hidden`` in
    ``share`` of the memory available now (Linux ``MemAvailable``); ``None`` where that is not known."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            available = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    per_window = 2 * layers * length * hidden * STORE_DTYPE.itemsize
    return int(share * available // per_window)


def _block_losses(model: nn.Module, targets: BlockTargets, rows: torch.Tensor | slice) -> list[torch.Tensor]:
    """Per captured layer, the relative squared error of ``model``'s attention block on ``targets``' windows
    ``rows``."""
    layers = _layers(model)
    device = next(model.parameters()).device
    length = targets.inputs[0].shape[1]
    cos_sin = model.model.rope.cos_sin(torch.arange(length, device=device))
    # the stored bf16 inputs only feed the q/k/v projections: under bf16 autocast they go in as they are
    bf16 = torch.is_autocast_enabled(device.type) and torch.get_autocast_dtype(device.type) == torch.bfloat16
    x_dtype = torch.bfloat16 if bf16 else torch.float32
    losses = []
    for j, i in enumerate(targets.layers):
        x = targets.inputs[j][rows].to(device, x_dtype)
        y = targets.outputs[j][rows].to(device, torch.float32)
        out = layers[i].self_attn(x, is_causal=True, rope_cos_sin=cos_sin)
        losses.append((out.float() - y).pow(2).mean() / max(targets.energy[j], 1e-30))
    return losses


@torch.no_grad()
def block_errors(model: nn.Module, targets: BlockTargets, batch_size: int = 8) -> list[float]:
    """Per captured layer, ``||attn_l(X_l) - Y_l||^2 / ||Y_l||^2`` of ``model``'s blocks over all of ``targets``'
    windows."""
    sums = [0.0] * len(targets.inputs)
    for start in range(0, targets.windows, batch_size):
        rows = slice(start, min(start + batch_size, targets.windows))
        for i, loss in enumerate(_block_losses(model, targets, rows)):
            sums[i] += float(loss) * (rows.stop - rows.start)
    return [s / targets.windows for s in sums]


@dataclass
class LocalResult:
    """What ``train_blocks`` (and ``heal_blocks``) did: per step the summed relative error over the layers (before the
    step's update) and the learning rate; the wall time of the loop. ``heal_blocks`` adds the capture's seconds, the
    windows it captured (held-out ones included) and each layer's error on the held-out windows before and after."""

    losses: list[float]
    lrs: list[float]
    seconds: float
    capture_seconds: float = 0.0
    windows: int = 0
    errors_before: list[float] = field(default_factory=list)
    errors_after: list[float] = field(default_factory=list)


def train_blocks(
    student: nn.Module,
    targets: BlockTargets,
    params: list[nn.Parameter],
    *,
    steps: int,
    lr: float,
    batch_size: int = 4,
    seed: int = 0,
    minutes: float | None = None,
    progress: Callable[[int, float, float], None] | None = None,
    distributed: bool = False,
    precision: str = "fp32",
) -> LocalResult:
    """AdamW on ``params`` (the student's attention projections) for ``steps`` steps or ``minutes``, whichever ends
    first; each step reads ``batch_size`` random windows of ``targets`` through every captured layer's block (its
    forward under bfloat16 autocast with ``precision="bf16"``). The learning rate follows a cosine from ``lr`` to a
    tenth over whichever of steps and time is further along. ``progress(step, loss, seconds_left)`` is called after
    every step.

    ``distributed``: this rank is one of the default process group's, each training its own layers (the ones
    ``_owner`` gives it) with the same ``seed``: the ranks stop at the same step (the slowest rank's clock) and the
    reported loss is the sum over every rank's own layers."""
    if steps < 1 or batch_size < 1 or not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"train_blocks needs steps >= 1, batch_size >= 1 and lr > 0; got {steps}, {batch_size}, {lr}")
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"train_blocks precision must be 'fp32' or 'bf16'; got {precision!r}")
    budget = math.inf if minutes is None else 60.0 * minutes
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    losses, lrs = [], []
    start = _clock()
    device = next(student.parameters()).device
    world = dist.get_world_size() if distributed else 1
    rank = dist.get_rank() if distributed else 0
    counted = torch.tensor([_owner(i, world) == rank for i in targets.layers], device=device)  # (layers here,)
    student.train()
    try:
        for step in range(steps):
            elapsed = slowest_seconds(_clock() - start, device, distributed)
            if elapsed >= budget:
                break
            done = max(step / steps, elapsed / budget)
            step_lr = lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done)))
            for group in opt.param_groups:
                group["lr"] = step_lr
            rows = torch.randint(targets.windows, (batch_size,), generator=gen)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
                per_layer = torch.stack(_block_losses(student, targets, rows)).float()  # (layers here,)
            opt.zero_grad(set_to_none=True)
            per_layer.sum().backward()
            opt.step()
            loss = (per_layer.detach() * counted).sum()  # a layer another rank owns is not counted twice
            if distributed:
                dist.all_reduce(loss)
            value = loss.item()
            if not math.isfinite(value):
                raise FloatingPointError(f"layer-local healing diverged at step {step}: loss {value}; try a smaller lr")
            losses.append(value)
            lrs.append(step_lr)
            if progress is not None:
                seconds = _clock() - start  # left: whichever of the time and the steps ends first
                progress(step, value, max(min(budget - seconds, seconds / (step + 1) * (steps - step - 1)), 0.0))
    finally:
        student.eval()
        for p in params:
            p.grad = None
    return LocalResult(losses, lrs, _clock() - start)


def heal_blocks(
    student: nn.Module,
    teacher: nn.Module,
    windows: torch.Tensor,
    params: list[nn.Parameter],
    *,
    steps: int,
    minutes: float | None = None,
    seed: int = 0,
    progress: bool = True,
    label: str = "healing, layer-local",
    distributed: bool = False,
    precision: str = "fp32",
) -> LocalResult:
    """Healing's layer-local phase: ``capture`` the teacher on ``windows (N, L)`` (the last ``HELD_OUT_WINDOWS`` of
    those captured kept apart when there are enough), then ``train_blocks`` for ``steps`` steps or what is left of
    ``minutes`` (the capture counts), with a progress bar showing the mean error per layer and the time left.

    The capture keeps fewer windows than ``N`` where they would take more than ``MEMORY_SHARE`` of the available
    memory (shared by the ranks on one machine, ``LOCAL_WORLD_SIZE``) or, with ``minutes``, more than
    ``CAPTURE_SHARE`` of the time (never fewer than ``MIN_WINDOWS``).
    ``precision="bf16"`` runs the teacher's capture and the blocks' forward under bfloat16 autocast (the held-out
    errors are measured in float32 either way).

    ``distributed``: every rank of the default process group calls this with the same arguments; each captures and
    trains its own layers, then every layer's ``params`` are broadcast from the rank that trained it, so all ranks
    end with the same weights and result (errors of every layer)."""
    start = _clock()
    count = len(_layers(student))
    world = dist.get_world_size() if distributed else 1
    rank = dist.get_rank() if distributed else 0
    mine = _own_layers(count, rank, world)
    device = next(student.parameters()).device
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if distributed else 1  # (torchrun: per machine)
    fit = windows_that_fit(len(mine), windows.shape[1], teacher.config.hidden_size, MEMORY_SHARE / local_ranks)
    if distributed:  # every rank the same count: the smallest (-1: not known)
        t = torch.tensor([-1 if fit is None else fit], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        fit = None if int(t) < 0 else int(t)
    if fit is not None and fit < len(windows):
        windows = windows[: max(fit, MIN_WINDOWS)]
    seconds = None if minutes is None else 60.0 * minutes * CAPTURE_SHARE
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
        targets = capture(teacher, windows, layers=mine, seconds=seconds, distributed=distributed)
    held = HELD_OUT_WINDOWS if targets.windows > 2 * HELD_OUT_WINDOWS else 0
    train, test = targets.split(held) if held else (targets, targets)
    captured = _clock() - start
    layer_of = {id(p): i for i, layer in enumerate(_layers(student)) for p in layer.parameters()}
    trained = [p for p in params if layer_of.get(id(p)) in mine] if distributed else params
    before = _all_layers(block_errors(student, test), test.layers, count, device, distributed)
    left = None
    if minutes is not None:  # the same on every rank: what the slowest capture left
        left = max(minutes - slowest_seconds(_clock() - start, device, distributed) / 60, 0.0)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps if minutes is None else None, desc=label, unit="step", file=sys.stderr,
                   dynamic_ncols=True)  # fmt: skip

    def show(step: int, loss: float, seconds_left: float) -> None:
        if bar is not None:
            bar.update(1)
            bar.set_postfix(error=f"{loss / count:.3f}", left=f"{seconds_left / 60:.1f} min")

    try:
        if left is not None and left <= 0:
            result = LocalResult([], [], 0.0)
        else:
            result = train_blocks(student, train, trained, steps=steps, lr=LOCAL_LR, batch_size=LOCAL_BATCH,
                                  seed=seed, minutes=left, progress=show, distributed=distributed,
                                  precision=precision)  # fmt: skip
    finally:
        if bar is not None:
            bar.close()
    after = _all_layers(block_errors(student, test), test.layers, count, device, distributed)
    if distributed:  # every layer's weights from the rank that trained it, in the same order on every rank
        for p in params:
            if id(p) in layer_of:
                dist.broadcast(p.data, _owner(layer_of[id(p)], world))
    result.capture_seconds = slowest_seconds(captured, device, distributed)
    result.windows = targets.windows
    result.errors_before, result.errors_after = before, after
    return result


def _all_layers(
    errors: list[float], layers: list[int], count: int, device: torch.device, distributed: bool
) -> list[float]:
    """Per-layer ``errors`` of ``layers`` as a list over all ``count`` layers, with every rank's own layers."""
    if not distributed:
        return errors
    full = torch.zeros(count, dtype=torch.float64, device=device)
    world, rank = dist.get_world_size(), dist.get_rank()
    for e, i in zip(errors, layers, strict=True):
        if _owner(i, world) == rank:
            full[i] = e
    dist.all_reduce(full)
    return full.tolist()
