"""Healing: a short distillation of a converted model (the student) from the model it came from (the teacher).

The GQA paper (arXiv 2305.13245) "uptrains" a mean-pooled checkpoint on 5% of the pre-training compute; here the
budget is minutes on a CPU, so instead of language-model training the student learns the teacher's next-token
distributions: the loss is the mean over tokens of ``KL(teacher || student)`` on the logits (the same quantity
``gqa eval --reference`` reports), on windows of ``seq_len`` tokens cut from a text both models read.

One step: take ``batch_size`` windows (non-overlapping chunks of the text, shuffled every pass with ``seed``), run
the teacher without gradients and the student with them, AdamW on the trained parameters (``train="attention"``: the
q/k/v/o projections, where the conversion changed the model; ``"all"``: every parameter), gradient norm clipped to
1, linear warm-up then cosine decay of the learning rate to a tenth. ``minutes`` bounds the loop's wall time as
well: healing then stops at whichever limit comes first, and the schedule follows whichever is further along
(``max(step / steps, elapsed / budget)``), so a time-bounded run still ends its cosine at a tenth of the peak.
``precision="bf16"`` runs both models' forward and backward passes under bfloat16 autocast (the weights, the optimizer
and the KL stay float32): on a CPU with native bf16 matmul (AVX512-BF16 or AMX) a step takes half the time of
``"fp32"`` with the same losses to three decimals, but on one without (AVX2 only) PyTorch emulates it and a step takes
25x as long. ``"auto"`` (default; ``resolve_precision``) picks ``"bf16"`` only where the hardware has it.
"""

from __future__ import annotations

import copy
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .._atomic import atomic_path
from ..hardware import available_memory, fast_bf16
from ..options.defaults import PRECISIONS, SHARDINGS, TRAINABLE, HealConfig
from .layer_local import LOCAL_WINDOWS, LocalResult, heal_blocks, slowest_seconds
from .lora import add_lora, fold_lora

__all__ = [
    "PRECISIONS",
    "SHARDINGS",
    "TRAINABLE",
    "HealConfig",
    "HealResult",
    "heal",
    "kl_loss",
    "resolve_precision",
    "save_loss_curve",
]

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def resolve_precision(precision: str, device: torch.device | str = "cpu") -> str:
    """The precision healing runs in on ``device``: ``"bf16"`` or ``"fp32"`` as given, and for ``"auto"``, ``"bf16"``
    where the hardware multiplies bfloat16 natively (a CUDA GPU that supports it; a CPU with AVX512-BF16 or AMX),
    else ``"fp32"`` (on an AVX2-only CPU, bf16 autocast makes a healing step 25x slower, not 2x faster)."""
    if precision not in PRECISIONS:
        raise ValueError(f"heal precision must be one of {', '.join(PRECISIONS)}; got {precision!r}")
    if precision != "auto":
        return precision
    return "bf16" if fast_bf16(device) else "fp32"


@dataclass
class HealResult:
    """What ``heal`` did.

    Attributes
    ----------
    losses : per step taken (``steps``, unless ``minutes`` ran out first), the mean ``KL(teacher || student)`` in
        nats per token on that step's windows, measured before the step's update (so ``losses[0]`` is the converted
        model's loss).
    lrs : the learning rate of each step.
    seconds : wall time of the loop (the teacher's and the student's passes and the updates; not ``callback``).
    cpu_seconds : CPU time of this process during the loop, all threads together (unlike ``seconds``, it does not
        grow while the process waits for a busy machine).
    tokens_per_step : ``batch_size * seq_len``.
    config : the ``HealConfig`` used.
    precision : what the passes ran in, ``"bf16"`` or ``"fp32"`` (``config.precision`` may say ``"auto"``).
    sharding : across processes, ``"ddp"`` or ``"fsdp"`` as it ran; ``"none"`` in one process.
    local : the layer-local phase (``local_share > 0``), or ``None``; ``losses`` and ``lrs`` are the end-to-end
        phase's, ``seconds`` covers both.
    """

    losses: list[float]
    lrs: list[float]
    seconds: float
    tokens_per_step: int
    config: HealConfig
    trained_parameters: int = 0
    cpu_seconds: float = 0.0
    precision: str = "fp32"
    sharding: str = "none"
    local: LocalResult | None = None

    @property
    def seconds_per_step(self) -> float:
        """Wall seconds per end-to-end step: ``seconds`` less the layer-local phase's capture and steps."""
        local = 0.0 if self.local is None else self.local.seconds + self.local.capture_seconds
        return max(self.seconds - local, 0.0) / max(len(self.losses), 1)


