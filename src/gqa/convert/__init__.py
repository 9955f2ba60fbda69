"""Change a model's number of KV heads and write the result as an HF checkpoint folder.

``convert(src, dst, kv_heads=N)`` reads a GGUF file or HF folder, gives every layer ``N`` KV heads — exact
expansion when ``N`` is a multiple of ``H_kv``, a registered method (``mean``, ``first``, ...; see
``gqa.convert.methods``) when ``N`` divides ``H_kv`` — and writes ``config.json``, ``model.safetensors``,
``generation_config.json`` and the tokenizer to ``dst``, which loads in ``gqa.load_model`` and in transformers.
``convert(..., heal=HealConfig(steps=N))`` first distils the converted model from the source (``gqa.convert.healing``;
``heal(student, teacher, token_ids, steps=N)`` is the same on models in memory).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from ..loaders import read_model, resolve_model_path
from ..models.config import ModelConfig
from . import pca as _pca  # noqa: F401 - registers the "pca" method
from .calibration import default_calibration_text, default_heal_text
from .conversations import ConversationSet, has_chat_template, model_content_hash, self_generated_conversations
from .data import HEAL_PROSE_SHARE, HealData, calibration_ids, heal_data
from .healing import PRECISIONS, TRAINABLE, HealConfig, HealResult, heal, resolve_precision, save_loss_curve
from .methods import (
    METHODS,
    AttentionWeights,
    Method,
    check_kv_heads,
    convert_layer,
    layer_tensor_names,
    register_method,
)
from .refit import refit_convert_state
from .writer import check_destination, write_checkpoint

if TYPE_CHECKING:
    from ..tokenizer import Tokenizer

__all__ = [
    "DEFAULT_METHOD",
    "HEAL_LOG_NAME",
    "HEAL_PLOT_NAME",
    "METHODS",
    "PRECISIONS",
    "TRAINABLE",
    "AttentionWeights",
    "HealConfig",
    "HealResult",
    "Method",
    "convert",
    "convert_state",
    "heal",
    "refit_convert_state",
    "register_method",
    "resolve_precision",
    "save_loss_curve",
]

DEFAULT_METHOD = "pca"  # calibrated, training-free; far better than the paper's mean-pooling (docs/conversion.md)
NEEDS_CALIBRATION = {"pca"}
HEAL_PLOT_NAME = "heal_loss.png"  # written inside DST when healing: the loss curve
HEAL_LOG_NAME = "heal_log.json"  # and the per-step losses, learning rates, settings and timing


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
        names = layer_tensor_names(i)
        w = AttentionWeights(**{f: state.get(n) for f, n in names.items()})
        new = convert_layer(w, cfg, kv_heads, method, None if activations is None else activations[i])
        for f, n in names.items():
            t = getattr(new, f)
            if t is not None:
                out[n] = t
    return dataclasses.replace(cfg, num_kv_heads=kv_heads), out


def _calibration_activations(
    cfg: ModelConfig, state: dict[str, torch.Tensor], tok: Tokenizer, text: str | list[int], progress: bool = False
) -> list[torch.Tensor]:
    """Per layer ``(T, hidden)``: the input of each attention (after ``input_layernorm``) in the source model, on
    ``text`` (or token ids) cut into windows of at most ``min(max_position_embeddings, 2048)`` tokens."""
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
    window = min(cfg.max_position_embeddings, 2048)
    starts = tqdm(range(0, len(ids), window), desc="calibration", unit="window", disable=not progress, file=sys.stderr)
    try:
        with torch.inference_mode():
            for start in starts:
                model(torch.tensor([ids[start : start + window]]))
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
    progress: bool = True,
) -> Path:
    """Convert a model to ``kv_heads`` KV heads and write it as an HF checkpoint folder.

    Parameters
    ----------
    src : str, Path or None
        A ``.gguf`` file, an HF checkpoint folder, a folder with one ``.gguf`` file, or ``None`` for the embedded
        SmolLM2-135M-Instruct (9 query heads, 3 KV heads). Never written to.
    dst : str or Path
        The folder to write (required): ``config.json``, ``model.safetensors`` (float32; no ``lm_head.weight`` when
        tied), ``generation_config.json`` and the source's tokenizer files. Must not be, lie inside or contain the
        source.
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
        learning rates, settings, timing).
    heal_text : str or None
        The text healing reads (never the evaluation text); default for a chat model its self-generated
        conversations, answer tokens weighted, mixed with docstrings (``gqa.convert.data.heal_data``), else
        ``default_heal_text()`` (~1.2 MB of standard-library docstrings, kept disjoint from CPython's ``LICENSE.txt``).
    conversations : bool or None
        Whether the calibration and healing that are not given a text read self-generated conversations
        (``gqa.convert.conversations``: the source writes them, the first time in minutes, then they are read from
        a cache keyed by its content hash). ``None`` (default): when the source's tokenizer has a chat template.
        ``False``: prose only, as before. ``True``: required (``ValueError`` without a chat template).
    progress : bool
        Show progress bars (generating conversations, merging and refitting the layers, healing).

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

    An exception or interrupt while healing leaves no ``dst`` (nothing is written before the healed model is ready).
    """
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
    if src is not None and not Path(src).expanduser().exists():
        raise FileNotFoundError(f"source model {src} does not exist")
    resolved = resolve_model_path(None if src is None else Path(src).expanduser())
    sources = [resolved] if src is None else [Path(src), resolved]
    out = check_destination(sources, Path(dst), force)  # fail before the slow part
    cfg, state = read_model(resolved)
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
    chats = None
    if _use_conversations(conversations, tok, (calibrating and calibration_text is None) or
                          (heal is not None and heal_text is None)):  # fmt: skip
        chats = _source_conversations(cfg, state, resolved, tok, progress)
    activations = None
    if calibrating:
        if calibration_text is not None or chats is None:
            ids = tok.encode(default_calibration_text() if calibration_text is None else calibration_text)
        else:
            ids = calibration_ids(tok, chats.train)
        if do_refit:
            new_cfg, new_state = refit_convert_state(cfg, state, kv_heads, method, ids, progress=progress)
        else:
            activations = _calibration_activations(cfg, state, tok, ids, progress)
    if not do_refit:
        new_cfg, new_state = convert_state(cfg, state, kv_heads, method, activations)
    result = None
    if heal is not None:
        if heal_text is None and chats is not None:
            data = heal_data(tok, chats.train, heal.seq_len)
        else:
            data = HealData(tok.encode(default_heal_text() if heal_text is None else heal_text), None, None)
        new_state, result = _heal_state(cfg, state, new_cfg, new_state, data, heal, progress)

    def extra(folder: Path) -> None:
        if tok is not None:
            tok.hf.save_pretrained(folder)
        if result is not None:
            save_loss_curve(result, folder / HEAL_PLOT_NAME, f"healing {cfg.num_kv_heads} -> {kv_heads} KV heads "
                            f"({method}), train={heal.train}, lr={heal.lr:g}")  # fmt: skip
            text = "default_heal_text()" if heal_text is None else f"{len(heal_text)} characters given"
            log = {
                "config": dataclasses.asdict(result.config),
                "text": text
                if heal_text is not None or chats is None
                else "self-generated conversations + "
                f"default_heal_text() ({len(chats.train)} conversations, {HEAL_PROSE_SHARE:.0%} of windows prose)",
                "seconds": result.seconds,
                "seconds_per_step": result.seconds_per_step,
                "cpu_seconds": result.cpu_seconds,
                "threads": torch.get_num_threads(),
                "precision": result.precision,
                "tokens_per_step": result.tokens_per_step,
                "trained_parameters": result.trained_parameters,
                "losses": result.losses,
                "lrs": result.lrs,
            }
            (folder / HEAL_LOG_NAME).write_text(json.dumps(log, indent=1) + "\n", encoding="utf-8")

    return write_checkpoint(
        out, new_cfg, new_state, force=force, generation_config=_generation_config(resolved, cfg), extra=extra
    )


def _use_conversations(conversations: bool | None, tok: Tokenizer | None, wanted: bool) -> bool:
    """Whether calibration or healing (``wanted``: one of them has no text given) reads conversations."""
    if conversations is not None and not isinstance(conversations, bool):
        raise TypeError(f"conversations must be a bool or None, got {type(conversations).__name__}")
    if conversations and not has_chat_template(tok):
        raise ValueError("conversations=True needs a source whose tokenizer has a chat template; this one has none")
    return wanted and conversations is not False and has_chat_template(tok)


def _source_conversations(
    cfg: ModelConfig, state: dict[str, torch.Tensor], resolved: Path, tok: Tokenizer, progress: bool
) -> ConversationSet:
    """The source model's self-generated conversations (from the cache when it has them)."""
    from ..models import CausalLM

    model = CausalLM.from_state(cfg, state, assign=True)  # shares the source tensors: only read
    return self_generated_conversations(model, tok, model_content_hash(resolved), progress=progress)


def _heal_state(
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    new_cfg: ModelConfig,
    new_state: dict[str, torch.Tensor],
    data: HealData,
    config: HealConfig,
    progress: bool,
) -> tuple[dict[str, torch.Tensor], HealResult]:
    """Heal the converted model (``new_cfg``, ``new_state``) from the source (``cfg``, ``state``) on ``data``:
    the healed tensors by HF name (the same names as ``new_state``) and the ``HealResult``."""
    from ..models import CausalLM

    teacher = CausalLM.from_state(cfg, state, assign=True)  # shares the source tensors: only read
    student = CausalLM.from_state(new_cfg, new_state)  # its own copy: trained in place
    result = heal(
        student, teacher, data.ids, weights=data.weights, starts=data.starts, progress=progress,
        **dataclasses.asdict(config),
    )  # fmt: skip
    healed = student.state_dict()
    return {name: healed[name].detach() for name in new_state}, result
