"""Change a model's number of KV heads and write the result as an HF checkpoint folder.

``convert(src, dst, kv_heads=N)`` reads a GGUF file or HF folder, gives every layer ``N`` KV heads — exact
expansion when ``N`` is a multiple of ``H_kv``, a registered method (``mean``, ``first``, ...; see
``gqa.convert.methods``) when ``N`` divides ``H_kv`` — and writes ``config.json``, ``model.safetensors``,
``generation_config.json`` and the tokenizer to ``dst``, which loads in ``gqa.load_model`` and in transformers.
``convert(..., heal=HealConfig(steps=N))`` first distils the converted model from the source (``gqa.convert.healing``;
``heal(student, teacher, token_ids, steps=N)`` is the same on models in memory).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import warnings
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from ..hardware import available_memory
from ..loaders import read_model, resolve_model_path
from ..loaders.lazy import LazyModel, open_lazy
from ..models.config import ModelConfig
from ..options.defaults import DEFAULT_METHOD, HEAL_LOG_NAME, HEAL_PLOT_NAME
from ..parallel.distributed import launched_world
from . import pca as _pca  # noqa: F401 - registers the "pca" method
from .calibration import default_calibration_text, default_heal_text
from .conversations import (
    CALIBRATION_CONVERSATIONS,
    HEALING_CONVERSATIONS,
    ConversationSet,
    GenerationSettings,
    has_chat_template,
    model_content_hash,
    self_generated_conversations,
)
from .data import HEAL_PROSE_SHARE, HealData, calibration_ids, heal_data
from .healing import PRECISIONS, TRAINABLE, HealConfig, HealResult, heal, resolve_precision, save_loss_curve
from .methods import (
    METHODS,
    AttentionWeights,
    Method,
    check_kv_heads,
    convert_layer,
    layer_weights,
    local_rope,
    put_layer_weights,
    register_method,
    rope_config,
)
from .refit import refit_convert_state
from .shards import DEFAULT_MAX_SHARD_SIZE, SAFETENSORS_DTYPES, parse_size
from .streaming import source_windows, stream_convert
from .writer import check_destination, remove_weights, staged, write_config, write_weights

if TYPE_CHECKING:
    from ..loaders.tokenizer import Tokenizer

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

NEEDS_CALIBRATION = {"pca"}


def convert_state(
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    kv_heads: int,
    method: str = "mean",
    activations: list[torch.Tensor] | None = None,
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """In memory: a model's config and HF-named tensors with ``kv_heads`` KV heads in every layer.

    Parameters
    ----------
    cfg, state : as ``gqa.loaders.read_model`` returns them (float32 tensors by HF name).
    kv_heads : N, the new KV head count.
    method : a name in ``METHODS``, used when N < ``cfg.num_kv_heads``.
    activations : per layer, ``(T, hidden)`` calibration inputs of the attention, or ``None``.

    Returns
    -------
    (ModelConfig, dict) : the new config (``num_kv_heads = N``) and a new dict; tensors that do not change are the
    input's own (not copies).
    """
    check_kv_heads(cfg, kv_heads, method)
    out = dict(state)
    for i in range(cfg.num_layers):
        new = convert_layer(
            layer_weights(state, i), rope_config(cfg, local_rope(cfg, i)), kv_heads, method,
            None if activations is None else activations[i],
        )  # fmt: skip
        put_layer_weights(out, i, new)
    return dataclasses.replace(cfg, num_kv_heads=kv_heads), out


def _calibration_activations(
    cfg: ModelConfig, state: dict[str, torch.Tensor], tok: Tokenizer, text: str | list[int], progress: bool = False
) -> list[torch.Tensor]:
    """Per layer ``(T, hidden)``: the input of each attention (after ``input_layernorm``) in the source model, on
    ``text`` (or token ids) cut into windows of at most ``min(max_position_embeddings, SOURCE_WINDOW)`` tokens
    (``source_windows``). The model in memory; ``stream_convert`` computes the same a layer at a time."""
    from ..models import CausalLM

    ids = tok.encode(text) if isinstance(text, str) else text
    if not ids:
        raise ValueError("calibration_text encodes to no tokens")
    model = CausalLM.from_state(cfg, state, assign=True)  # shares the tensors: no second copy of the weights
    acts: list[list[torch.Tensor]] = [[] for _ in range(cfg.num_layers)]
    hooks = [
        layer.self_attn.register_forward_pre_hook(lambda _m, args, i=i: acts[i].append(args[0].flatten(0, 1)))
        for i, layer in enumerate(model.model.layers)
    ]
    windows = tqdm(source_windows(cfg, ids), desc="calibration", unit="window", disable=not progress, file=sys.stderr)
    try:
        with torch.inference_mode():
            for window in windows:
                model(window)
    finally:
        for h in hooks:
            h.remove()
    return [torch.cat(a) for a in acts]  # (T, hidden) each


def _generation_config(resolved: Path, cfg: ModelConfig) -> dict[str, Any]:
    """The source folder's ``generation_config.json`` if it has one, else the special token ids of ``cfg``."""
    file = resolved / "generation_config.json"
    if resolved.is_dir() and file.is_file():
        try:
            return json.loads(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            pass  # an unreadable optional file: write a fresh one
    eos = cfg.eos_token_id[0] if len(cfg.eos_token_id) == 1 else (cfg.eos_token_id or None)
    ids = {"bos_token_id": cfg.bos_token_id, "eos_token_id": eos, "pad_token_id": cfg.pad_token_id}
    return {k: v for k, v in ids.items() if v is not None}


def _source_tokenizer(resolved: Path) -> Tokenizer | None:
    from ..loaders import load_tokenizer

    try:
        return load_tokenizer(resolved)
    except ValueError as e:
        warnings.warn(f"{resolved}: no usable tokenizer, the converted model will have none ({e})", stacklevel=3)
        return None


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


def convert(
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
    progress: bool = True,
) -> Path:
    """Convert a model to ``kv_heads`` KV heads and write it as an HF checkpoint folder.

    The source is read one layer at a time (``gqa.convert.streaming``): memory holds about one layer, the embeddings
    and the calibration activations, not the model, so models larger than memory convert. Healing (and generating
    the calibration conversations) needs the model in memory.

    Parameters
    ----------
    src : str, Path or None
        A ``.gguf`` file, an HF checkpoint folder (single-file or sharded safetensors), a folder with one ``.gguf``
        file, or ``None`` for the embedded SmolLM2-135M-Instruct (9 query heads, 3 KV heads). Never written to.
    dst : str or Path
        The folder to write (required): ``config.json``, ``model.safetensors`` (or shards of at most
        ``max_shard_size`` with ``model.safetensors.index.json``, HF's layout; no ``lm_head.weight`` when tied),
        ``generation_config.json`` and the source's tokenizer files. Must not be, lie inside or contain the source.
    kv_heads : int
        N, the new number of KV heads; must divide the number of query heads ``H_q``. ``N > H_kv`` (a multiple of
        ``H_kv``) repeats each KV head ``N / H_kv`` times: the model computes exactly what it did. ``N < H_kv``
        (a divisor of ``H_kv``) merges groups of ``H_kv / N`` adjacent heads with ``method``. ``N == H_kv`` copies.
    method : str
        A name in ``METHODS``, only used when reducing: ``"pca"`` (default; calibrated RoPE-commuting key merge and
        ``o_proj``-weighted value PCA, see ``gqa.convert.pca``), ``"mean"`` (GQA paper: mean-pool each group's K/V
        weights and biases) or ``"first"`` (keep each group's first head).
    force : bool
        Replace an existing ``dst``. The old folder is deleted only after the new one is in place.
    calibration_text : str or None
        Text run through the source model to give methods per-layer attention inputs ``(T, hidden)``; ``mean`` and
        ``first`` do not use them. ``pca`` defaults to the source's self-generated conversations mixed with
        standard-library docstrings (``gqa.convert.data.calibration_ids``) for a chat model, else to
        ``default_calibration_text()`` (docstrings alone).
    refit : bool or None
        After each layer's merge, solve its ``v_proj`` and ``o_proj`` again by least squares so the layer's attention
        output matches the source's on the calibration text, layer by layer on the converted model's own activations
        (``gqa.convert.refit``, ``gqa.convert.value_refit``). Default ``None``: on for ``pca``, off for ``mean`` and
        ``first`` (the GQA paper's methods as published). Only used when merging; needs the calibration text
        (default as for ``pca``).
    heal : HealConfig or None
        Heal the merged model before writing it (only when ``kv_heads < H_kv``): ``heal.steps`` steps (or fewer,
        if ``heal.minutes`` of wall time run out first) of distillation from the source model
        (``gqa.convert.healing.heal``; learning rate, window length, batch, which parameters train, seed, precision).
        ``dst`` then also holds ``heal_loss.png`` (the loss curve) and ``heal_log.json`` (per-step losses and
        learning rates, settings, timing). Under torchrun (``WORLD_SIZE > 1``) healing is data-parallel across the
        processes (``heal``'s docstring): rank 0 converts, every rank heals, rank 0 writes.
    heal_text : str or None
        The text healing reads (never the evaluation text); default for a chat model its self-generated
        conversations, answer tokens weighted, mixed with docstrings (``gqa.convert.data.heal_data``), else
        ``default_heal_text()`` (~1.2 MB of standard-library docstrings, kept disjoint from CPython's ``LICENSE.txt``).
    conversations : bool or None
        Whether the calibration and healing that are not given a text read self-generated conversations
        (``gqa.convert.conversations``: the source writes them, the first time in minutes, then they are read from
        a cache keyed by its content hash). ``None`` (default): when the source's tokenizer has a chat template and
        the model fits in memory (``fits_in_memory``). ``False``: prose only. ``True``: required (``ValueError``
        without a chat template).
    calibration_conversations : int or None
        User turns sampled for the calibration conversations (the calibration reads every one of their training
        split, then ``CALIBRATION_PROSE_TOKENS`` of docstrings); default ``CALIBRATION_CONVERSATIONS``, the knee of
        the measured curve (docs/conversion.md). Healing on conversations reads ``HEALING_CONVERSATIONS`` (or this
        many, if more), the calibration still the first ``calibration_conversations`` of them.
    dtype : torch.dtype or None
        The written weights' dtype; default the source's (bf16 in, bf16 out; a GGUF's quantized blocks: float32).
        The arithmetic is float32 either way.
    device : str or torch.device
        Where calibration, merging, the refit and healing run: ``"auto"`` (default) is the CUDA GPU when there is one,
        else the CPU.
    max_shard_size : int or str
        Bytes per weight file (``"5GB"``, transformers' default): more weights than that are sharded.
    progress : bool
        Show progress bars (generating conversations, converting the layers with the time left, healing).

    Returns
    -------
    Path : the resolved ``dst``.

    Raises
    ------
    FileNotFoundError
        ``src`` does not exist.
    FileExistsError
        ``dst`` exists and ``force`` is false.
    ValueError
        Unknown ``method``; ``kv_heads`` < 1, not dividing ``H_q``, or incompatible with ``H_kv``; ``dst`` overlaps
        the source; an unreadable source; ``heal`` when not merging, or ``heal_text`` without ``heal``.

    An exception or interrupt leaves no ``dst`` (the files are written into a hidden folder renamed at the end).
    """
    plan = check_conversion(
        src, dst, kv_heads=kv_heads, method=method, force=force, calibration_text=calibration_text, refit=refit,
        heal=heal, heal_text=heal_text, conversations=conversations,
        calibration_conversations=calibration_conversations, dtype=dtype, device=device, max_shard_size=max_shard_size,
    )  # fmt: skip
    return run_conversion(plan, force=force, progress=progress)


def run_conversion(plan: ConversionPlan, *, force: bool = False, progress: bool = True) -> Path:
    """The conversion ``check_conversion`` checked into ``plan`` (``convert``'s work after its checks; ``gqa convert``
    calls it with the plan its own check made, so the source is not checked twice). Returns the resolved ``dst``."""
    global _WAITING
    with launched_world(plan.device) as (rank, world):
        try:
            _convert_on_rank(plan, rank, world, force, progress)
        finally:
            _WAITING = None  # goes with the world it was made in
    return plan.out


def _convert_on_rank(plan: ConversionPlan, rank: int, world: int, force: bool, progress: bool) -> None:
    """``run_conversion``'s work on one rank: rank 0 converts and writes, every rank heals its share."""
    heal = plan.heal
    if world > 1 and heal is None:
        raise ValueError("only healing runs across processes: run a conversion without healing as one process")
    with staged(plan.out, force) if rank == 0 else contextlib.nullcontext() as tmp:
        data = None
        if rank == 0:
            data = _convert_into(tmp, plan, progress)
        if heal is not None:
            result = _heal_folder(plan, tmp, data, world, progress)
        if rank == 0:
            _write_extras(tmp, plan, data, None if heal is None else result)
    if world > 1:
        _waiting_group().barrier()  # every rank returns once the result is in place


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


@dataclasses.dataclass
class _Converted:
    """What rank 0's conversion hands to healing and to the extra files."""

    cfg: ModelConfig
    heal_data: HealData | None
    chats: ConversationSet | None


def _convert_into(folder: Path, plan: ConversionPlan, progress: bool) -> _Converted:
    """Rank 0: stream the conversion's weights into ``folder`` (and prepare the healing data)."""
    cfg, tok = plan.source.config, plan.tok
    chats = None
    if plan.chats_wanted:
        chats = _source_conversations(cfg, read_model(plan.resolved)[1], plan, progress)
    ids = None
    if plan.calibrating:
        if plan.calibration_text is not None or chats is None:
            text = default_calibration_text() if plan.calibration_text is None else plan.calibration_text
            ids = tok.encode(text)
        else:
            ids = calibration_ids(tok, chats.first(plan.calibration_conversations).train)
    new_cfg, _ = stream_convert(
        plan.source, folder, plan.kv_heads, plan.method, calibration_ids=ids, refit=plan.do_refit, dtype=plan.cast,
        device=plan.device, max_shard_size=plan.max_shard_size, progress=progress,
    )  # fmt: skip
    write_config(folder, new_cfg, plan.dtype, _generation_config(plan.resolved, cfg))
    data = None
    if plan.heal is not None:
        if plan.heal_text is None and chats is not None:
            data = heal_data(tok, chats.train, plan.heal.seq_len)
        else:
            data = HealData(tok.encode(default_heal_text() if plan.heal_text is None else plan.heal_text), None, None)
    return _Converted(new_cfg, data, chats)


def _waiting_group() -> Any:
    """A gloo group over every rank with ``CONVERSION_WAIT_S`` of timeout, for the ranks waiting on rank 0's
    conversion (which can take far longer than the training collectives' ``GQA_DIST_TIMEOUT``)."""
    global _WAITING
    if _WAITING is None:
        _WAITING = torch.distributed.new_group(backend="gloo", timeout=timedelta(seconds=CONVERSION_WAIT_S))
    return _WAITING


_WAITING = None
CONVERSION_WAIT_S = 6 * 3600.0


def _heal_folder(
    plan: ConversionPlan, folder: Path | None, data: _Converted | None, world: int, progress: bool
) -> HealResult:
    """Every rank: heal the converted model written in rank 0's ``folder`` from the source; rank 0 then rewrites the
    weights there."""
    from ..models import CausalLM

    if world > 1:
        shared = [None if folder is None else (str(folder), data)]
        torch.distributed.broadcast_object_list(shared, src=0, group=_waiting_group())
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


def _write_extras(folder: Path, plan: ConversionPlan, data: _Converted, result: HealResult | None) -> None:
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


def _use_conversations(conversations: bool | None, tok: Tokenizer | None, wanted: bool) -> bool:
    """Whether calibration or healing (``wanted``: one of them has no text given) reads conversations."""
    if conversations is not None and not isinstance(conversations, bool):
        raise TypeError(f"conversations must be a bool or None, got {type(conversations).__name__}")
    if conversations and not has_chat_template(tok):
        raise ValueError("conversations=True needs a source whose tokenizer has a chat template; this one has none")
    return wanted and conversations is not False and has_chat_template(tok)


def _source_conversations(
    cfg: ModelConfig, state: dict[str, torch.Tensor], plan: ConversionPlan, progress: bool
) -> ConversationSet:
    """The source model's self-generated conversations (from the cache when it has them)."""
    from ..models import CausalLM

    model = CausalLM.from_state(cfg, state, assign=True)  # shares the source tensors: only read
    return self_generated_conversations(
        model, plan.tok, model_content_hash(plan.resolved), plan.conversation_settings, progress=progress
    )