def kl_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    weights: torch.Tensor | None = None,
    total: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean over positions of ``KL(teacher || student)`` in nats: logits ``(B, L, vocab)`` each, float32 softmax;
    with ``weights (B, L)``, the weighted mean ``sum w_t KL_t / sum w_t``. ``total`` replaces the denominator (the
    position count or ``sum w_t``): a process holding part of a batch divides by the whole batch's."""
    s = student_logits.float().flatten(0, -2).log_softmax(-1)  # (B*L, vocab)
    t = teacher_logits.float().flatten(0, -2).log_softmax(-1)
    if weights is None and total is None:
        return F.kl_div(s, t, log_target=True, reduction="batchmean")  # sum_v p (log p - log q), mean over positions
    per_position = F.kl_div(s, t, log_target=True, reduction="none").sum(-1)  # (B*L,)
    w = torch.ones_like(per_position) if weights is None else weights.flatten().to(per_position)
    total = w.sum() if total is None else torch.as_tensor(total, dtype=per_position.dtype)
    return (per_position * w).sum() / total.clamp_min(1e-12)


def _world() -> tuple[int, int]:
    """``(rank, world size)`` of the default process group, ``(0, 1)`` without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


FSDP_SHARE = 0.8  # of a device's memory: more than this for replicated models and optimizer picks FSDP


def _device_memory(device: torch.device, world: int) -> int:
    """Bytes one rank may use: the GPU's memory, or on the CPU the available memory shared by the local ranks."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    available = available_memory()
    if available is None:
        return 2**62
    return available // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world)))


def fsdp_needed(student: nn.Module, teacher: nn.Module, params: list, device: torch.device, world: int) -> bool:
    """Whether replicating both models and the optimizer state (gradients and AdamW's two moments of the trained
    ``params``) on every rank would take more than ``FSDP_SHARE`` of a rank's memory on ``device``."""
    weights = sum(p.numel() * p.element_size() for m in (student, teacher) for p in m.parameters())
    optimizer = 3 * sum(p.numel() * 4 for p in params)
    return weights + optimizer > FSDP_SHARE * _device_memory(device, world)


def _fully_sharded(model: nn.Module, device: torch.device) -> nn.Module:
    """``model`` sharded in place across the default group's ranks with FSDP2: each decoder layer
    (``model.model.layers``) its own unit, the rest (embeddings, norm, head) the root's; shards on ``device``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in getattr(getattr(model, "model", None), "layers", []):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


@torch.no_grad()
def _gather_into(student: nn.Module, sharded: nn.Module) -> None:
    """Copy the sharded copy's parameters into ``student``, one gathered parameter at a time (a collective)."""
    own = dict(student.named_parameters())
    for name, p in sharded.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        own[name].copy_(full.to(own[name].device))


def trainable_parameters(model: nn.Module, train: str) -> list[nn.Parameter]:
    """The parameters ``train`` names: ``"attention"`` (q/k/v/o projection weights and biases),
    ``"attention+mlp-lora"`` (those and the LoRA adapters ``gqa.convert.lora.add_lora`` put on the model) or
    ``"all"``."""
    if train not in TRAINABLE:
        raise ValueError(f"train must be one of {', '.join(TRAINABLE)}; got {train!r}")
    params, seen = [], set()
    for name, p in model.named_parameters():  # tied weights appear once
        if id(p) in seen:
            continue
        seen.add(id(p))
        adapter = train == "attention+mlp-lora" and name.rsplit(".", 1)[-1] in ("lora_a", "lora_b")
        if train == "all" or adapter or any(f".{proj}." in name for proj in _ATTENTION):
            params.append(p)
    return params


