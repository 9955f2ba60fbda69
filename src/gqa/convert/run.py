"""Running a conversion: ``convert(src, dst, kv_heads=N)`` checks it (``gqa.convert.plan``), then rank 0 streams the
converted weights into a hidden folder (``gqa.convert.streaming``) with the config, healing runs on every rank
(``gqa.convert.shared_healing``), the tokenizer and healing's files are added (``gqa.convert.extras``), and the folder
is renamed into place (``gqa.convert.writer.staged``)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import torch

from ..loaders import read_model
from ..models.config import ModelConfig
from ..options.defaults import DEFAULT_METHOD
from ..parallel.distributed import launched_world
from .calibration import default_calibration_text, default_heal_text
from .conversations import ConversationSet, model_content_hash, self_generated_conversations
from .data import HealData, calibration_ids, heal_data
from .extras import write_extras
from .healing import HealConfig
from .plan import ConversionPlan, Converted, check_conversion
from .shards import DEFAULT_MAX_SHARD_SIZE
from .shared_healing import forget_waiting_group, heal_folder, waiting_group
from .streaming import stream_convert
from .writer import staged, write_config


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
    with launched_world(plan.device) as (rank, world):
        try:
            _convert_on_rank(plan, rank, world, force, progress)
        finally:
            forget_waiting_group()  # goes with the world it was made in
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
            result = heal_folder(plan, tmp, data, world, progress)
        if rank == 0:
            write_extras(tmp, plan, data, None if heal is None else result)
    if world > 1:
        waiting_group().barrier()  # every rank returns once the result is in place


def _convert_into(folder: Path, plan: ConversionPlan, progress: bool) -> Converted:
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
    return Converted(new_cfg, data, chats)


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


def _source_conversations(
    cfg: ModelConfig, state: dict[str, torch.Tensor], plan: ConversionPlan, progress: bool
) -> ConversationSet:
    """The source model's self-generated conversations (from the cache when it has them)."""
    from ..models import CausalLM

    model = CausalLM.from_state(cfg, state, assign=True)  # shares the source tensors: only read
    return self_generated_conversations(
        model, plan.tok, model_content_hash(plan.resolved), plan.conversation_settings, progress=progress
    )