_clock = time.perf_counter  # the wall clock of the ``minutes`` budget (tests replace it)


def _lr_at(step: int, steps: int, warmup: int, lr: float, time_fraction: float = 0.0) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay from ``lr`` to ``lr / 10`` at the last step — or, when
    ``time_fraction`` (of a time budget, elapsed) is further along than the steps are, at the end of the budget."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = max((step - warmup) / max(steps - warmup - 1, 1), time_fraction)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def _window_starts(n: int, seq_len: int, starts: Sequence[int] | None) -> list[int]:
    """Where windows begin: every ``seq_len`` tokens, or at ``starts`` (moved back so a window fits in ``n``)."""
    if starts is None:
        return list(range(0, n - seq_len + 1, seq_len))
    if any(not 0 <= s < n for s in starts):
        raise ValueError(f"window starts must lie in [0, {n}) (the token count)")
    return sorted({min(int(s), n - seq_len) for s in starts})


def _windows(starts: list[int], seq_len: int, gen: torch.Generator):
    """Endless window offsets: ``starts`` in a new random order every pass."""
    while True:
        for j in torch.randperm(len(starts), generator=gen).tolist():
            yield starts[j]


def heal(
    student: nn.Module,
    teacher: nn.Module,
    token_ids: Sequence[int] | torch.Tensor,
    *,
    steps: int,
    lr: float | None = None,
    seq_len: int = 256,
    batch_size: int = 1,
    train: str = "attention",
    warmup: int | None = None,
    seed: int = 0,
    precision: str = "auto",
    minutes: float | None = None,
    sharding: str = "auto",
    device: torch.device | str | None = None,
    progress: bool = True,
    callback: Callable[[int, float], None] | None = None,
    weights: Sequence[float] | torch.Tensor | None = None,
    starts: Sequence[int] | None = None,
    local_share: float = 0.0,
) -> HealResult:
    """Distil ``student`` from ``teacher`` in place: ``steps`` AdamW steps on ``KL(teacher || student)`` of the logits.

    Parameters
    ----------
    student : the converted model, ``model(input_ids (B, L)) -> logits (B, L, vocab)``; its parameters are updated
        in place and it is left in eval mode with ``requires_grad`` as it was.
    teacher : the source model (same vocabulary); only read, without gradients.
    token_ids : ``(N,)`` the healing text's token ids, ``N >= seq_len`` (never the evaluation text).
    steps : optimizer steps, ``>= 1``.
    lr : peak learning rate of the end-to-end phase (AdamW, no weight decay); ``None``: 1e-4 (``END_TO_END_LR``)
        without a layer-local phase, 2e-5 (``AFTER_LOCAL_LR``) after one, where a rate that moves a merge fast
        undoes what the phase did (docs/conversion.md). The layer-local phase has its own (``LOCAL_LR``).
    seq_len : tokens per window (at most the models' context).
    batch_size : windows per step.
    train : ``"attention"`` (q/k/v/o projections only), ``"attention+mlp-lora"`` (and rank-``MLP_LORA_RANK`` LoRA
        adapters on every MLP projection, folded into the weights at the end: ``gqa.convert.lora``) or ``"all"``
        (every parameter, embeddings included).
    warmup : warm-up steps; default ``min(20, steps // 10)``.
    seed : seeds the window order (same seed, same data and the same result on the same machine).
    precision : ``"bf16"`` runs the teacher's and the student's passes under bfloat16 autocast (weights, gradients,
        optimizer state and the KL stay float32); ``"fp32"`` runs everything in float32; ``"auto"`` (default) is
        ``"bf16"`` where the device multiplies bfloat16 natively, else ``"fp32"`` (``resolve_precision``).
    minutes : wall-time budget of the loop, or ``None``: no step starts after it is spent, and the learning-rate
        schedule runs on elapsed time when that is further along than the step count (module docstring). Pass a
        large ``steps`` to heal for exactly this long. Where it binds, the number of steps depends on the machine.
    progress : show a tqdm progress bar (on stderr) with the running loss.
    weights : ``(N,)`` loss weight of the prediction made at each position of ``token_ids`` (e.g. more on the answer
        tokens of a conversation, 0 where a window would predict across a document boundary); default all 1.
    starts : offsets in ``token_ids`` where windows may begin (e.g. each conversation's first token; a start too close
        to the end is moved back to fit); default every ``seq_len`` tokens (non-overlapping chunks).
    local_share : the share of the budget (of ``minutes`` when given, else of ``steps``) spent first on the
        layer-local phase (``gqa.convert.layer_local.heal_blocks``: every merged attention block trained alone to
        reproduce the teacher's block on the teacher's hidden states, up to ``LOCAL_WINDOWS`` windows captured
        once); the end-to-end KL gets the rest. 0 (default here): end-to-end only; ``gqa convert`` and
        ``HealConfig`` default to 0.5 (docs/conversion.md: answer KL 0.323 -> 0.300 after 30 minutes on SmolLM2
        3 -> 1).
    sharding : ``"auto"``, ``"ddp"`` or ``"fsdp"``: how several processes share the work (below); ignored alone.
    device : where the passes run; default the student's. With DDP or alone the models are moved there.
    callback : called as ``callback(step, loss)`` after every step. Its own time (e.g. scoring the student on an
        evaluation text every few hundred steps) is not counted against ``minutes`` nor in ``HealResult.seconds``
        and ``cpu_seconds``.

    Across processes (a torch.distributed process group of ``N > 1`` ranks is initialized, e.g. under torchrun):
    data-parallel (``DistributedDataParallel``; gloo on CPU, NCCL on GPU). Every rank draws the same windows and
    takes its ``batch_size / N`` of each step (``batch_size`` must be a multiple of ``N``), divides its loss by the
    whole batch's position count (or weight), and the gradients are averaged: the same steps as one process with the
    same ``batch_size`` and ``seed``, up to float summation order. The time budget is the slowest rank's. Every rank
    ends with the same weights and ``HealResult``. ``sharding="fsdp"`` shards copies of both models across the ranks
    instead (FSDP2 ``fully_shard`` per decoder layer and the rest; parameters, gradients and AdamW's moments each
    ``1 / N`` per rank, on ``device``), for a student that does not fit one device; the same steps again, and the
    healed weights are gathered back into ``student`` (which, like ``teacher``, can stay on the CPU). ``"auto"``
    (default): FSDP where the replicated models and the optimizer would take more than ``FSDP_SHARE`` of the
    device's memory (``fsdp_needed``), else DDP. The layer-local phase deals the layers out instead (rank ``r``
    trains layers ``r, r + N, ...`` and broadcasts them; the same training as one process's in ``~1 / N`` of its
    step time), so it gets through ``~N`` times the steps of a time budget.

    Returns
    -------
    HealResult : per-step losses and learning rates, wall time.
    """
    cfg = HealConfig(steps, lr, seq_len, batch_size, train, warmup, seed, precision, minutes, sharding, local_share)
    lr = cfg.lr  # (None: the default for the phases that run)
    budget = None if minutes is None else 60.0 * minutes
    warmup = min(20, steps // 10) if warmup is None else warmup
    ids = torch.as_tensor(token_ids, dtype=torch.long).flatten().cpu()
    if len(ids) < seq_len:
        raise ValueError(f"the healing text is {len(ids)} tokens long; seq_len ({seq_len}) needs at least as many")
    if weights is not None:
        weights = torch.as_tensor(weights, dtype=torch.float32).flatten().cpu()
        if weights.shape != ids.shape or not bool(torch.isfinite(weights).all() and (weights >= 0).all()):
            raise ValueError(
                f"weights must be {tuple(ids.shape)} finite non-negative numbers (one per token), "
                f"got shape {tuple(weights.shape)}"
            )
    offsets = _window_starts(len(ids), seq_len, starts)
    for m in (student, teacher):
        context = getattr(getattr(m, "config", None), "max_position_embeddings", None)
        if context is not None and seq_len > context:
            raise ValueError(f"seq_len ({seq_len}) exceeds the model's context of {context} tokens")
    device = next(student.parameters()).device if device is None else torch.device(device)
    precision = resolve_precision(precision, device)
    rank, world = _world()
    if batch_size % world:
        raise ValueError(
            f"heal batch_size ({batch_size}) must be a multiple of the number of processes ({world}): each process "
            f"takes batch_size / {world} windows of every step"
        )
    per_rank = batch_size // world
    if train == "attention+mlp-lora":
        add_lora(student, seed=seed)  # folded into the MLP weights when healing ends, however it ends
    params = trainable_parameters(student, train)
    was = {id(p): p.requires_grad for p in student.parameters()}
    train_ids = {id(p) for p in params}
    for p in student.parameters():
        p.requires_grad_(id(p) in train_ids)

    def slowest(seconds: float) -> float:  # the same value on every rank: the largest
        return slowest_seconds(seconds, device, world > 1)

    start, cpu_start = _clock(), time.process_time()
    local = None
    local_steps = min(round(steps * local_share), steps - 1) if budget is None else steps
    if local_share > 0 and local_steps > 0:
        teacher.eval()
        try:
            local = _local_phase(student, teacher, ids, offsets, seq_len, local_steps, minutes, local_share, seed,
                                 device, progress and rank == 0, world > 1, precision)  # fmt: skip
        except BaseException:
            for p in student.parameters():
                p.requires_grad_(was[id(p)])
            fold_lora(student)
            raise
        if budget is None:
            steps -= local_steps
            warmup = min(warmup, steps)
    # the same on every rank (the end-to-end schedule runs on the time after it); no clock reading without the phase
    local_seconds = 0.0 if local is None else slowest(_clock() - start)
    sharded = world > 1 and (sharding == "fsdp" or (sharding == "auto" and fsdp_needed(student, teacher, params,
                                                                                        device, world)))  # fmt: skip
    if sharded:  # copies, sharded onto ``device``; the healed weights come back into ``student`` at the end
        model, teacher = _fully_sharded(copy.deepcopy(student), device), _fully_sharded(copy.deepcopy(teacher), device)
        params = trainable_parameters(model, train)
    else:
        student.to(device)
        teacher.to(device)
        model = student
        if world > 1:
            ids_ = [device.index] if device.type == "cuda" and device.index is not None else None
            model = DistributedDataParallel(student, device_ids=ids_)
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    windows = _windows(offsets, seq_len, gen)
    losses, lrs = [], []
    bar = None
    if progress and rank == 0:
        from tqdm.auto import tqdm

        total = steps if budget is None else None  # under a time budget the step count is not known ahead
        desc = "healing" if local is None else "healing 2/2: end-to-end"
        bar = tqdm(total=total, desc=desc, unit="step", file=sys.stderr, dynamic_ncols=True)
    teacher.eval()
    model.train()
    paused = paused_cpu = 0.0  # wall and CPU seconds spent in ``callback``, left out of the budget and the result

    def healing_time() -> float:  # wall seconds since the start, less the callback's
        return _clock() - start - paused

    failed = True
    try:
        for step in range(steps):
            elapsed = healing_time() if budget is None else slowest(healing_time())
            if budget is not None and elapsed >= budget:
                break
            begins = [next(windows) for _ in range(batch_size)]  # every rank draws them all, and takes its share
            mine = begins[rank * per_rank : (rank + 1) * per_rank]
            batch = torch.stack([ids[b : b + seq_len] for b in mine]).to(device)  # (B / N, L)
            w = None if weights is None else torch.stack([weights[b : b + seq_len] for b in mine]).to(device)
            total = None
            if world > 1:  # the whole batch's positions (or weight): DDP averages the ranks' gradients
                total = batch_size * seq_len if weights is None else float(sum(weights[b : b + seq_len].sum()
                                                                                for b in begins))  # fmt: skip
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
                with torch.no_grad():
                    target = teacher(batch)  # (B, L, vocab)
                logits = model(batch)
            loss = kl_loss(logits, target, w, total)  # float32 softmax either way
            done = 0.0 if budget is None else (elapsed - local_seconds) / max(budget - local_seconds, 1e-9)
            step_lr = _lr_at(step, steps, warmup, lr, done)  # the end-to-end phase's own share of the budget
            for group in opt.param_groups:
                group["lr"] = step_lr
            opt.zero_grad(set_to_none=True)
            (loss * world).backward()  # DDP averages over the ranks: the sum of their shares
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            if world > 1:
                loss = loss.detach().clone()
                dist.all_reduce(loss)  # the whole batch's loss
            value = loss.item()
            if not math.isfinite(value):
                raise FloatingPointError(f"healing diverged at step {step}: loss {value}; try a smaller lr")
            losses.append(value)
            lrs.append(step_lr)
            if bar is not None:
                bar.update(1)
                left = {} if budget is None else {"left": f"{max(budget - healing_time(), 0) / 60:.1f} min"}
                bar.set_postfix(kl=f"{value:.3f}", **left)
            if callback is not None:
                called, called_cpu = _clock(), time.process_time()
                callback(step, value)
                paused += _clock() - called
                paused_cpu += time.process_time() - called_cpu
        failed = False
    finally:
        if bar is not None:
            bar.close()
        student.eval()
        for p in student.parameters():
            p.requires_grad_(was[id(p)])
            p.grad = None
        if sharded and not failed:
            _gather_into(student, model)  # a collective: not after a failure
        fold_lora(student)
    seconds, cpu_seconds = slowest(healing_time()), time.process_time() - cpu_start - paused_cpu
    n = sum(p.numel() for p in params)
    how = "fsdp" if sharded else "ddp" if world > 1 else "none"
    return HealResult(losses, lrs, seconds, batch_size * seq_len, cfg, n, cpu_seconds, precision, how, local)


def _local_phase(
    student: nn.Module,
    teacher: nn.Module,
    ids: torch.Tensor,
    offsets: list[int],
    seq_len: int,
    steps: int,
    minutes: float | None,
    share: float,
    seed: int,
    device: torch.device,
    progress: bool,
    distributed: bool,
    precision: str,
) -> LocalResult:
    """``heal``'s layer-local phase on up to ``LOCAL_WINDOWS`` windows drawn (with ``seed``) from ``offsets``, in
    ``precision``; with ``distributed``, the ranks share the layers (``gqa.convert.layer_local``)."""
    student.to(device)
    teacher.to(device)
    pick = torch.randperm(len(offsets), generator=torch.Generator().manual_seed(seed))[:LOCAL_WINDOWS].tolist()
    windows = torch.stack([ids[offsets[j] : offsets[j] + seq_len] for j in pick])  # (N, L)
    return heal_blocks(
        student, teacher, windows, trainable_parameters(student, "attention"), steps=steps,
        minutes=None if minutes is None else minutes * share, seed=seed, progress=progress,
        label="healing 1/2: layer-local", distributed=distributed, precision=precision,
    )  # fmt: skip


def save_loss_curve(result: HealResult, path: str | Path, title: str | None = None) -> Path:
    """Plot ``result.losses`` (each step, and a running mean) against the step as a PNG at ``path``, atomically:
    drawn into a temporary file in the same folder and renamed into place. Uses matplotlib's Agg backend (no
    display needed)."""
    import matplotlib

    matplotlib.use("Agg")  # before pyplot; no display
    from matplotlib.figure import Figure

    path = Path(path)
    losses = result.losses
    k = max(1, len(losses) // 20)
    smooth = [
        sum(losses[max(0, i - k + 1) : i + 1]) / len(losses[max(0, i - k + 1) : i + 1]) for i in range(len(losses))
    ]
    fig = Figure(figsize=(7, 4), dpi=100)
    ax = fig.subplots()
    steps = range(1, len(losses) + 1)
    ax.plot(steps, losses, lw=0.8, alpha=0.4, label="per step")
    ax.plot(steps, smooth, lw=2, label=f"mean of last {k}")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("KL(teacher || student), nats/token")
    c = result.config
    ax.set_title(title or f"healing: train={c.train}, lr={c.lr:g}, {result.tokens_per_step} tokens/step")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    return path
